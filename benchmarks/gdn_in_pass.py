"""Is the GDN recurrence slower inside a pass because of what runs before it? The same launch
(one segment of T tokens, 27B shapes, the inputs of kernels_gpu.py, replayed from a CUDA graph)
timed with CUDA events after (a) a sleep kernel (an idle, cool GPU), (b) bf16 products like a
pass's (the MLP's down product at T rows, `--heat` of them back to back), (c) the same products,
then a sleep of 1 ms. Arms interleaved, medians and spreads of `--rounds`. Last, the durations
torch's profiler reports for (b), as benchmarks/profile_requests.py reads them.

    python3 benchmarks/gdn_in_pass.py [--tokens 676] [--heat 24] [--rounds 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from kernels_gpu import cases

from openjev.worker.cuda import kernels as K

SLEEP_CYCLES = 2_000_000  # ~1 ms at the H200's clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=676)
    p.add_argument("--heat", type=int, default=24)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="")
    args = p.parse_args()
    recurrence = {name: fn for name, fn, *_ in cases(args.tokens)}[f"gdn_recurrent_{K.GDN_DEFAULT}"]
    x = torch.randn(args.tokens, 17408, device="cuda").bfloat16()
    w = torch.randn(5120, 17408, device="cuda").bfloat16() * 0.01

    def heat() -> None:
        for _ in range(args.heat):
            torch.nn.functional.linear(x, w)

    before = {
        "idle (sleep kernel)": lambda: torch.cuda._sleep(SLEEP_CYCLES),
        f"after {args.heat} down products": heat,
        f"after {args.heat} down products, then 1 ms sleep": lambda: (heat(), torch.cuda._sleep(SLEEP_CYCLES)),
    }
    recurrence()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recurrence()
    times: dict[str, list[float]] = {name: [] for name in before}
    for _ in range(args.rounds + 3):
        for name, pre in before.items():  # interleaved: drift lands on every arm alike
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pre()
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    rows = []
    print(f"{torch.cuda.get_device_name()}: gdn_recurrent_{K.GDN_DEFAULT}, one segment of {args.tokens} tokens")
    print(f"{'before the launch':<46} {'median ms':>10} {'min':>8} {'max':>8}")
    for name, ts in times.items():
        ts = ts[3:]  # the first rounds warm clocks and caches
        rows.append({"arm": name, "median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)})
        print(f"{name:<46} {statistics.median(ts):>10.4f} {min(ts):>8.4f} {max(ts):>8.4f}")
    # the same launches as profile_requests.py sees them: the profiler's kernel durations
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            heat()
            graph.replay()
        torch.cuda.synchronize()
    traced = [e.device_time_total * 1e-3 for e in prof.events() if "gdn_recurrent" in e.name]
    rows.append({"arm": "profiler's duration, after products", "median_ms": statistics.median(traced)})
    print(f"{'profiler duration, after products':<46} {statistics.median(traced):>10.4f} ({len(traced)} launches)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "heat": args.heat, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
