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
import json
import random
import tempfile
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


@dataclass
class Outcome:
    kind: str  # "valid" | "invalid"
    status: str
    seconds: float
    ok: bool  # the outcome was the expected one (equal answer / exact message)
    request_id: str


@dataclass
class Report:
    clients: int
    requests: int = 0
    by_status: dict = field(default_factory=dict)
    mismatches: int = 0
    lost: int = 0
    unexpected: list = field(default_factory=list)
    latency_ms: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_check: str = "skipped"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)

    def at(q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))] * 1e3, 2)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(values[-1] * 1e3, 2), "n": len(values)}


def baseline(address: str, valid: list[tuple[dict, PrefixPolicy | None]], timeout: float) -> list[dict]:
    """Each valid request sent alone (one at a time) before the run: the answers to compare with."""
    with Client(address) as client:
        return [comparable(client.decide(request, policy=policy, timeout=timeout)) for request, policy in valid]


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
) -> Report:
    """Send up to `requests` requests from `clients` threads, stopping early after `duration`
    seconds; return the report. `pids`: processes whose RSS to report (name -> pid)."""
    valid = valid_requests()
    invalid = invalid_requests()
    expected = baseline(address, valid, timeout)
    # A second warm pass so the RSS "before" is taken after allocator growth from first use.
    baseline(address, valid, timeout)
    report = Report(clients=clients)
    pids = pids or {}
    report.rss["before_mib"] = {name: round(rss_bytes(pid) / 2**20, 1) for name, pid in pids.items()}
    peak = dict(report.rss["before_mib"])
    rng = random.Random(seed)
    plan = [(rng.random() < invalid_fraction, rng.randrange(10**6)) for _ in range(requests)]
    next_index = [0]
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    sent_ids: list[str] = []
    stop_at = time.monotonic() + duration
    # Bounded by a count and a time: the bar counts requests; its log lines show the time too.
    bar = progress.Progress(f"soak ({clients} clients, at most {duration:g} s)", len(plan))

    def take() -> tuple[bool, int] | None:
        with lock:
            if next_index[0] >= len(plan) or time.monotonic() >= stop_at:
                return None
            next_index[0] += 1
            return plan[next_index[0] - 1]

    def client_loop() -> None:
        with Client(address) as client:
            while (item := take()) is not None:
                is_invalid, pick = item
                request_id = f"soak-{uuid.uuid4().hex}"
                with lock:
                    sent_ids.append(request_id)
                started = time.perf_counter()
                if is_invalid:
                    text, message = invalid[pick % len(invalid)]
                    try:
                        client.decide(text, timeout=timeout, request_id=request_id)
                        outcome = Outcome("invalid", "OK", time.perf_counter() - started, False, request_id)
                    except grpc.RpcError as error:
                        good = error.code() == grpc.StatusCode.INVALID_ARGUMENT and (
                            error.details() == message
                            or (message == "too_long" and error.details().endswith("no silent truncation"))
                        )
                        outcome = Outcome("invalid", error.code().name, time.perf_counter() - started, good, request_id)
                else:
                    index = pick % len(valid)
                    request, policy = valid[index]
                    try:
                        got = comparable(client.decide(request, policy=policy, timeout=timeout, request_id=request_id))
                        outcome = Outcome(
                            "valid", "OK", time.perf_counter() - started, got == expected[index], request_id
                        )
                    except grpc.RpcError as error:
                        outcome = Outcome("valid", error.code().name, time.perf_counter() - started, False, request_id)
                with lock:
                    outcomes.append(outcome)
                    bar.advance()

    def sample_rss(done: threading.Event) -> None:
        while not done.wait(0.5):
            for name, pid in pids.items():
                try:
                    peak[name] = max(peak[name], round(rss_bytes(pid) / 2**20, 1))
                except (OSError, RuntimeError):
                    pass

    started = time.monotonic()
    done = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(done,), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + timeout + 30)
    bar.close()
    done.set()
    report.seconds = round(time.monotonic() - started, 2)
    report.requests = len(sent_ids)
    report.lost = len(sent_ids) - len(outcomes)
    for o in outcomes:
        key = f"{o.kind}:{o.status}"
        report.by_status[key] = report.by_status.get(key, 0) + 1
        if not o.ok:
            report.mismatches += o.status == "OK" and o.kind == "valid"
            if len(report.unexpected) < 20:
                report.unexpected.append({"kind": o.kind, "status": o.status, "request_id": o.request_id})
    report.latency_ms = {
        kind: percentiles([o.seconds for o in outcomes if o.kind == kind]) for kind in ("valid", "invalid")
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
        missing = [i for i in sent_ids if counts.get(i, 0) != 1]
        report.log_check = (
            "ok: one frontend log line per request id"
            if not missing
            else f"{len(missing)} ids without exactly one line"
        )
    return report


def failures(report: Report) -> list[str]:
    """Why a report fails the soak's rules (empty: it passes)."""
    problems = []
    if report.lost:
        problems.append(f"{report.lost} requests without a terminal status")
    if report.unexpected:
        problems.append(f"unexpected outcomes: {report.unexpected}")
    if report.log_check not in ("skipped",) and not report.log_check.startswith("ok"):
        problems.append(f"log check: {report.log_check}")
    return problems


def format_report(report: Report) -> str:
    lines = [
        f"soak: {report.requests} requests from {report.clients} clients in {report.seconds} s",
        "  by status: " + ", ".join(f"{k}={v}" for k, v in sorted(report.by_status.items())),
        f"  valid answers different from the answer alone: {report.mismatches}; lost: {report.lost}",
        f"  unexpected outcomes: {len(report.unexpected)}; {report.log_check}",
    ]
    for kind, p in report.latency_ms.items():
        if p:
            lines.append(
                f"  latency {kind} ms: p50 {p['p50']}  p90 {p['p90']}  p99 {p['p99']}  max {p['max']}  (n={p['n']})"
            )
    for name in report.rss.get("before_mib", {}):
        lines.append(
            f"  RSS {name} MiB: before {report.rss['before_mib'][name]}  after {report.rss['after_mib'][name]}"
            f"  peak {report.rss['peak_mib'][name]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m openjev.tools.soak", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start a worker + frontend on loopback serving this export")
    where.add_argument("--addr", help="use a running frontend at HOST:PORT instead (no RSS or log check)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2000, help="at most this many requests")
    p.add_argument("--duration", type=float, default=60.0, help="at most this many seconds")
    p.add_argument("--invalid-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.duration <= 0:
        raise SystemExit("--clients, --requests and --duration must be positive")
    kwargs = dict(
        clients=args.clients,
        requests=args.requests,
        duration=args.duration,
        invalid_fraction=args.invalid_fraction,
        seed=args.seed,
    )
    if args.addr:
        report = run_load(args.addr, **kwargs)
    else:
        from openjev.tools import launch

        workdir = Path(tempfile.mkdtemp(prefix="openjev-soak-"))
        pair = launch.start_pair(args.model, workdir)
        try:
            report = run_load(
                pair.frontend.address,
                pids={"worker": pair.worker.popen.pid, "frontend": pair.frontend.popen.pid},
                frontend_log=pair.frontend.log_path,
                **kwargs,
            )
        finally:
            pair.stop()
    print(format_report(report))
    print(json.dumps(report.as_dict(), sort_keys=True))
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    problems = failures(report)
    if problems:
        raise SystemExit("soak failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
