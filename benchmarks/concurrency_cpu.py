"""Concurrent against sequential short requests through a real frontend + worker on this machine.

Eight distinct short requests (noul and choice, about a hundred tokens each) are sent one after
another, then all eight at once from eight threads; the two arms alternate in repeated blocks so
machine noise hits both alike. With forest passes and continuous batching the concurrent arm
shares forward passes; the ratio of wall times is the measure. From the worker's log it also
reports how each arm's requests rode: the passes they ran in, how many of those carried other
requests too, and their wait for a first pass; with `--worker-args "--log-level debug"` (the
worker then logs each pass) also the requests of each pass of every concurrent block.

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
from openjev.tools.soak import log_events


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
    workdir = Path(tempfile.mkdtemp(prefix="openjev-conc-"))
    pair = launch.start_pair(
        # repeats of the same requests: the state cache would answer them from cached states
        args.model,
        workdir,
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
    riding = how_requests_rode(workdir / "worker.log", len(bodies))
    print("| arm | requests | passes each (median) | in a shared pass | queue ms (median, max) |")
    print("|---|---|---|---|---|")
    for arm, rows in riding.items():
        shared = sum(r["shared_passes"] > 0 for r in rows)
        queue = [r["queue_ms"] for r in rows]
        passes = statistics.median(r["passes"] for r in rows)
        print(f"| {arm} | {len(rows)} | {passes:g} | {shared} | {statistics.median(queue):.1f}, {max(queue):.1f} |")
    passes = concurrent_passes(workdir / "worker.log", len(bodies))
    if passes:
        print("requests of each pass, per concurrent block:", " ".join("+".join(map(str, p)) for p in passes))
    if args.out:
        out = {"times": times, "ratios": ratios, "riding": riding, "concurrent_passes": passes}
        args.out.write_text(json.dumps(out, indent=1) + "\n")


def how_requests_rode(worker_log: Path, per_block: int) -> dict[str, list[dict]]:
    """The worker's `execute` log events of the timed blocks, by arm. The worker logs a request
    before it answers, so its log holds the warm-up round, then per block the sequential round and
    the concurrent round, each complete before the next begins."""
    done = [e for e in log_events(worker_log.read_text(), "execute") if e.get("status") == "OK"][per_block:]
    riding: dict[str, list[dict]] = {"sequential": [], "concurrent": []}
    for start in range(0, len(done) - 2 * per_block + 1, 2 * per_block):
        riding["sequential"] += done[start : start + per_block]
        riding["concurrent"] += done[start + per_block : start + 2 * per_block]
    fields = ("passes", "shared_passes", "queue_ms", "latency_ms", "tokens_computed")
    return {arm: [{f: e[f] for f in fields} for e in rows] for arm, rows in riding.items()}


def concurrent_passes(worker_log: Path, per_block: int) -> list[list[int]]:
    """Per concurrent block, the requests each of its passes carried, from the worker's `pass`
    events (logged at debug level only; none: an empty list). A pass is logged before its
    requests' `execute` events, so it belongs to the round whose requests are being answered."""
    rounds: dict[int, list[int]] = {}
    answered = 0
    for e in log_events(worker_log.read_text()):
        if e.get("event") == "execute" and e.get("status") == "OK":
            answered += 1
        elif e.get("event") == "pass":
            rounds.setdefault(answered // per_block, []).append(e["requests"])
    # round 0: the warm-up (and the worker's own); then per block the sequential, the concurrent
    return [rounds[r] for r in sorted(rounds) if r >= 2 and r % 2 == 0]


if __name__ == "__main__":
    main()
