"""`python -m openjev.tools.soak`: concurrent clients against a real frontend + worker on loopback.

N clients (each with its own channel) send a seeded mix of valid and invalid requests for a
bounded count and time. Every valid answer must equal the answer to the same request sent alone
before the run (no cross-talk), every invalid one must get INVALID_ARGUMENT with its contract
message, every request must end with a status (none lost; with our own servers, the frontend
log must hold exactly one line per request id), and memory must stay steady. Prints the numbers
(requests, errors by status, latency percentiles, RSS before and after) as text and JSON.

    python -m openjev.tools.soak --model .openjev/demo-model --clients 8 --duration 60
    python -m openjev.tools.soak --addr 127.0.0.1:50051 --clients 4 --requests 200
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev import progress
from openjev.client import Client, response_to_json
from openjev.contract.literals import PrefixPolicy
from openjev.frontend.service import DEFAULT_MAX_REQUEST_TOKENS
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

if TYPE_CHECKING:
    from openjev.tools.launch import Process

# -- helpers shared with tests/reliability ---------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def log_events(text: str, event: str | None = None) -> list[dict]:
    """The JSON lines of a server log (optionally only those of one event)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if event is None or record.get("event") == event:
            out.append(record)
    return out


def comparable(response: dict) -> dict:
    """A response without its timing (the only field that may differ between two runs)."""
    copy = json.loads(json.dumps(response))
    copy["metadata"].pop("inference_seconds", None)
    return copy


# -- the workload -----------------------------------------------------------------------------

STATES = [
    "A customer says: I was charged twice for one order.",
    {"ticket": 4821, "messages": ["Hi", "My card was declined", "¿Puedes ayudarme?"], "vip": True},
    "人力资源管理 asks: can I move my 2 days of leave to next month? 🙂",
    ["step 1: login", "step 2: open settings", {"error": "403", "retry": 1e-05}],
]


def valid_requests() -> list[tuple[dict[str, Any], PrefixPolicy | None]]:
    """(request, policy) pairs: distinct states, kinds, sizes and prefix policies."""
    out: list[tuple[dict[str, Any], PrefixPolicy | None]] = []
    for i, state in enumerate(STATES):
        questions = {
            "route": {
                "type": "choice",
                "instructions": "Which team should handle this?",
                "criteria": {"billing": "Charges and refunds.", "security": None, "hr": {"scope": "people"}},
            },
            "urgent": {
                "type": "noul",
                "instructions": "Is this urgent?",
                "criteria": {"true": "needs action today", "false": "can wait"},
            },
            "severity": {
                "type": "score",
                "instructions": "How severe is it?",
                "criteria": ["none", "low", "medium", "high", "critical"][: 2 + i],
            },
        }
        if i % 2:
            questions = dict(reversed(list(questions.items())))
        for policy in ("off", "auto") if i < 2 else ("shared",):
            out.append(({"state": state, "questions": questions}, policy))
    out.append(
        ({"model": "open-jev", "state": "short", "questions": {"only": {"type": "noul", "instructions": "ok?"}}}, None)
    )
    return out


def invalid_requests() -> list[tuple[str, str]]:
    """(request JSON text, the exact INVALID_ARGUMENT message)."""
    noul = {"type": "noul", "instructions": "x"}
    return [
        ("{not json", "request body must be valid JSON"),
        ('{"state": NaN, "questions": {}}', "request body must be valid JSON"),
        (
            '{"state": "x", "questions": {"a": {"type": "noul", "instructions": "x"}, '
            '"a": {"type": "noul", "instructions": "x"}}}',
            "request body must be valid JSON",
        ),
        ("[1, 2]", "request body must be a JSON object"),
        (json.dumps({"model": "gpt", "state": "x", "questions": {"q": noul}}), "requested model is not loaded"),
        (json.dumps({"questions": {"q": noul}}), "request requires state"),
        (
            json.dumps({"state": "x", "questions": {}}),
            "questions must be nonempty and within the server question limit",
        ),
        (
            json.dumps({"state": "x", "questions": {"q": {"type": "score", "instructions": "x", "criteria": ["a"]}}}),
            "Score requires 2 to 10 descriptive levels",
        ),
        (
            json.dumps({"state": "x", "questions": {"q": noul}, "prefix_policy": "always"}),
            "prefix_policy must be off, default, shared, fixed or auto",
        ),
        (json.dumps({"state": "word " * 17000, "questions": {"q": noul}}), "too_long"),  # message checked by prefix
    ]


