"""Would a wider set of cuBLASLt algorithms make the products of 128-1,024 rows faster? (GPU only)

At start the runner asks cuBLASLt's heuristic for 16 algorithms with no workspace and keeps the
unsplit ones that give a long product's bits (gemm.lt_plan). A 281-token pass's products ran
1.27x their compute at its 320 rows (docs/benchmarks/index.md, the twenty-fourth session's
profile). This probe asks for `--heuristics` algorithms with up to `--workspace-mib` of workspace,
keeps those with no split of K, no reduction scheme and a long product's bits at each row count,
and times the fastest of them against the runner's own choice: CUDA graphs of `--calls`
back-to-back calls, replays interleaved, medians, us a call. The last table sums a 27B pass's 256
products (48 GDN and 16 attention layers) at each row count.

    python3 benchmarks/lt_space_probe.py [--workspace-mib 64] [--heuristics 64] [--rows 128,160,...]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from kernels_gpu import time_graph

from openjev.worker.cuda import cublaslt, gemm

# 27B: (N, K) -> products a pass runs of it (48 GDN layers, 16 attention layers)
SHAPES = {
    (16480, 5120): 48,  # gdn in
    (14336, 5120): 16,  # attention in
    (5120, 6144): 64,  # out (both kinds)
    (34816, 5120): 64,  # gate_up
    (5120, 17408): 64,  # down
}
ROWS = [128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]  # the graph buckets 128-1,024


def time_arms(arms: dict, calls: int, replays: int, rounds: int) -> dict[str, float]:
    """us a call, the median over `rounds` interleaved graph timings of each arm."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            ms = time_graph(lambda fn=fn: [fn() for _ in range(calls)], reps=replays)
            samples[name].append(1e3 * ms / calls)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace-mib", type=int, default=64)
    p.add_argument("--heuristics", type=int, default=64)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--tflops", type=float, default=780.0, help="the bf16 rate the compute column assumes")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    weights = {key: torch.randn(*key, device="cuda", dtype=torch.bfloat16) * 0.02 for key in SHAPES}
    min_rows = gemm.calibrate(list(weights.values()))
    stream_rows = gemm.stream_plan(list(weights.values()))
    totals: dict[int, dict[str, float]] = {m: {"runner": 0.0, "wide": 0.0} for m in rows}
    print(f"rows {rows}; wide: {args.heuristics} asked, workspace up to {args.workspace_mib} MiB")
    for key, w in weights.items():
        n, k = key
        runner_lt = cublaslt.UnsplitLinear(n, k)
        gemm.choose_algorithms(runner_lt, w, min_rows[key], stream_rows[key], rows)
        wide = cublaslt.UnsplitLinear(n, k, args.workspace_mib << 20, args.heuristics)
        x_all = gemm.reference_rows(w)
        full = F.linear(x_all, w)
        print(f"\nweight {key} (x{SHAPES[key]} a pass): us a product")
        print("| rows | compute | runner (path) | wide best | wide / runner | exact: no-ws 16 / wide |")
        print("|---|---|---|---|---|---|")
        for m in rows:
            x = x_all[:m]
            exact_wide = [a for a in wide.candidates(m) if torch.equal(wide(x, w, a), full[:m])]
            exact_base = [a for a in runner_lt.candidates(m) if torch.equal(runner_lt(x, w, a), full[:m])]
            runner = functools.partial(gemm.linear, x, w, min_rows[key], stream_rows[key], runner_lt)
            path = "lt" if m in runner_lt.chosen else "other"
            if not exact_wide:
                t = time_arms({"runner": runner}, args.calls, args.replays, 3)
                best_name, best = "none", t["runner"]
            else:
                # every exact wide algorithm once, then the fastest against the runner, interleaved
                first = time_arms(
                    {f"w{i}": functools.partial(wide, x, w, a) for i, a in enumerate(exact_wide)}, args.calls, 3, 1
                )
                best_name = min(first, key=first.__getitem__)
                algo = exact_wide[int(best_name[1:])]
                t = time_arms({"runner": runner, "wide": functools.partial(wide, x, w, algo)}, args.calls,
                              args.replays, 3)  # fmt: skip
                best = t["wide"]
            compute = 1e6 * 2 * m * n * k / (args.tflops * 1e12)
            totals[m]["runner"] += SHAPES[key] * t["runner"]
            totals[m]["wide"] += SHAPES[key] * min(best, t["runner"])
            print(
                f"| {m} | {compute:.1f} | {t['runner']:.1f} ({path}) | {best:.1f} ({best_name}) | "
                f"{best / t['runner']:.3f} | {len(exact_base)} / {len(exact_wide)} |"
            )
    print("\na pass's 256 products (ms), the wide set taken only where faster")
    print("| rows | compute | runner | with the wide set | saved |")
    print("|---|---|---|---|---|")
    for m in rows:
        compute = sum(c * 2 * m * n * k for (n, k), c in SHAPES.items()) / (args.tflops * 1e12) * 1e3
        r, wd = totals[m]["runner"] / 1e3, totals[m]["wide"] / 1e3
        print(f"| {m} | {compute:.2f} | {r:.2f} | {wd:.2f} | {100 * (1 - wd / r):.1f}% |")


if __name__ == "__main__":
    main()
