"""Eager vs graph-replayed CudaRunner launches (docs/cuda-kernels.md, "CUDA graphs").

    PYTHONPATH=. python3 -m openjev.tools.bench.graphs [--shape 27b] [--reps 10]

Two runners on the same seeded weights, one with the graph cache off. Every timed launch gets
fresh random tokens (the same for both runners); the host clock brackets run_launch plus a
device synchronize; median of --reps after warm-ups (the graph runner's first launch of a
shape, its capture, is reported apart).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from openjev.worker.cuda.fused_weights import SHAPES
from openjev.worker.cuda.runner import CudaRunner
from openjev.worker.runner_api import SegmentRun


def timed(runner, runs) -> tuple[float, list]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = runner.run_launch(runs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, results


def case(name, eager, graph, make_runs, reps, rows):
    """make_runs(runner) -> runs with the tokens drawn for this repetition."""
    first, _ = timed(graph, make_runs(graph, 0))
    timed(eager, make_runs(eager, 0))
    times: dict[str, list[float]] = {"eager": [], "graph": []}
    worst = 0.0
    for rep in range(1, reps + 1):
        te, re_ = timed(eager, make_runs(eager, rep))
        tg, rg = timed(graph, make_runs(graph, rep))
        times["eager"].append(te)
        times["graph"].append(tg)
        worst = max(
            [worst]
            + [abs(a.head_score - b.head_score) for a, b in zip(rg, re_, strict=True) if b.head_score is not None]
        )
    me, mg = statistics.median(times["eager"]), statistics.median(times["graph"])
    rows.append((name, me, mg, first, worst))
    print(
        f"{name}: eager {me:.1f} ms, graph {mg:.1f} ms ({me / mg:.2f}x), first graph launch (capture) "
        f"{first:.0f} ms, max |score diff| {worst:.2e}; eager all {[round(t, 1) for t in times['eager']]}, "
        f"graph all {[round(t, 1) for t in times['graph']]}",
        flush=True,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="27b", choices=sorted(SHAPES), help="the synthetic model's shape")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prefix", type=int, default=2048)
    return p


def main() -> None:
    args = parser().parse_args()
    graph = CudaRunner.synthetic(args.shape, seed=0, graph_capture_after=1)
    eager = CudaRunner.on_weights_of(
        graph,
        graph_cache_size=0,
    )
    vocab = graph.config.vocab_size
    rows: list[tuple] = []

    def toks(seed: int, n: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(vocab) for _ in range(n)]

    case(
        "1 x 512 tokens",
        eager,
        graph,
        lambda r, rep: [SegmentRun(toks(rep, 512), 0, None, False, True)],
        args.reps,
        rows,
    )
    prefix = toks(12345, args.prefix)
    parents = {}
    for runner in (eager, graph):
        ms, res = timed(runner, [SegmentRun(prefix, 0, None, True, False)])
        parents[id(runner)] = res[0].state
        print(f"{args.prefix}-token prefix launch ({'graph' if runner.graphs else 'eager'}, first): {ms:.1f} ms")
    case(
        f"33 x 24-token tails on a {args.prefix}-token prefix",
        eager,
        graph,
        lambda r, rep: [
            SegmentRun(toks(10**6 + rep * 100 + c, 24), args.prefix, parents[id(r)], False, True) for c in range(33)
        ],
        args.reps,
        rows,
    )
    L = graph.graphs
    print(
        f"graph cache: hits {L.hits}, misses {L.misses}, capture failures {L.failures}, "
        f"captures {L.cache.num_captures}; peak device memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB"
    )
    print("| case | eager ms | graph ms | speed-up | first graph launch ms | max abs score diff |")
    for name, me, mg, first, worst in rows:
        print(f"| {name} | {me:.1f} | {mg:.1f} | {me / mg:.2f}x | {first:.0f} | {worst:.1e} |")


if __name__ == "__main__":
    main()