# -- the hostile mix --------------------------------------------------------------------------

HOSTILE_PARTS = ("idle", "oversized", "cancel", "kill")
# Statuses a request may end with while the worker is down (from the kill until the frontend is
# SERVING again, plus KILL_SLACK_SECONDS), besides the one its kind expects.
DURING_KILL = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
KILL_SLACK_SECONDS = 2.0
# A request of this size takes about a second on the CPU demo model: long enough to be cancelled
# or to run out of its deadline part-way.
MEDIUM = {
    "state": "word " * 600,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(6)}}},
}
# Per kind, the statuses that count as expected ("OPEN": an idle stream answered its first
# message and stayed open until the end; "STOPPED": an idle Execute the soak itself cancelled
# at the end). OK answers must still equal the answer alone, refusals carry their exact message.
EXPECTED = {
    "valid": {"OK"},
    "invalid": {"INVALID_ARGUMENT"},
    "oversized": {"INVALID_ARGUMENT"},
    "cancel": {"CANCELLED", "OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "idle_watch": {"OPEN", "RESOURCE_EXHAUSTED"},
    "idle_reflection": {"OPEN", "RESOURCE_EXHAUSTED"},
    "idle_execute": {"CANCELLED", "STOPPED"},
}
KINDS = tuple(EXPECTED)


@dataclass
class Hostile:
    """What the hostile mix adds beside the clients (see docs/reliability.md)."""

    parts: tuple[str, ...] = HOSTILE_PARTS
    watch_streams: int = 36  # idle health Watch streams on the public port (the cap is 32)
    reflection_streams: int = 10  # idle reflection streams on the public port (the cap is 8)
    execute_streams: int = 4  # Execute streams on the worker port that never commit
    commit_timeout_seconds: float = 3.0  # the worker's --commit-timeout-seconds (own pair)
    kills: int = 2  # kill -9 of the worker, spread over the run (own pair)
    max_rendered_bytes: int = 64 * 2**20  # the frontend's --max-rendered-bytes
    max_request_tokens: int = 32768  # the frontend's --max-request-tokens (the soak's own pair sets it)
    request_bound_seconds: float = 30.0  # a request without a status after this long is hung
    stream_bound_seconds: float = 10.0  # an idle stream must answer (or be refused) within this
    memory_bound_mib: float = 128.0  # after - before, per process

    def has(self, part: str) -> bool:
        return part in self.parts


class WorkerControl:
    """The soak's own worker: kill -9 and start again on the same port (same flags)."""

    def __init__(self, model: Path, workdir: Path, args: list[str], process: Process):
        self.model, self.workdir, self.args, self.process = model, workdir, args, process
        self.restarts = 0

    @property
    def address(self) -> str:
        return self.process.address

    def kill_and_restart(self) -> None:
        from openjev.tools import launch

        self.process.kill()
        self.restarts += 1
        self.process = launch.start_worker(self.model, self.workdir, self.args, name=f"worker-{self.restarts}")

    def stop(self) -> None:
        self.process.stop()


@dataclass
class Outcome:
    kind: str  # one of KINDS
    status: str
    seconds: float
    ok: bool  # the outcome was the expected one (equal answer / exact message), kills aside
    request_id: str
    started: float = 0.0  # time.monotonic() when sent
    ended: float = 0.0  # time.monotonic() when its status came (or its first reply, for an idle stream)
    answered_ok: bool | None = None  # an OK answer: equal to the answer alone?
    detail: str = ""


@dataclass
class Report:
    clients: int
    requests: int = 0
    by_status: dict = field(default_factory=dict)
    mismatches: int = 0  # cross-talk: OK answers different from the answer alone
    lost: int = 0
    hung: int = 0
    unexpected: list = field(default_factory=list)
    latency_ms: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_check: str = "skipped"
    hostile: dict = field(default_factory=dict)  # the mix's settings, kills, refusal details, drain

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)

    def at(q: float) -> float:  # nearest rank: the smallest value with at least q of them at or below it
        return round(values[max(0, math.ceil(q * len(values)) - 1)] * 1e3, 2)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(values[-1] * 1e3, 2), "n": len(values)}


def baseline(address: str, valid: list[tuple[dict, PrefixPolicy | None]], timeout: float) -> list[dict]:
    """Each valid request sent alone (one at a time) before the run: the answers to compare with."""
    with Client(address) as client:
        return [comparable(client.decide(request, policy=policy, timeout=timeout)) for request, policy in valid]


