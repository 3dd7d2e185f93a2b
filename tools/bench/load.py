"""Closed-loop load through the frontend: several clients, each sending its next request as soon as
the last one answers, for a bounded time. The concurrency sweep and the mixed run (long requests
arriving beside short ones) are both made of it."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

from openjev.tools.bench.harness import Arm, _Client, percentile
from openjev.tools.bench.workload import Case


@dataclass
class Stream:
    """What one client sends, in turn and round again: its own slice of the shuffled cases."""

    label: str
    cases: list[Case]
    latencies: list[tuple[str, float]] = field(default_factory=list)  # (case, seconds) of OK answers
    errors: int = 0
    seconds: float = 0.0  # from the start until its last answer


def run_streams(arm: Arm, streams: list[Stream], seconds: float, timeout: float) -> float:
    """Every stream on its own thread and channel until `seconds` have passed; a request in flight
    then is awaited and counted. Returns the wall time, the drain included, so that throughput
    counts every request sent over the time it took."""
    texts = {c.name: json.dumps(c.request, ensure_ascii=False) for s in streams for c in s.cases}
    stop_at = time.perf_counter() + seconds

    def loop(stream: Stream) -> None:
        client = _Client(arm)
        i = 0
        while time.perf_counter() < stop_at and stream.cases:
            case = stream.cases[i % len(stream.cases)]
            sample = client.send(case, texts[case.name], 0, timeout)
            if sample.status == "OK":
                stream.latencies.append((case.name, sample.latency_seconds))
            else:
                stream.errors += 1
            i += 1
        stream.seconds = time.perf_counter() - started
        client.channel.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def split_among(cases: list[Case], clients: int, seed: int = 0) -> list[list[Case]]:
    """Shuffled (the workload file is ordered by kind and length, and a short window would see only
    its head), then dealt out so that clients do not send the same request at the same time."""
    order = list(cases)
    random.Random(seed).shuffle(order)
    return [order[k::clients] or order for k in range(clients)]


def summary(latencies: list[float], elapsed: float, errors: int) -> dict:
    ms = [1e3 * x for x in latencies]
    nan = float("nan")
    return {
        "requests": len(ms),
        "errors": errors,
        "seconds": elapsed,
        "throughput_rps": len(ms) / elapsed if elapsed else nan,
        "mean_ms": statistics.fmean(ms) if ms else nan,
        "p50_ms": percentile(ms, 0.5),
        "p95_ms": percentile(ms, 0.95),
    }


def concurrency_sweep(
    arm: Arm,
    cases: list[Case],
    levels=(1, 4, 16, 32),
    *,
    label: str = "",
    tree_tokens: dict[str, int] | None = None,
    seconds_per_level: float = 20.0,
    timeout: float = 600.0,
) -> list[dict]:
    """One row per level: throughput, latency, and the tokens of the shared trees computed by the
    answered requests (what the achieved matmul rate is made of)."""
    rows = []
    for level in levels:
        streams = [Stream(label, part) for part in split_among(cases, level)]
        elapsed = run_streams(arm, streams, seconds_per_level, timeout)
        done = [x for s in streams for x in s.latencies]
        row = {"arm": arm.name, "set": label, "clients": level}
        row |= summary([t for _, t in done], elapsed, sum(s.errors for s in streams))
        row["tree_tokens"] = sum((tree_tokens or {}).get(name, 0) for name, _ in done)
        row["latencies"] = [[name, seconds] for name, seconds in done]  # (case, seconds): percentiles redone later
        rows.append(row)
    return rows


def mixed_run(
    arm: Arm, short: list[Case], long: list[Case], *, clients: int, seconds: float, timeout: float = 600.0
) -> list[dict]:
    """`clients` clients looping short requests, first alone, then with one more client looping
    long ones beside them, for the same time each: the two rows show what the long requests cost
    the short ones."""
    rows = []
    for with_long in (False, True):
        streams = [Stream("short", part) for part in split_among(short, clients)]
        if with_long:
            streams.append(Stream("long", list(long)))
        run_streams(arm, streams, seconds, timeout)
        # the short clients' own time: the long client may still be draining its last request
        elapsed = max(s.seconds for s in streams if s.label == "short")
        shorts = [t for s in streams if s.label == "short" for _, t in s.latencies]
        longs = [t for s in streams if s.label == "long" for _, t in s.latencies]
        row = {"arm": arm.name, "short_clients": clients, "with_long": with_long}
        row |= summary(shorts, elapsed, sum(s.errors for s in streams if s.label == "short"))
        row["long_requests"] = len(longs)
        row["long_errors"] = sum(s.errors for s in streams if s.label == "long")
        row["long_mean_ms"] = 1e3 * statistics.fmean(longs) if longs else float("nan")
        rows.append(row)
    return rows
