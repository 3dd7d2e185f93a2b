"""Large JSON bodies at once against a real frontend + worker: the frontend's memory and a small
request's latency while they are parsed, for `--large-body-parses` 1 (the default) and more.

Since 2026-12-05 the frontend parses bodies over 1 MiB in child processes
(`frontend/parsing.py`): their peak memory is reported beside the frontend's. To compare with a
tree before that, run this script with `PYTHONPATH` set to an export of that tree laid out as the
`openjev` package (the servers it starts inherit it), alternating with a run without.

Each body is a noul question over a state of `--arrays` empty JSON arrays (22.9 MiB for 6 M): the
shape that builds the most Python objects per byte. Every one is refused INVALID_ARGUMENT (its
prompt is far over max_length) only once it has been parsed and its state rendered. `--clients`
of them are sent at once while one client sends a small request every 0.2 s. Each block starts
a fresh pair per arm (a process's peak memory only grows), arms alternating.

    .venv/bin/python benchmarks/large_bodies.py [--model .openjev/demo-model] [--blocks 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import rss_bytes
from openjev.v1 import decision_pb2 as api

SMALL = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}


def peak_mib(pid: int) -> float:
    """The process's peak resident memory so far, MiB."""
    return rss_bytes(pid, "VmHWM") / 2**20


def children_peak_mib(pid: int) -> float:
    """The peaks of the process's children (the body parsers, spawn's resource tracker), summed.
    (Not `soak.child_pids`: this script also runs against trees from before it.)"""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            children += map(int, listed.read().split())
    return sum(peak_mib(child) for child in children)


def one_block(model: Path, workdir: Path, parses: int, body: str, clients: int) -> dict:
    pair = launch.start_pair(model, workdir, frontend_args=["--large-body-parses", str(parses)])
    try:
        with Client(pair.frontend.address) as client:
            small = api.DecideRequest(request_json=json.dumps(SMALL))
            client.stub.Decide(small, timeout=60)
            before = peak_mib(pair.frontend.popen.pid)
            done = threading.Event()
            small_ms: list[float] = []

            def probe() -> None:
                while not done.is_set():
                    started = time.perf_counter()
                    client.stub.Decide(small, timeout=120)
                    small_ms.append((time.perf_counter() - started) * 1e3)
                    done.wait(0.2)

            def large(_: int) -> tuple[str, float]:
                started = time.perf_counter()
                try:
                    client.stub.Decide(api.DecideRequest(request_json=body), timeout=300)
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                return code, time.perf_counter() - started

            prober = threading.Thread(target=probe)
            prober.start()
            with ThreadPoolExecutor(clients) as pool:
                outcomes = list(pool.map(large, range(clients)))
            done.set()
            prober.join()
            return {
                "growth": peak_mib(pair.frontend.popen.pid) - before,
                "children": children_peak_mib(pair.frontend.popen.pid),
                "last": max(seconds for _, seconds in outcomes),
                "codes": sorted({code for code, _ in outcomes}),
                "small_p50": statistics.median(small_ms),
                "small_max": max(small_ms),
            }
    finally:
        pair.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    parser.add_argument("--arrays", type=int, default=6_000_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--arms", type=int, nargs="+", default=[1, 4], help="--large-body-parses values")
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    body = json.dumps({"state": [[] for _ in range(args.arrays)], "questions": SMALL["questions"]})
    print(f"{args.clients} bodies of {len(body) / 2**20:.1f} MiB at once, {args.blocks} blocks, arms alternating")
    rows: dict[int, list[dict]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(args.blocks):
            for arm in args.arms:
                result = one_block(args.model, Path(tmp) / f"{block}-{arm}", arm, body, args.clients)
                rows[arm].append(result)
                print(f"  block {block} parses={arm}: {result}", flush=True)

    def cell(arm: int, key: str, digits: int = 0) -> str:
        values = [r[key] for r in rows[arm]]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    print()
    print(
        "| --large-body-parses | frontend peak growth, MiB | children's peak, MiB | last refusal, s | small p50, ms "
        "| small max, ms |"
    )
    print("|---|---|---|---|---|---|")
    for arm in args.arms:
        codes = sorted({c for r in rows[arm] for c in r["codes"]})
        print(
            f"| {arm} | {cell(arm, 'growth')} | {cell(arm, 'children')} | {cell(arm, 'last', 1)} "
            f"| {cell(arm, 'small_p50', 1)} "
            f"| {cell(arm, 'small_max')} |" + ("" if codes == ["INVALID_ARGUMENT"] else f" codes {codes}")
        )
    print("\nmedian (range) over blocks")


if __name__ == "__main__":
    main()