def oversized_requests(hostile: Hostile) -> list[tuple[str, str]]:
    """(request JSON text, exact INVALID_ARGUMENT message): over the rendered-size limit (refused
    before tokenizing) and over the token limit (refused while tokenizing, before the worker runs).
    The token case is left out where the limit is too large to reach cheaply."""
    out = []
    state = "x" * (hostile.max_rendered_bytes // 16 + 1)  # 16 candidates: over the limit
    criteria = dict.fromkeys(map(str, range(16)))
    body = {"state": state, "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": criteria}}}
    out.append((json.dumps(body), "request exceeds the rendered size limit"))
    if hostile.max_request_tokens <= 262144:
        # "word " * 1000 is about 1,030 tokens a candidate, far under max_length.
        n = hostile.max_request_tokens // 1000 + 8
        criteria = dict.fromkeys(map(str, range(n)))
        body = {
            "state": "word " * 1000,
            "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": criteria}},
        }
        out.append((json.dumps(body), "request exceeds the token limit"))
    return out


def outcome_counts(url: str, series: str) -> dict[str, float]:
    """A `..._count{kind,outcome}` series of the /metrics page at `url`, summed per outcome label
    (outcomes counted at least once)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(series + "{") and 'outcome="' in line:
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(line.split()[-1])
    return {outcome: count for outcome, count in counts.items() if count}


def _metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _blocked(first: Any, release: threading.Event) -> Iterator[Any]:
    """A request stream that sends `first` and then nothing until released."""
    yield first
    release.wait()


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
) -> Report:
    """Send up to `requests` requests from `clients` threads, stopping early after `duration`
    seconds; return the report. `pids`: processes whose RSS to report (name -> pid).
    `hostile`: add the hostile mix; `worker`: the soak's own worker (its port gets idle Execute
    streams, and it is killed and restarted); `metrics_ports`: name -> port of /metrics, to check
    that nothing stays in flight afterwards."""
    valid = valid_requests()
    invalid = invalid_requests()
    expected = baseline(address, valid, timeout)
    # A second warm pass so the RSS "before" is taken after allocator growth from first use.
    baseline(address, valid, timeout)
    parts = hostile.parts if hostile else ()
    if worker is None:
        parts = tuple(p for p in parts if p != "kill")
    expected_medium = baseline(address, [(MEDIUM, "off")], timeout)[0] if {"cancel"} & set(parts) else {}
    oversized = oversized_requests(hostile) if hostile and "oversized" in parts else []
    report = Report(clients=clients)
    pids = dict(pids or {})
    report.rss["before_mib"] = {name: round(rss_bytes(pid) / 2**20, 1) for name, pid in pids.items()}
    peak = dict(report.rss["before_mib"])
    rng = random.Random(seed)
    plan = [(rng.random() < invalid_fraction, rng.randrange(10**6)) for _ in range(requests)]
    next_index = [0]
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    sent_ids: list[str] = []  # Decide calls: one frontend log line each
    pending: dict[str, tuple[str, float]] = {}  # request id -> (kind, started): no status yet
    stop_at = time.monotonic() + duration
    stop = threading.Event()  # the run's time is up: hostile loops end
    release = threading.Event()  # idle streams' request iterators may end
    kills: list[dict] = []
    bound = hostile.request_bound_seconds if hostile else timeout
    # Bounded by a count and a time: the bar counts requests; its log lines show the time too.
    bar = progress.Progress(f"soak ({clients} clients, at most {duration:g} s)", len(plan))

    def begin(kind: str, prefix: str = "soak") -> tuple[str, float]:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        started = time.monotonic()
        with lock:
            pending[request_id] = (kind, started)
            if prefix == "soak":
                sent_ids.append(request_id)
        return request_id, started

    def finish(outcome: Outcome) -> None:
        outcome.ended = outcome.ended or time.monotonic()
        outcome.seconds = outcome.ended - outcome.started
        with lock:
            pending.pop(outcome.request_id, None)
            outcomes.append(outcome)

    def take() -> tuple[bool, int] | None:
        with lock:
            if next_index[0] >= len(plan) or time.monotonic() >= stop_at:
                return None
            next_index[0] += 1
            return plan[next_index[0] - 1]

    def refusal(kind: str, request_id: str, started: float, error: grpc.RpcError, message: str) -> Outcome:
        code = error.code().name
        good = code == "INVALID_ARGUMENT" and (
            error.details() == message or (message == "too_long" and error.details().endswith("no silent truncation"))
        )
        return Outcome(kind, code, 0.0, good, request_id, started, detail=error.details() or "")

    def expect_refusal(client: Client, kind: str, text: str, message: str) -> Outcome:
        """Send a request that must be refused with `message`; its outcome."""
        request_id, started = begin(kind)
        try:
            client.decide(text, timeout=timeout, request_id=request_id)
            return Outcome(kind, "OK", 0.0, False, request_id, started)
        except grpc.RpcError as error:
            return refusal(kind, request_id, started, error, message)

    def client_loop() -> None:
        with Client(address) as client:
            while (item := take()) is not None:
                is_invalid, pick = item
                if is_invalid:
                    outcome = expect_refusal(client, "invalid", *invalid[pick % len(invalid)])
                else:
                    index = pick % len(valid)
                    request, policy = valid[index]
                    request_id, started = begin("valid")
                    try:
                        got = comparable(client.decide(request, policy=policy, timeout=timeout, request_id=request_id))
                        same = got == expected[index]
                        outcome = Outcome("valid", "OK", 0.0, same, request_id, started, answered_ok=same)
                    except grpc.RpcError as error:
                        outcome = Outcome(
                            "valid", error.code().name, 0.0, False, request_id, started, detail=error.details() or ""
                        )
                finish(outcome)
                if outcome.status == "UNAVAILABLE":
                    time.sleep(0.5)  # the worker is down: do not spin through the plan
                with lock:
                    bar.advance()

    def oversized_loop() -> None:
        with Client(address) as client:
            i = 0
            while not stop.is_set():
                outcome = expect_refusal(client, "oversized", *oversized[i % len(oversized)])
                i += 1
                finish(outcome)
                stop.wait(0.5)

    def cancel_loop(seed_: int) -> None:
        local = random.Random(seed_)
        body = api.DecideRequest(request_json=json.dumps(MEDIUM), prefix_policy=api.PREFIX_POLICY_OFF)
        with Client(address) as client:
            while not stop.is_set():
                kind = local.choice(("cancel", "deadline"))
                request_id, started = begin(kind)
                metadata = [("x-request-id", request_id)]
                try:
                    if kind == "cancel":
                        future = client.stub.Decide.future(body, timeout=timeout, metadata=metadata)
                        time.sleep(local.uniform(0.05, 1.0))
                        future.cancel()
                        reply = future.result()
                    else:
                        reply = client.stub.Decide(body, timeout=local.uniform(0.05, 0.8), metadata=metadata)
                    same = comparable(response_to_json(reply)) == expected_medium
                    outcome = Outcome(kind, "OK", 0.0, same, request_id, started, answered_ok=same)
                except grpc.FutureCancelledError:
                    outcome = Outcome(kind, "CANCELLED", 0.0, True, request_id, started)
                except grpc.RpcError as error:
                    outcome = Outcome(
                        kind, error.code().name, 0.0, True, request_id, started, detail=error.details() or ""
                    )
                finish(outcome)
                if outcome.status == "UNAVAILABLE":
                    stop.wait(0.2)

    def idle_stream(kind: str, open_call: Any) -> None:
        """One idle stream on the public port: it must answer its first message (or be refused
        with the cap's message) within the stream bound, then stays open until the end."""
        request_id, started = begin(kind, prefix=kind)
        try:
            call = open_call()
            next(call)
        except grpc.RpcError as error:
            code = error.code().name
            good = code != "RESOURCE_EXHAUSTED" or "concurrent" in (error.details() or "")
            finish(Outcome(kind, code, 0.0, good, request_id, started, detail=error.details() or ""))
            return
        outcome = Outcome(kind, "OPEN", 0.0, True, request_id, started, ended=time.monotonic())
        with lock:
            streams.append(call)
        stop.wait()
        if call.done() and call.code() != grpc.StatusCode.CANCELLED:  # ended by the server mid-run
            outcome.status, outcome.detail = call.code().name, call.details() or ""
        call.cancel()
        finish(outcome)

    def idle_execute_loop() -> None:
        """Execute streams on the worker port that send a header and never commit: the worker
        cancels each after --commit-timeout-seconds; a new one is opened at once."""
        header = wire.ExecuteRequest(
            header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
        )
        assert worker is not None and hostile is not None
        channel_address = worker.address
        channel = grpc.insecure_channel(channel_address)
        try:
            while not stop.is_set():
                request_id, started = begin("idle_execute", prefix="idle-execute")
                call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(
                    _blocked(header, release),
                    timeout=hostile.commit_timeout_seconds + bound,
                    metadata=[("x-request-id", request_id)],
                )
                with lock:
                    streams.append(call)
                try:
                    for _ in call:
                        pass
                    outcome = Outcome("idle_execute", "OK", 0.0, False, request_id, started)
                except grpc.RpcError as error:
                    code = error.code().name
                    if stop.is_set() and code == "CANCELLED" and "Locally cancelled" in (error.details() or ""):
                        code = "STOPPED"
                    outcome = Outcome(
                        "idle_execute", code, 0.0, True, request_id, started, detail=error.details() or ""
                    )
                finish(outcome)
                if outcome.status == "UNAVAILABLE":
                    stop.wait(0.3)
        finally:
            channel.close()

    def kill_loop() -> None:
        assert worker is not None and hostile is not None
        from openjev.tools import launch

        for k in range(hostile.kills):
            if stop.wait(max(0.0, run_started + duration * (k + 1) / (hostile.kills + 1) - time.monotonic())):
                return
            with lock:
                in_flight = [i for i, (kind, _) in pending.items() if not kind.startswith("idle_")]
            record: dict[str, Any] = {"at_s": round(time.monotonic() - run_started, 1), "in_flight": len(in_flight)}
            killed_at = time.monotonic()
            record["_killed_at"] = killed_at
            kills.append(record)
            try:
                worker.kill_and_restart()
                with lock:
                    pids["worker"] = worker.process.popen.pid
                launch.wait_serving(address, timeout_seconds=60)
                record["_up_at"] = time.monotonic()
                record["down_s"] = round(record["_up_at"] - killed_at, 2)
            except launch.LaunchError as error:
                record["error"] = str(error)[:500]
                return
            record["_in_flight_ids"] = in_flight

    def sample_rss(done: threading.Event) -> None:
        while not done.wait(0.5):
            for name, pid in list(pids.items()):
                try:
                    peak[name] = max(peak[name], round(rss_bytes(pid) / 2**20, 1))
                except (OSError, RuntimeError):
                    pass

    streams: list[Any] = []
    run_started = time.monotonic()
    done = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(done,), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}") for i in range(clients)]
    extra: list[threading.Thread] = []
    public = grpc.insecure_channel(address)
    if hostile and "idle" in parts:
        health = health_pb2_grpc.HealthStub(public)
        reflection = reflection_pb2_grpc.ServerReflectionStub(public)
        long = duration + bound + 60
        for _ in range(hostile.watch_streams):
            opener = functools.partial(health.Watch, health_pb2.HealthCheckRequest(), timeout=long)
            extra.append(threading.Thread(target=idle_stream, args=("idle_watch", opener), daemon=True))
        for _ in range(hostile.reflection_streams):
            first = reflection_pb2.ServerReflectionRequest(list_services="")
            opener = functools.partial(reflection.ServerReflectionInfo, _blocked(first, release), timeout=long)
            extra.append(threading.Thread(target=idle_stream, args=("idle_reflection", opener), daemon=True))
        if worker is not None:
            extra += [threading.Thread(target=idle_execute_loop, daemon=True) for _ in range(hostile.execute_streams)]
    if oversized:
        extra.append(threading.Thread(target=oversized_loop, daemon=True))
    if "cancel" in parts:
        extra += [threading.Thread(target=cancel_loop, args=(seed + i,), daemon=True) for i in range(2)]
    if "kill" in parts:
        extra.append(threading.Thread(target=kill_loop, name="kill", daemon=True))
    for t in extra + threads:
        t.start()
    for t in threads:
        t.join(max(1.0, stop_at - time.monotonic()) + bound + 30)
    stop.set()
    for t in extra:
        t.join(bound + 10 if t.name != "kill" else 90)
    with lock:
        for call in streams:
            call.cancel()
    release.set()
    for t in extra:
        t.join(10)
    public.close()
    bar.close()
    done.set()
    report.seconds = round(time.monotonic() - run_started, 2)

    # -- judge every outcome: expected status, exact message, equal answer, within its bound --
    now = time.monotonic()
    windows = [
        (k["_killed_at"], k.get("_up_at", float("inf")) + KILL_SLACK_SECONDS) for k in kills if "_killed_at" in k
    ]
    report.requests = len(sent_ids)
    with lock:
        still = dict(pending)
        finished = list(outcomes)
    report.lost = sum(1 for kind, _ in still.values() if kind not in ("idle_watch", "idle_reflection"))
    stream_bound = hostile.stream_bound_seconds if hostile else bound
    report.hung = sum(1 for kind, started in still.values() if now - started > bound)
    for o in finished:
        limit = stream_bound if o.kind.startswith("idle_") and o.kind != "idle_execute" else bound
        if o.kind == "idle_execute" and o.status != "STOPPED" and hostile:
            limit = hostile.commit_timeout_seconds + stream_bound
        late = o.status != "STOPPED" and o.seconds > limit
        report.hung += late
        in_window = any(o.started <= end and o.ended >= begin_ for begin_, end in windows)
        fine = (
            (o.status in EXPECTED[o.kind] and o.ok and o.answered_ok is not False)
            or (in_window and o.status in DURING_KILL)
            or (in_window and o.kind == "idle_execute" and o.status == "UNAVAILABLE")
        )
        key = f"{o.kind}:{o.status}"
        report.by_status[key] = report.by_status.get(key, 0) + 1
        report.mismatches += o.answered_ok is False
        if (late or not fine) and len(report.unexpected) < 20:
            report.unexpected.append(
                {
                    "kind": o.kind,
                    "status": o.status,
                    "seconds": round(o.seconds, 2),
                    "detail": o.detail[:200],
                    "request_id": o.request_id,
                }
            )
    report.latency_ms = {
        kind: percentiles([o.seconds for o in finished if o.kind == kind and o.status not in ("OPEN", "STOPPED")])
        for kind in KINDS
        if any(o.kind == kind for o in finished)
    }
    if hostile:
        by_id = {o.request_id: o for o in finished}
        for k in kills:
            ids = k.pop("_in_flight_ids", [])
            ended = [by_id[i] for i in ids if i in by_id]
            killed_at = k.pop("_killed_at")
            k.pop("_up_at", None)
            k["in_flight_statuses"] = {
                s: sum(1 for o in ended if o.status == s) for s in sorted({o.status for o in ended})
            }
            k["in_flight_ended_within_s"] = round(max((o.ended - killed_at for o in ended), default=0.0), 2)
        details: dict[str, str] = {}
        for o in finished:
            if o.detail and o.status != "OK":
                details.setdefault(f"{o.kind}:{o.status}", o.detail[:200])
        drained = {}
        names = {"frontend": "openjev_frontend_in_flight_requests", "worker": "openjev_worker_queue_depth"}
        for name, port in (metrics_ports or {}).items():
            deadline = time.monotonic() + 15
            value = _metric(port, names[name])
            while value not in (0.0, None) and time.monotonic() < deadline:
                time.sleep(0.25)
                value = _metric(port, names[name])
            drained[names[name]] = value
        report.hostile = {
            "parts": list(parts),
            "kills": kills,
            "statuses_said": details,
            "after_drain": drained,
            "bounds": {
                "request_s": bound,
                "stream_first_reply_s": stream_bound,
                "idle_execute_s": hostile.commit_timeout_seconds + stream_bound,
                "memory_growth_mib": hostile.memory_bound_mib,
            },
            "streams": {
                "watch": hostile.watch_streams,
                "reflection": hostile.reflection_streams,
                "execute": hostile.execute_streams if worker else 0,
            },
        }
    report.rss["after_mib"] = {name: round(rss_bytes(pid) / 2**20, 1) for name, pid in pids.items()}
    report.rss["peak_mib"] = peak
    if frontend_log is not None:
        time.sleep(0.2)  # the last lines are written after the response
        lines = [
            r
            for r in log_events(frontend_log.read_text(errors="replace"), "decide")
            if str(r.get("request_id", "")).startswith("soak-")
        ]
        counts: dict[str, int] = {}
        for r in lines:
            counts[r["request_id"]] = counts.get(r["request_id"], 0) + 1
        by_id = {o.request_id: o for o in finished}
        # A call its client cancelled (or let expire) before the server read its request never
        # reaches the servicer, so it has no line: zero is allowed for those, never two.
        unread = [
            i
            for i in sent_ids
            if counts.get(i, 0) == 0
            and i in by_id
            and by_id[i].kind in ("cancel", "deadline")
            and by_id[i].status in ("CANCELLED", "DEADLINE_EXCEEDED")
        ]
        missing = [i for i in sent_ids if counts.get(i, 0) != 1 and i not in unread]
        said = sorted({f"{by_id[i].kind}:{by_id[i].status}" if i in by_id else "no status" for i in missing})
        report.log_check = (
            "ok: one frontend log line per request id"
            + (f" ({len(unread)} cancelled before the frontend read them: none)" if unread else "")
            if not missing
            else f"{len(missing)} ids without exactly one line ({', '.join(said)})"
        )
    return report


