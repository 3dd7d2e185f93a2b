"""Timing requests through the frontend: one persistent client per arm, arms interleaved in
repeated blocks in a shuffled order, a warm-up traversal reported separately, and a
concurrency sweep."""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import grpc

from openjev import abi
from openjev.contract.literals import PrefixPolicy
from openjev.tools.bench.workload import Case
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc


@dataclass(frozen=True)
class Arm:
    """One way of serving a request: a frontend and the prefix policy sent with each request;
    `only`: the names of the cases it runs (None: all), for an arm too slow for the whole workload."""

    name: str
    address: str
    policy: PrefixPolicy | None
    only: frozenset[str] | None = None


@dataclass
class Sample:
    arm: str
    case: str
    block: int  # -1: warm-up traversal
    latency_seconds: float
    status: str
    input_tokens: int = 0
    saved_tokens: int = 0
    executed_scope: str = ""
    inference_seconds: float = 0.0


@dataclass
class Results:
    samples: list[Sample] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)


class _Client:
    def __init__(self, arm: Arm):
        from openjev.serving import channel_options

        self.arm = arm
        self.channel = grpc.insecure_channel(arm.address, options=channel_options())
        self.stub = decision_pb2_grpc.DecisionServiceStub(self.channel)

    def send(self, case: Case, text: str, block: int, timeout: float) -> Sample:
        message = api.DecideRequest(request_json=text, prefix_policy=abi.policy_to_enum(self.arm.policy))
        started = time.perf_counter()
        try:
            reply = self.stub.Decide(message, timeout=timeout)
        except grpc.RpcError as error:
            return Sample(self.arm.name, case.name, block, time.perf_counter() - started, error.code().name)
        latency = time.perf_counter() - started
        meta = reply.metadata
        return Sample(
            self.arm.name,
            case.name,
            block,
            latency,
            "OK",
            reply.usage.input_tokens,
            meta.prefix_cache.saved_tokens,
            abi.scope_from_enum(meta.prefix_cache.scope),
            meta.inference_seconds,
        )


def run_blocks(
    arms: list[Arm],
    cases: list[Case],
    *,
    blocks: int,
    seed: int = 0,
    timeout: float = 600.0,
    progress=print,
    after_block=lambda results: None,
) -> Results:
    """after_block(results) runs after every traversal, so a run cut short keeps what it measured."""
    import json

    texts = {case.name: json.dumps(case.request, ensure_ascii=False) for case in cases}
    clients = [_Client(arm) for arm in arms]
    rng = random.Random(seed)
    results = Results()
    for block in range(-1, blocks):
        order = list(cases)
        rng.shuffle(order)
        started = time.perf_counter()
        for case in order:
            # Every arm sees this case back to back, in a fresh random order: slow drifts of the
            # machine land on all arms alike, which is what paired ratios need.
            for client in rng.sample(clients, len(clients)):
                if client.arm.only is None or case.name in client.arm.only:
                    results.samples.append(client.send(case, texts[case.name], block, timeout))
        label = "warm-up" if block < 0 else f"block {block + 1}/{blocks}"
        progress(f"{label}: {len(order)} cases x {len(arms)} arms in {time.perf_counter() - started:.1f} s")
        after_block(results)
    for client in clients:
        client.channel.close()
    return results


def _closed_loop(
    arm: Arm, texts: list[tuple[Case, str]], level: int, seconds: float, timeout: float
) -> tuple[list[float], int, float]:
    """`level` clients each send the cases in turn for `seconds`: (sorted OK latencies in seconds,
    failed requests, elapsed seconds)."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def loop(offset: int) -> None:
        nonlocal errors
        client = _Client(arm)
        i = offset
        while time.perf_counter() < stop_at:
            case, text = texts[i % len(texts)]
            sample = client.send(case, text, 0, timeout)
            with lock:
                if sample.status == "OK":
                    latencies.append(sample.latency_seconds)
                else:
                    errors += 1
            i += level
        client.channel.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(latencies), errors, time.perf_counter() - started


def concurrency_sweep(
    arm: Arm, cases: list[Case], levels=(1, 4, 16), *, seconds_per_level: float = 20.0, timeout: float = 600.0
) -> list[dict]:
    """Closed loop: `level` clients each send the cases in turn for a bounded time."""
    import json

    texts = [(case, json.dumps(case.request, ensure_ascii=False)) for case in cases]
    rows = []
    for level in levels:
        latencies, errors, elapsed = _closed_loop(arm, texts, level, seconds_per_level, timeout)
        rows.append(
            {
                "clients": level,
                "requests": len(latencies),
                "errors": errors,
                "throughput_rps": len(latencies) / elapsed,
                "p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else float("nan"),
                "p95_ms": 1e3 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else float("nan"),
                "mean_ms": 1e3 * statistics.fmean(latencies) if latencies else float("nan"),
            }
        )
    return rows
