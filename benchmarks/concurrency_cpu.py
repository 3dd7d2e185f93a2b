"""Concurrent against sequential short requests through a real frontend + worker on this machine.

Eight distinct short requests (noul and choice, about a hundred tokens each) are sent one after
another, then all eight at once from eight threads; the two arms alternate in repeated blocks so
machine noise hits both alike. With forest passes and continuous batching the concurrent arm
shares forward passes; the ratio of wall times is the measure.

    .venv/bin/python benchmarks/concurrency_cpu.py [--model .openjev/demo-model] [--blocks 7]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openjev.client import Client
from openjev.tools import launch


def requests() -> list[dict]:
    out = []
    for i in range(8):
        state = f"ticket {i}: customer {i} writes that order {1000 + i} arrived damaged and asks what to do next."
        if i % 2:
            q = {"type": "noul", "instructions": f"Is ticket {i} a refund request?"}
        else:
            q = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": None}}
        out.append({"state": state, "questions": {"q": q}})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="write the raw timings here (JSON)")
    p.add_argument("--worker-args", default="", help="more worker flags, e.g. '--threads 1'")
    args = p.parse_args(argv)
    bodies = requests()
    pair = launch.start_pair(
        # repeats of the same requests: the state cache would answer them from cached states
        args.model,
        Path(tempfile.mkdtemp(prefix="openjev-conc-")),
        worker_args=["--state-cache-bytes", "0", *shlex.split(args.worker_args)],
    )
    try:
        with Client(pair.frontend.address) as client, ThreadPoolExecutor(len(bodies)) as pool:
            expected = [client.decide(b)["answers"] for b in bodies]
            times: dict[str, list[float]] = {"sequential": [], "concurrent": []}
            for _ in range(args.blocks):
                started = time.perf_counter()
                got = [client.decide(b)["answers"] for b in bodies]
                times["sequential"].append(time.perf_counter() - started)
                assert got == expected
                started = time.perf_counter()
                got = list(pool.map(lambda b: client.decide(b)["answers"], bodies))
                times["concurrent"].append(time.perf_counter() - started)
                assert got == expected, "an answer changed with the company it kept"
    finally:
        pair.stop()
    ratios = [c / s for s, c in zip(times["sequential"], times["concurrent"], strict=True)]
    print(f"{len(bodies)} short requests, {args.blocks} interleaved blocks (wall seconds per block)")
    print("| arm | median | min | max |")
    print("|---|---|---|---|")
    for arm, values in times.items():
        print(f"| {arm} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    print(f"| concurrent / sequential | {statistics.median(ratios):.2f} | {min(ratios):.2f} | {max(ratios):.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"times": times, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
