"""Timing requests through the frontend: one persistent client per arm, arms interleaved in
repeated blocks in a shuffled order, a warm-up traversal reported separately. Load from several
clients at once is in load.py."""

from __future__ import annotations

import random
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
    sweep: list[dict] = field(default_factory=list)  # load.concurrency_sweep rows
    # a workload of another seed, never sent before: its warm-up block (-1) ran first after start-up
    first_seen: list[Sample] = field(default_factory=list)
    mixed: list[dict] = field(default_factory=list)  # load.mixed_run rows


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks; nan for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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
    into: Results | None = None,
) -> Results:
    """after_block(results) runs after every traversal, so a run cut short keeps what it measured;
    into: Results whose samples grow (a new one when None)."""
    import json

    texts = {case.name: json.dumps(case.request, ensure_ascii=False) for case in cases}
    clients = [_Client(arm) for arm in arms]
    rng = random.Random(seed)
    results = Results() if into is None else into
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
