"""What the first request after start costs: start worker and frontend, wait for SERVING, send
`--requests` requests one after another (each with its own text, so nothing is cached), print each
one's latency, and the worker's seconds from spawn to SERVING; `--starts` times. Work left lazy
in either server (a table built on first use, a module imported late) shows as a first request
slower than the next.

    python3 benchmarks/first_request.py [--model .openjev/demo-model] [--starts 3] [--requests 6]
        [--worker-args "--synthetic 27b"] [--http]

With `--http` the requests go to the frontend's HTTP route instead of gRPC.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from openjev.client import Client
from openjev.tools import launch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "contract_example.json"


def request(i: int) -> dict:
    body = copy.deepcopy(json.loads(EXAMPLE.read_text()))
    body["state"] = f"Ticket {i}: {body['state']} Reference {i * 7919}."
    return body


def latencies_ms(pair: launch.Pair, http_url: str | None, first: int, count: int) -> list[float]:
    import httpx

    out = []
    with httpx.Client() as http:
        client = Client(pair.frontend.address)
        for i in range(first, first + count):
            start = time.perf_counter()
            if http_url is None:
                client.decide(request(i))
            else:
                reply = http.post(f"{http_url}/v1/systemone", json=request(i), timeout=120)
                reply.raise_for_status()
            out.append(1e3 * (time.perf_counter() - start))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path(".openjev/demo-model"))
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--worker-args", default="")
    p.add_argument("--http", action="store_true")
    args = p.parse_args()
    if args.requests < 2 or args.starts < 1:
        p.error("--requests must be at least 2 (a first and a next) and --starts at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(args.starts):
            port = launch.free_port() if args.http else None
            frontend_args = ["--http-listen", f"127.0.0.1:{port}"] if args.http else []
            pair = launch.start_pair(
                args.model,
                Path(tmp) / f"start{start}",
                worker_args=shlex.split(args.worker_args),
                frontend_args=frontend_args,
            )
            try:
                url = f"http://127.0.0.1:{port}" if args.http else None
                rows.append((pair.worker.serving_seconds, latencies_ms(pair, url, 1000 * start, args.requests)))
            finally:
                pair.stop()
    route = "HTTP" if args.http else "gRPC"
    print(
        f"| start | worker SERVING s | first request ms ({route}) | the next {args.requests - 1}: median ms | max ms "
        "| first / median |"
    )
    print("|---|---|---|---|---|---|")
    for start, (serving, ms) in enumerate(rows):
        rest = statistics.median(ms[1:])
        print(f"| {start + 1} | {serving:.1f} | {ms[0]:.1f} | {rest:.1f} | {max(ms[1:]):.1f} | {ms[0] / rest:.2f}x |")


if __name__ == "__main__":
    main()
