"""One soak run: the state its threads share, the clients' loop, and `run_load`, which prepares the
workload, starts the clients and the hostile parts (parts.py), joins them and has the outcomes
judged (judge.py)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from openjev import progress
from openjev.client import Client
from openjev.contract.literals import PrefixPolicy
from openjev.tools.soak.hostile import Hostile, WorkerControl
from openjev.tools.soak.judge import judge
from openjev.tools.soak.outcomes import Outcome
from openjev.tools.soak.parts import hostile_threads
from openjev.tools.soak.probes import rss_bytes
from openjev.tools.soak.report import Report
from openjev.tools.soak.workload import (
    MEDIUM,
    baseline,
    comparable,
    invalid_requests,
    oversized_requests,
    tagged,
    tagged_answer,
    valid_requests,
)


@dataclass(eq=False)
class Run:
    """What a run's threads share (under `lock` where they change it); the methods are the
    clients' and the RSS sampler's bodies and the bookkeeping every thread uses."""

    address: str
    clients: int
    duration: float
    timeout: float
    seed: int
    bound: float  # a request without a status after this long is hung
    hostile: Hostile | None
    parts: tuple[str, ...]  # the hostile parts that run (kill only with our own worker)
    worker: WorkerControl | None
    valid: list[tuple[dict[str, Any], PrefixPolicy | None]]
    invalid: list[tuple[str, str]]
    expected: list[dict]  # the answers to `valid` sent alone
    expected_medium: dict  # the answer to MEDIUM sent alone (cancel part only)
    oversized: list[tuple[str, str]]
    plan: list[tuple[bool, int]]  # the clients' requests: (invalid?, pick)
    pids: dict[str, int]  # processes whose RSS to report (the worker's changes after a kill)
    peak: dict[str, float]
    bar: progress.Progress
    stop_at: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: list[Outcome] = field(default_factory=list)
    sent_ids: list[str] = field(default_factory=list)  # Decide calls: one frontend log line each
    # request id -> (kind, started): no status yet
    pending: dict[str, tuple[str, float]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)  # the run's time is up: hostile loops end
    release: threading.Event = field(default_factory=threading.Event)  # idle streams' iterators may end
    kills: list[dict] = field(default_factory=list)
    streams: list[Any] = field(default_factory=list)
    next_index: int = 0
    run_started: float = 0.0

    def begin(self, kind: str, prefix: str = "soak") -> tuple[str, float]:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        started = time.monotonic()
        with self.lock:
            self.pending[request_id] = (kind, started)
            if prefix == "soak":
                self.sent_ids.append(request_id)
        return request_id, started

    def finish(self, outcome: Outcome) -> None:
        outcome.ended = outcome.ended or time.monotonic()
        outcome.seconds = outcome.ended - outcome.started
        with self.lock:
            self.pending.pop(outcome.request_id, None)
            self.outcomes.append(outcome)

    def take(self) -> tuple[bool, int] | None:
        with self.lock:
            if self.next_index >= len(self.plan) or time.monotonic() >= self.stop_at:
                return None
            self.next_index += 1
            return self.plan[self.next_index - 1]

    def expect_refusal(self, client: Client, kind: str, text: str, message: str) -> Outcome:
        """Send a request that must be refused with `message`; its outcome."""
        request_id, started = self.begin(kind)
        try:
            client.decide(text, timeout=self.timeout, request_id=request_id)
            return Outcome(kind, "OK", 0.0, False, request_id, started)
        except grpc.RpcError as error:
            code = error.code().name
            good = code == "INVALID_ARGUMENT" and (
                error.details() == message
                or (message == "too_long" and error.details().endswith("no silent truncation"))
            )
            return Outcome(kind, code, 0.0, good, request_id, started, detail=error.details() or "")

    def client_loop(self) -> None:
        with Client(self.address) as client:
            while (item := self.take()) is not None:
                is_invalid, pick = item
                if is_invalid:
                    outcome = self.expect_refusal(client, "invalid", *self.invalid[pick % len(self.invalid)])
                else:
                    outcome = self.send_valid(client, pick % len(self.valid))
                self.finish(outcome)
                if outcome.status == "UNAVAILABLE":
                    time.sleep(0.5)  # the worker is down: do not spin through the plan
                with self.lock:
                    self.bar.advance()

    def send_valid(self, client: Client, index: int) -> Outcome:
        request, policy = self.valid[index]
        request_id, started = self.begin("valid")
        tag = request_id.rsplit("-", 1)[1]
        try:
            reply = client.decide(tagged(request, tag), policy=policy, timeout=self.timeout, request_id=request_id)
            same = comparable(reply) == tagged_answer(self.expected[index], tag)
            return Outcome("valid", "OK", 0.0, same, request_id, started, answered_ok=same)
        except grpc.RpcError as error:
            return Outcome("valid", error.code().name, 0.0, False, request_id, started, detail=error.details() or "")

    def sample_rss(self, done: threading.Event) -> None:
        while not done.wait(0.5):
            for name, pid in list(self.pids.items()):
                try:
                    self.peak[name] = max(self.peak[name], round(rss_bytes(pid) / 2**20, 1))
                except (OSError, RuntimeError):
                    pass


def run_load(
    address: str,
    *,
    clients: int = 8,
    requests: int = 400,
    duration: float = 60.0,
    invalid_fraction: float = 0.3,
    seed: int = 0,
    timeout: float = 60.0,
    pids: dict[str, int] | None = None,
    frontend_log: Path | None = None,
    hostile: Hostile | None = None,
    worker: WorkerControl | None = None,
    metrics_ports: dict[str, int] | None = None,
    memory_bound_mib: float = Hostile.memory_bound_mib,
) -> Report:
    """Send up to `requests` requests from `clients` threads, stopping early after `duration`
    seconds; return the report. `pids`: processes whose RSS to report (name -> pid).
    `hostile`: add the hostile mix; `worker`: the soak's own worker (its port gets idle Execute
    streams, and it is killed and restarted); `metrics_ports`: name -> port of /metrics, to check
    that nothing stays in flight afterwards; `memory_bound_mib`: the RSS growth allowed per process
    without a hostile mix (the mix carries its own)."""
    if hostile:  # a hung request must outlast its bound before the client's deadline ends it
        timeout = max(timeout, hostile.request_bound_seconds + 30)
    valid = valid_requests()
    invalid = invalid_requests()
    expected = baseline(address, valid, timeout)
    # A second warm pass so the RSS "before" is taken after allocator growth from first use; its
    # answers must be the first pass's (the run's comparisons assume one answer per request)
    again = baseline(address, valid, timeout)
    parts = hostile.parts if hostile else ()
    if worker is None:
        parts = tuple(p for p in parts if p != "kill")
    expected_medium = baseline(address, [(MEDIUM, "off")], timeout)[0] if {"cancel"} & set(parts) else {}
    oversized = oversized_requests(hostile) if hostile and "oversized" in parts else []
    report = Report(clients=clients)
    report.baseline_differs = sum(a != b for a, b in zip(expected, again, strict=True))
    pids = dict(pids or {})
    report.rss["before_mib"] = {name: round(rss_bytes(pid) / 2**20, 1) for name, pid in pids.items()}
    report.rss["bound_mib"] = hostile.memory_bound_mib if hostile else memory_bound_mib
    rng = random.Random(seed)
    plan = [(rng.random() < invalid_fraction, rng.randrange(10**6)) for _ in range(requests)]
    run = Run(
        address=address,
        clients=clients,
        duration=duration,
        timeout=timeout,
        seed=seed,
        bound=hostile.request_bound_seconds if hostile else timeout,
        hostile=hostile,
        parts=parts,
        worker=worker,
        valid=valid,
        invalid=invalid,
        expected=expected,
        expected_medium=expected_medium,
        oversized=oversized,
        plan=plan,
        pids=pids,
        peak=dict(report.rss["before_mib"]),
        stop_at=time.monotonic() + duration,
        # Bounded by a count and a time: the bar counts requests; its log lines show the time too.
        bar=progress.Progress(f"soak ({clients} clients, at most {duration:g} s)", len(plan)),
    )
    drive(run)
    report.seconds = round(time.monotonic() - run.run_started, 2)
    judge(run, report, frontend_log=frontend_log, metrics_ports=metrics_ports)
    return report


def drive(run: Run) -> None:
    """Start the clients, the hostile parts and the RSS sampler; end them all when the clients are
    done (or past their bound)."""
    run.run_started = time.monotonic()
    done = threading.Event()
    sampler = threading.Thread(target=run.sample_rss, args=(done,), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=run.client_loop, name=f"soak-client-{i}") for i in range(run.clients)]
    public = grpc.insecure_channel(run.address)
    extra = hostile_threads(run, public)
    for t in extra + threads:
        t.start()
    for t in threads:
        t.join(max(1.0, run.stop_at - time.monotonic()) + run.bound + 30)
    run.stop.set()
    for t in extra:
        t.join(run.bound + 10 if t.name != "kill" else 90)
    with run.lock:
        for call in run.streams:
            call.cancel()
    run.release.set()
    for t in extra:
        t.join(10)
    public.close()
    run.bar.close()
    done.set()
