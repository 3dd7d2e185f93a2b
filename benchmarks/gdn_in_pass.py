"""The GDN recurrence inside a pass against alone: one level of segments on 27B shapes, replayed
from CUDA graphs, timed with CUDA events, arms interleaved; medians and spreads of `--rounds`:
- alone: the level's segments only;
- in a pass's grid: the same segments first among `--segments` (a graph's padded segment
  count), the level's range covering only them.
Levels: `--levels`, each COUNTxTOKENS, or a parent level and its children in one launch,
PxTOKENS+CxTOKENS (every child of the first parent, as a question's candidates under its
prefix). `--depth D` launches with D levels, those past the given ones empty, as a graph pass of
the budget's depth does. `--variants` times each recurrence shape of
`kernels.GDN_VARIANTS` in the pass's grid, each segment starting from a kept state as a child
does, and checks that every variant's outputs and final states are bit-equal to the first's.
`--ab` times only the pass's grid (rows named for benchmarks/kernels_ab.py, so that two builds'
runs compare) and `--save FILE` keeps its outputs, for a bit comparison between builds.

Earlier forms of this script: commit 07f4a3a timed one 676-token segment after an idle GPU and
after 24 down products (the same 0.26 ms: the clock was not why the recurrence ran slower in a
pass); commit 122dca5 timed the grid of one block per (segment, column block, head), with and
without a cap of 2 blocks an SM, segments along the grid's z or x (docs/cuda-kernels.md), which
led to the work-taking schedule of gated_delta.cu.

    python3 benchmarks/gdn_in_pass.py [--levels 1x676,7x30,2x300,33x20,1x100+7x25] [--segments 65]
        [--rounds 30] [--depth 8] [--variants s8c32x2,s8c16x1b6,...] [--ab] [--save FILE.pt] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from openjev.worker.cuda import kernels as K

H, HK, D = 48, 16, 128
DEV = "cuda"


def level_inputs(lengths: list[int], pad_to: int, init: bool = False, depth: int = 1, parents: int = 0):
    """Inputs of one launch: `lengths` segments, then empty ones up to `pad_to` segments; with
    `init`, each starts from a state of its own (as a child starts from its parent's); the first
    `parents` form a level of their own and the others are children of the first; `depth`
    levels in all (the ones past those empty)."""
    T = sum(lengths)
    bounds = [0, parents, len(lengths)] if parents else [0, len(lengths)]
    level_off = bounds + [len(lengths)] * (depth + 1 - len(bounds))
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))] + [T] * (pad_to - len(lengths)))
    qn = torch.nn.functional.normalize(torch.randn(T, HK, D, device=DEV), dim=-1) * D**-0.5
    kn = torch.nn.functional.normalize(torch.randn(T, HK, D, device=DEV), dim=-1)
    conv = torch.randn(T, 2 * HK * D + H * D, device=DEV).bfloat16()
    return dict(
        qn=qn,
        kn=kn,
        kq=(qn * kn).sum(-1),
        v=conv[:, 2 * HK * D :].unflatten(1, (H, D)),
        g=-torch.rand(T, H, device=DEV) * 0.5 - 0.01,
        beta=torch.rand(T, H, device=DEV),
        cu_seqlens=cu.to(torch.int32).to(DEV),
        level_off=torch.tensor(level_off, dtype=torch.int32, device=DEV),
        init_state=torch.randn(pad_to, H, D, D, device=DEV) * 0.1 if init else None,
        # with `parents`, children read the first parent's final state (row 0 of this launch's)
        init_idx=torch.tensor(
            [-2 if parents and n >= parents else n if init else -1 for n in range(pad_to)],
            dtype=torch.int32,
            device=DEV,
        ),
    )


def captured(inputs: dict, variant: str = K.GDN_DEFAULT) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """(a graph of the level's launch, its outputs: o and the final states)."""
    a = inputs
    run = lambda: K.gdn_recurrent(  # noqa: E731
        a["qn"],
        a["kn"],
        a["kq"],
        a["v"],
        a["g"],
        a["beta"],
        a["cu_seqlens"],
        init_state=a["init_state"],
        variant=variant,
        init_idx=a["init_idx"],
        level_off=a["level_off"],
        levels=a["level_off"].numel() - 1,
    )
    run()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


def parse_level(spec: str) -> tuple[list[int], int, str]:
    """--levels entry COUNTxTOKENS[+COUNTxTOKENS] -> (segment lengths, parents, label): with a
    `+`, the first part's segments are parents and the rest their children (level_inputs)."""
    parts = [[int(n) for n in part.split("x")] for part in spec.split("+")]
    lengths = [length for count, length in parts for _ in range(count)]
    return lengths, parts[0][0] if len(parts) > 1 else 0, spec.replace("x", " x ").replace("+", " + ")


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """One replay of `graph`, event to event (ms), queued while the GPU is busy."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # the host queues the replay while the GPU is busy
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1x676,7x30,2x300,33x20", help="COUNTxTOKENS, ...: segments of one level")
    p.add_argument("--segments", type=int, default=65)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--variants", default="", help="NAME,...: time these shapes in the pass's grid (first: reference)")
    p.add_argument("--depth", type=int, default=1, help="levels a launch has (those past the given ones empty)")
    p.add_argument("--ab", action="store_true", help="only the pass's grid, rows for benchmarks/kernels_ab.py")
    p.add_argument("--save", default="", help="FILE: the pass grid's outputs (torch.save), for a bit comparison")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.manual_seed(0)  # the same inputs in every run and build (--save compares builds' outputs)
    variants = [v for v in args.variants.split(",") if v]
    graphs, outputs, keep = {}, {}, []
    sizes = {}  # level -> (segments, tokens)
    for spec in args.levels.split(","):
        lengths, parents, level = parse_level(spec)
        sizes[level] = (len(lengths), sum(lengths))
        if variants:
            inputs = level_inputs(lengths, args.segments, init=True, depth=args.depth, parents=parents)
            keep.append(inputs)  # a graph holds its inputs' addresses, not the tensors
            for variant in variants:
                graphs[(level, variant)], outputs[(level, variant)] = captured(inputs, variant)
            continue
        arms = [] if args.ab else [("alone", len(lengths))]
        for grid, pad_to in arms + [(f"in a {args.segments}-segment grid", args.segments)]:
            inputs = level_inputs(lengths, pad_to, depth=args.depth, parents=parents)
            keep.append(inputs)
            graphs[(level, grid)], outputs[(level, grid)] = captured(inputs)
    times: dict[tuple, list[float]] = {arm: [] for arm in graphs}
    for _ in range(args.rounds + 3):
        for arm, graph in graphs.items():  # interleaved: drift lands on every arm alike
            times[arm].append(replay_ms(graph))
    mismatches = []
    for (level, variant), (o, final) in outputs.items() if variants else ():  # replayed last with their inputs
        o_ref, final_ref = outputs[(level, variants[0])]
        N = sizes[level][0]
        if not (torch.equal(o, o_ref) and torch.equal(final[:N], final_ref[:N])):
            mismatches.append(f"{level} {variant}")
    if args.save:
        torch.save(
            {f"{level} {arm}": (o, final[: sizes[level][0]]) for (level, arm), (o, final) in outputs.items()}, args.save
        )
    what = "variants in the pass's grid, segments from kept states" if variants else f"gdn_recurrent_{K.GDN_DEFAULT}"
    print(f"{torch.cuda.get_device_name()}: {what}, ms")
    print(f"{'level':<12} {'arm':<24} {'median':>8} {'min':>8} {'max':>8}")
    rows = []
    for (level, grid), ts in times.items():
        ts = ts[3:]
        med = statistics.median(ts)
        rows.append(dict(level=level, grid=grid, median_ms=med, min_ms=min(ts), max_ms=max(ts)))
        if args.ab:  # kernels_ab.py's keys
            rows[-1].update(op=f"gdn_recurrent {level} depth {args.depth}", tokens=sizes[level][1], ms=med)
        print(f"{level:<12} {grid:<24} {med:>8.4f} {min(ts):>8.4f} {max(ts):>8.4f}")
    if variants:
        verdict = "DIFFER: " + ", ".join(mismatches) if mismatches else "equal in every level"
        print(f"bits against {variants[0]}: {verdict}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "bits_differ": mismatches}, f, indent=1)


if __name__ == "__main__":
    main()
