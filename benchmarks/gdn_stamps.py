"""Where a launch of the GDN recurrence spends its time beyond its tokens: block time stamps.

gdn_in_pass.py's launches cost ~13 us more than their token chains explain (docs/cuda-kernels.md,
"Not done / next"). This probe compiles cuda/gated_delta.cu with GDN_STAMPS (the worker never
does), so thread 0 of every block records %globaltimer at its start, once its role is known
(worker or not), at its first item's ticket, after the parent wait, when the first buffer landed,
after the item's tokens, after the final state and flag, when it left the work loop and at its
exit. Each level is launched as a pass's graph does (a 65-segment grid, 8 levels), replayed
`--rounds` times; per replay the stamps are read back and reduced, and the table gives medians
over replays (us). A graph of one tiny kernel, timed the same way, shows what the events and a
replay cost alone.

    python3 benchmarks/gdn_stamps.py [--levels 1x20,1x96,1x100+7x25,4x60,33x20,1x676] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from gdn_in_pass import captured, level_inputs, parse_level, replay_ms  # run from benchmarks/

from openjev.worker.cuda import kernels as K

# the kernel's enum, in order (gated_delta.cu)
FIELDS = ("start", "role", "ticket", "parent", "buffer", "tokens", "flag", "loop", "exit", "items")
BLOCKS = 1024
_source = K.kernel_source


def stamped_source(name: str) -> str:
    code = _source(name)
    return "#define GDN_STAMPS 1\n" + code if name == "gated_delta" else code


def stamps_view():
    import cupy

    pointer = K._module("gated_delta").get_global("gdn_stamps")
    return cupy.ndarray((BLOCKS, len(FIELDS)), dtype=cupy.uint64, memptr=pointer)


def reduce(stamps, grid: int) -> dict[str, float]:
    """One replay's stamps -> us figures (module docstring)."""
    s = {f: stamps[:grid, i].astype("int64") for i, f in enumerate(FIELDS)}
    t0 = int(s["start"].min())
    workers = s["items"] > 0
    w = {f: s[f][workers] for f in FIELDS}

    def med(a, b):  # median over the workers of stamp b - stamp a
        return float(np.median(w[b] - w[a]) / 1000.0) if workers.any() else float("nan")

    return {
        "span": (int(s["exit"].max()) - t0) / 1000.0,
        "start skew": (int(s["start"].max()) - t0) / 1000.0,
        "workers": float(workers.sum()),
        "items a worker (max)": float(s["items"].max()),
        "first ticket after t0": float(np.median(w["ticket"] - t0) / 1000.0) if workers.any() else float("nan"),
        "role": med("start", "role"),
        "ticket": med("role", "ticket"),
        "parent wait": med("ticket", "parent"),
        "first buffer": med("parent", "buffer"),
        "tokens": med("buffer", "tokens"),
        "state + flag": med("tokens", "flag"),
        "rest of loop": med("flag", "loop"),
        "exit": med("loop", "exit"),
        "last flag after t0": (int(w["flag"].max()) - t0) / 1000.0 if workers.any() else float("nan"),
        "last exit after last flag": (int(s["exit"].max()) - int(w["flag"].max())) / 1000.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="1x20,1x96,1x100+7x25,4x60,33x20,1x676")
    p.add_argument("--segments", type=int, default=65)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    K.kernel_source = stamped_source  # before the first launch compiles the module
    torch.manual_seed(0)
    grid = 4 * torch.cuda.get_device_properties(0).multi_processor_count  # gdn_recurrent's grid
    assert grid <= BLOCKS
    tiny_in = torch.zeros(1, device="cuda")
    tiny_in.add_(1)
    tiny = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tiny):
        tiny_in.add_(1)
    tiny_us = [replay_ms(tiny) * 1000.0 for _ in range(args.rounds + 3)][3:]
    print(f"{torch.cuda.get_device_name()}: gdn_recurrent_{K.GDN_DEFAULT} with time stamps, grid {grid}")
    print(f"a graph of one tiny kernel, event to event: {statistics.median(tiny_us):.2f} us (median of {args.rounds})")
    table: dict[str, dict[str, float]] = {}
    for spec in args.levels.split(","):
        lengths, parents, label = parse_level(spec)
        inputs = level_inputs(lengths, args.segments, depth=args.depth, parents=parents)
        graph, _ = captured(inputs)
        view = stamps_view()
        rows: list[dict[str, float]] = []
        for r in range(args.rounds + 3):
            view.fill(0)
            torch.cuda.synchronize()
            event_us = replay_ms(graph) * 1000.0
            if r >= 3:
                row = reduce(view.get(), grid)
                row["event to event"] = event_us
                rows.append(row)
        table[label] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    names = list(table)
    print("\nmedians over replays, us (worker blocks' first item for the per-item rows)\n")
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in next(iter(table.values())):
        print(f"| {key} | " + " | ".join(f"{table[n][key]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
