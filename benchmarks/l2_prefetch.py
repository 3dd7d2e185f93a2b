"""Does a product read faster when part of its weight was prefetched into L2 during a gap in
which memory is idle? One 27B-shaped weight (the GDN out-projection, 63 MB, or gate_up, 178 MB)
is read by an 80-row product after a gap (a spin kernel standing in for the GDN recurrence);
before each round a 178 MB product evicts L2, as the other layers' weights do in a pass. Arms:
no prefetch, or the first X MB prefetched on a side stream at the start of the gap (bulk
prefetch; evict_last where named). Interleaved rounds; medians of the product's time and of gap
+ product.

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
    print("| weight | gap us | arm | product us (p10-p90) | gap + product us | product saved us |")
    print("|---|---|---|---|---|---|")
    for wname, w in weights.items():
        x = torch.randn(args.rows, w.shape[1], device=dev, generator=gen, dtype=torch.bfloat16)
        arms = {"none": None}
        for mb in (16, 24, 32, 48):
            arms[f"prefetch {mb} MB"] = (mb, False)
        arms["prefetch 32 MB evict_last"] = (32, True)
        for gap_us in (0, 10, 40):
            cycles = int(gap_us * 1e-6 * clock_hz)
            prod: dict[str, list[float]] = {a: [] for a in arms}
            total: dict[str, list[float]] = {a: [] for a in arms}
            for rnd in range(args.rounds + 2):
                for arm, spec in arms.items():
                    F.linear(xf, flush)  # evict L2
                    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                    e0.record()
                    if spec is not None:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            l2_prefetch(w, spec[0] * MB, evict_last=spec[1])
                    if cycles:
                        torch.cuda._sleep(cycles)
                    e1.record()
                    F.linear(x, w)
                    e2.record()
                    if spec is not None:
                        torch.cuda.current_stream().wait_stream(side)
                    e2.synchronize()
                    if rnd >= 2:
                        prod[arm].append(1e3 * e1.elapsed_time(e2))
                        total[arm].append(1e3 * e0.elapsed_time(e2))
            base = statistics.median(prod["none"])
            for arm in arms:
                q = statistics.quantiles(prod[arm], n=10)
                med = statistics.median(prod[arm])
                print(
                    f"| {wname} | {gap_us} | {arm} | {med:.1f} ({q[0]:.1f}-{q[-1]:.1f}) | "
                    f"{statistics.median(total[arm]):.1f} | {base - med:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
