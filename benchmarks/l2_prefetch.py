"""Does a product read faster when part of its weight was prefetched into L2 during a gap in
which memory is idle? One 27B-shaped weight (the GDN out-projection, 63 MB, or gate_up, 178 MB)
is read by an 80-row product after a gap (a spin kernel standing in for the GDN recurrence);
before each round a 178 MB product evicts L2, as the other layers' weights do in a pass. Arms:
no prefetch, or the first X MB prefetched on a side stream at the start of the gap (bulk
prefetches, evict_last where named, or plain loads). Each arm is one CUDA graph (no host time
inside); interleaved rounds; medians of gap + product.

    PYTHONPATH=. python3 benchmarks/l2_prefetch.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from openjev.worker.cuda.prefetch import l2_prefetch

MB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--rows", type=int, default=80)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {
        "gdn_out 5120x6144": torch.randn(5120, 6144, device=dev, generator=gen, dtype=torch.bfloat16),
        "gate_up 34816x5120": torch.randn(34816, 5120, device=dev, generator=gen, dtype=torch.bfloat16),
    }
    flush = torch.randn(34816, 5120, device=dev, generator=gen, dtype=torch.bfloat16)
    xf = torch.randn(args.rows, 5120, device=dev, generator=gen, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    clock_hz = 1.98e9  # the H200's SM clock under load (Nsight Compute, docs/cuda-kernels.md)
    print(f"{torch.cuda.get_device_name()}, {args.rows} rows, SM clock taken as {clock_hz / 1e9:.2f} GHz")
    print("| weight | gap us | arm | gap + product us (p10-p90) | saved us |")
    print("|---|---|---|---|---|")
    arms: dict[str, tuple[int, str] | None] = {"none": None}
    for how in ("bulk", "loads"):
        for mb in (16, 32, 48):
            arms[f"{how} {mb} MB"] = (mb, how)
    arms["bulk_last 32 MB"] = (32, "bulk_last")
    for wname, w in weights.items():
        x = torch.randn(args.rows, w.shape[1], device=dev, generator=gen, dtype=torch.bfloat16)
        for gap_us in (0, 10, 20, 40):
            cycles = int(gap_us * 1e-6 * clock_hz)
            graphs = {arm: capture(x, w, cycles, spec, side) for arm, spec in arms.items()}
            total: dict[str, list[float]] = {a: [] for a in arms}
            for rnd in range(args.rounds + 2):
                for arm, g in graphs.items():
                    F.linear(xf, flush)  # evict L2
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    e1.synchronize()
                    if rnd >= 2:
                        total[arm].append(1e3 * e0.elapsed_time(e1))
            base = statistics.median(total["none"])
            for arm in arms:
                q = statistics.quantiles(total[arm], n=10)
                med = statistics.median(total[arm])
                print(
                    f"| {wname} | {gap_us} | {arm} | {med:.1f} ({q[0]:.1f}-{q[-1]:.1f}) | {base - med:.1f} |",
                    flush=True,
                )


def capture(x, w, cycles: int, spec, side) -> torch.cuda.CUDAGraph:
    """A graph of: the prefetch on a side stream (if any) beside a spin of `cycles`, then the product."""

    def body() -> None:
        main = torch.cuda.current_stream()
        if spec is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(w, spec[0] * MB, how=spec[1])
        if cycles:
            torch.cuda._sleep(cycles)
        F.linear(x, w)
        if spec is not None:
            main.wait_stream(side)

    warm = torch.cuda.Stream()  # cuBLAS makes its handle and workspace outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        body()
    torch.cuda.current_stream().wait_stream(warm)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


if __name__ == "__main__":
    main()