def failures(report: Report) -> list[str]:
    """Why a report fails the soak's rules (empty: it passes)."""
    problems = []
    if report.lost:
        problems.append(f"{report.lost} requests without a terminal status")
    if report.hung:
        problems.append(f"{report.hung} requests past their bound without a status")
    if report.mismatches:
        problems.append(f"{report.mismatches} answers different from the answer alone (cross-talk)")
    if report.unexpected:
        problems.append(f"unexpected outcomes: {report.unexpected}")
    if report.log_check not in ("skipped",) and not report.log_check.startswith("ok"):
        problems.append(f"log check: {report.log_check}")
    if report.hostile:
        for k in report.hostile["kills"]:
            if "error" in k:
                problems.append(f"the worker did not come back after a kill: {k['error']}")
        for name, value in report.hostile["after_drain"].items():
            if value != 0.0:
                problems.append(f"{name} is {value} after the run (a request was not freed)")
        bound = report.hostile["bounds"]["memory_growth_mib"]
        for name, before in report.rss.get("before_mib", {}).items():
            growth = report.rss["after_mib"][name] - before
            if growth > bound:
                problems.append(f"{name} RSS grew {growth:.1f} MiB (bound {bound:g})")
    return problems


def format_report(report: Report) -> str:
    lines = [
        f"soak: {report.requests} Decide requests from {report.clients} clients in {report.seconds} s",
        f"  hung: {report.hung}; lost: {report.lost}; cross-talk (answers different from the answer alone): "
        f"{report.mismatches}; unexpected outcomes: {len(report.unexpected)}; {report.log_check}",
    ]
    kinds = sorted({k.split(":")[0] for k in report.by_status}, key=lambda k: KINDS.index(k) if k in KINDS else 99)
    for kind in kinds:
        counts = ", ".join(
            f"{k.split(':')[1]}={v}" for k, v in sorted(report.by_status.items()) if k.startswith(kind + ":")
        )
        lines.append(f"  {kind:16} {counts}")
    for kind, p in report.latency_ms.items():
        if p:
            lines.append(
                f"  latency {kind} ms: p50 {p['p50']}  p90 {p['p90']}  p99 {p['p99']}  max {p['max']}  (n={p['n']})"
            )
    if report.hostile:
        for k in report.hostile["kills"]:
            lines.append(
                f"  worker kill -9 at {k['at_s']} s: {k['in_flight']} in flight -> {k.get('in_flight_statuses')}"
                f" within {k.get('in_flight_ended_within_s')} s; SERVING again after {k.get('down_s')} s"
                + (f"; ERROR {k['error']}" if "error" in k else "")
            )
        for key, said in sorted(report.hostile["statuses_said"].items()):
            lines.append(f"  {key} said: {said!r}")
        if report.hostile["after_drain"]:
            lines.append(
                "  after the run: "
                + ", ".join(
                    f"{k}={v:g}" if v is not None else f"{k}=?" for k, v in report.hostile["after_drain"].items()
                )
            )
    bound = report.hostile.get("bounds", {}).get("memory_growth_mib") if report.hostile else None
    for name in report.rss.get("before_mib", {}):
        before, after = report.rss["before_mib"][name], report.rss["after_mib"][name]
        lines.append(
            f"  RSS {name} MiB: before {before}  after {after}  peak {report.rss['peak_mib'][name]}"
            + (f"  (growth {after - before:+.1f}, bound {bound:g})" if bound is not None else "")
        )
    problems = failures(report)
    lines.append("  verdict: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return "\n".join(lines)


def start_soak_pair(model: Path, workdir: Path, hostile: Hostile | None) -> tuple[Any, WorkerControl, dict[str, int]]:
    """The soak's own worker + frontend on loopback: the worker on a fixed port (so it can come
    back on it after a kill), metrics on both, the hostile mix's limits. Returns the pair, the
    worker's control and the metrics ports."""
    from openjev.tools import launch

    metrics = {"frontend": launch.free_port(), "worker": launch.free_port()}
    worker_args = ["--listen", f"127.0.0.1:{launch.free_port()}", "--metrics-port", str(metrics["worker"])]
    frontend_args = ["--metrics-port", str(metrics["frontend"])]
    if hostile is not None:
        worker_args += ["--commit-timeout-seconds", str(hostile.commit_timeout_seconds)]
        frontend_args += [
            "--worker-refresh-seconds",
            "0.5",
            "--worker-deadline-seconds",
            str(max(1.0, hostile.request_bound_seconds - 10)),
            "--max-request-tokens",
            str(hostile.max_request_tokens),
            "--max-rendered-bytes",
            str(hostile.max_rendered_bytes),
        ]
    pair = launch.start_pair(model, workdir, worker_args=worker_args, frontend_args=frontend_args)
    return pair, WorkerControl(model, workdir, worker_args, pair.worker), metrics


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m openjev.tools.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start a worker + frontend on loopback serving this export")
    where.add_argument("--addr", help="use a running frontend at HOST:PORT instead (no RSS, log check or kills)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2000, help="at most this many requests")
    p.add_argument("--duration", type=float, default=60.0, help="at most this many seconds")
    p.add_argument("--invalid-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hostile",
        default=",".join(HOSTILE_PARTS),
        help="the hostile mix, comma-separated parts of idle,oversized,cancel,kill, or none "
        "(kill and the worker's idle Execute streams need --model)",
    )
    defaults = Hostile()
    p.add_argument("--kills", type=int, default=defaults.kills, help="kill -9 of the worker during the run")
    p.add_argument("--watch-streams", type=int, default=defaults.watch_streams)
    p.add_argument("--reflection-streams", type=int, default=defaults.reflection_streams)
    p.add_argument("--execute-streams", type=int, default=defaults.execute_streams)
    p.add_argument("--commit-timeout-seconds", type=float, default=defaults.commit_timeout_seconds)
    p.add_argument("--max-rendered-bytes", type=int, default=defaults.max_rendered_bytes, help="the frontend's")
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help=f"the frontend's (default: {defaults.max_request_tokens}, what the soak's own pair runs with; "
        "with --addr the frontend's own default)",
    )
    p.add_argument("--request-bound-seconds", type=float, default=defaults.request_bound_seconds)
    p.add_argument("--memory-bound-mib", type=float, default=defaults.memory_bound_mib)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.duration <= 0:
        raise SystemExit("--clients, --requests and --duration must be positive")
    chosen = tuple(x for x in args.hostile.split(",") if x and x != "none")
    if set(chosen) - set(HOSTILE_PARTS):
        raise SystemExit(f"--hostile: unknown part(s) {sorted(set(chosen) - set(HOSTILE_PARTS))}")
    tokens_limit = args.max_request_tokens
    if tokens_limit is None:  # the soak's own pair runs with 32768; another frontend with its default
        tokens_limit = DEFAULT_MAX_REQUEST_TOKENS if args.addr else defaults.max_request_tokens
    hostile = (
        Hostile(
            parts=chosen,
            watch_streams=args.watch_streams,
            reflection_streams=args.reflection_streams,
            execute_streams=args.execute_streams,
            commit_timeout_seconds=args.commit_timeout_seconds,
            kills=args.kills,
            max_rendered_bytes=args.max_rendered_bytes,
            max_request_tokens=tokens_limit,
            request_bound_seconds=args.request_bound_seconds,
            memory_bound_mib=args.memory_bound_mib,
        )
        if chosen
        else None
    )
    kwargs = dict(
        clients=args.clients,
        requests=args.requests,
        duration=args.duration,
        invalid_fraction=args.invalid_fraction,
        seed=args.seed,
        hostile=hostile,
    )
    if args.addr:
        report = run_load(args.addr, **kwargs)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="openjev-soak-"))
        pair, worker, metrics = start_soak_pair(args.model, workdir, hostile)
        try:
            report = run_load(
                pair.frontend.address,
                pids={"worker": pair.worker.popen.pid, "frontend": pair.frontend.popen.pid},
                frontend_log=pair.frontend.log_path,
                worker=worker,
                metrics_ports=metrics,
                **kwargs,
            )
        finally:
            pair.frontend.stop()
            worker.stop()
    print(format_report(report))
    print(json.dumps(report.as_dict(), sort_keys=True))
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    problems = failures(report)
    if problems:
        raise SystemExit("soak failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
