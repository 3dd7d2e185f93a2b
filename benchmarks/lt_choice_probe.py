"""Is the runner's start-up choice of product paths stable, and do its flips cost time? (GPU only)

At start the CUDA runner times, for each 27B product shape and each graph row count up to
runner.LT_ROWS, cuBLASLt's unsplit algorithms against its other path (gemm.choose_algorithms:
medians of 5 single-call CUDA-event timings) and keeps the faster. The gates reports of two runs
of one tree listed different row counts. This probe runs that choice `--runs` times on the same
weights, lists the row counts whose choice changed between runs, and times both paths there
more carefully: a CUDA graph of `--calls` back-to-back calls per path (no host gaps), replays
interleaved, medians, us a call.

    python3 benchmarks/lt_choice_probe.py [--runs 3] [--calls 20] [--replays 15]
"""

from __future__ import annotations

import argparse
import functools

import torch
from kernels_gpu import time_graph

from openjev.worker.cuda import cublaslt, gemm
from openjev.worker.cuda.buckets import Bucketing, PassBudget
from openjev.worker.cuda.runner import LT_ROWS

SHAPES = [
    (16480, 5120),
    (5120, 6144),
    (34816, 5120),
    (5120, 17408),
    (14336, 5120),
]  # 27B: gdn in, out, gate_up, down, attn in


def ident(algo) -> tuple | None:
    """An algorithm's identity (its opaque bytes), None for the other path."""
    return None if algo is None else tuple(algo.data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=15)
    args = p.parse_args()
    rows = [t for t in Bucketing(PassBudget()).token_steps() if t <= LT_ROWS]  # the runner's default budget
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in SHAPES]
    min_rows = gemm.calibrate(weights)
    stream_rows = gemm.stream_plan(weights)
    print(f"row counts timed: {rows}")
    for w in weights:
        key = tuple(w.shape)
        choices = []
        for _ in range(args.runs):
            lt = cublaslt.UnsplitLinear(*key)
            gemm.choose_algorithms(lt, w, min_rows[key], stream_rows[key], rows)
            choices.append({m: lt.chosen.get(m) for m in rows})
        flips = [m for m in rows if len({ident(c[m]) for c in choices}) > 1]
        print(f"\n{key}: cuBLASLt chosen at {[sorted(m for m in c if c[m] is not None) for c in choices]}")
        print(f"  row counts whose choice changed between runs: {flips or 'none'}")
        x_all = gemm.reference_rows(w)
        for m in flips:
            x = x_all[:m]
            arms = {"other path": functools.partial(gemm.linear, x, w, min_rows[key], stream_rows[key])}
            for run, c in enumerate(choices):
                if c[m] is not None and all(ident(c[m]) != ident(d[m]) for d in choices[:run]):
                    lt = cublaslt.UnsplitLinear(*key)
                    arms[f"lt (run {run + 1}'s)"] = functools.partial(lt, x, w, c[m])
            # us a call: graph replays of `calls` back-to-back calls, no host gaps
            times = {
                name: 1e3 * time_graph(lambda fn=fn: [fn() for _ in range(args.calls)], reps=args.replays) / args.calls
                for name, fn in arms.items()
            }
            base = times["other path"]
            cells = ", ".join(f"{name} {t:.1f} us ({t / base:.3f}x)" for name, t in times.items())
            print(f"  {m} rows: {cells}")


if __name__ == "__main__":
    main()
