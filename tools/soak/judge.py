"""Judging a finished run: every outcome against its kind's expected statuses, its exact message,
the answer alone and its time bound (a kill's window excuses UNAVAILABLE and DEADLINE_EXCEEDED);
requests without a status (lost, hung); what the kills did; the drain of in-flight gauges and RSS
(with or without a hostile mix); and one frontend log line per request id. The result fills the
Report."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from openjev.tools.soak.hostile import DURING_KILL, KILL_SLACK_SECONDS
from openjev.tools.soak.outcomes import EXPECTED, KINDS, Outcome
from openjev.tools.soak.probes import log_events, metric, rss_bytes
from openjev.tools.soak.report import Report

if TYPE_CHECKING:
    from openjev.tools.soak.run import Run


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)

    def at(q: float) -> float:  # nearest rank: the smallest value with at least q of them at or below it
        return round(values[max(0, math.ceil(q * len(values)) - 1)] * 1e3, 2)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(values[-1] * 1e3, 2), "n": len(values)}


def judge(run: Run, report: Report, *, frontend_log: Path | None, metrics_ports: dict[str, int] | None) -> None:
    """Fill `report` from the run's outcomes (after all its threads have ended or timed out)."""
    # -- judge every outcome: expected status, exact message, equal answer, within its bound --
    now = time.monotonic()
    windows = [
        (k["_killed_at"], k.get("_up_at", float("inf")) + KILL_SLACK_SECONDS) for k in run.kills if "_killed_at" in k
    ]
    report.requests = len(run.sent_ids)
    with run.lock:
        still = dict(run.pending)
        finished = list(run.outcomes)
    report.lost = sum(1 for kind, _ in still.values() if kind not in ("idle_watch", "idle_reflection"))
    stream_bound = run.hostile.stream_bound_seconds if run.hostile else run.bound
    report.hung = sum(1 for kind, started in still.values() if now - started > run.bound)
    _judge_outcomes(run, report, finished, windows, stream_bound)
    report.latency_ms = {
        kind: percentiles([o.seconds for o in finished if o.kind == kind and o.status not in ("OPEN", "STOPPED")])
        for kind in KINDS
        if any(o.kind == kind for o in finished)
    }
    if run.hostile:
        report.hostile = _hostile_summary(run, finished, stream_bound)
    report.after_drain = _drain(metrics_ports)
    report.rss["after_mib"] = {name: _rss_mib(pid) for name, pid in run.pids.items()}
    report.rss["peak_mib"] = run.peak
    if frontend_log is not None:
        report.log_check = _log_check(run, finished, frontend_log)


def _judge_outcomes(
    run: Run, report: Report, finished: list[Outcome], windows: list[tuple[float, float]], stream_bound: float
) -> None:
    """Count each outcome by kind and status; late or unexpected ones (the first 20) go to
    `report.unexpected`."""
    hostile, bound = run.hostile, run.bound
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
        report.unexpected_count += late or not fine
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


def _hostile_summary(run: Run, finished: list[Outcome], stream_bound: float) -> dict:
    """The report's `hostile` part: what each kill did to the requests in flight (and how many
    were asked for), what each refusal said, the bounds and the stream counts."""
    hostile = run.hostile
    assert hostile is not None
    by_id = {o.request_id: o for o in finished}
    for k in run.kills:
        ids = k.pop("_in_flight_ids", [])
        ended = [by_id[i] for i in ids if i in by_id]
        killed_at = k.pop("_killed_at")
        k.pop("_up_at", None)
        k["in_flight_statuses"] = {s: sum(1 for o in ended if o.status == s) for s in sorted({o.status for o in ended})}
        k["in_flight_ended_within_s"] = round(max((o.ended - killed_at for o in ended), default=0.0), 2)
    details: dict[str, str] = {}
    for o in finished:
        if o.detail and o.status != "OK":
            details.setdefault(f"{o.kind}:{o.status}", o.detail[:200])
    return {
        "parts": list(run.parts),
        "kills": run.kills,
        "kills_asked": hostile.kills if "kill" in run.parts else 0,
        "statuses_said": details,
        "bounds": {
            "request_s": run.bound,
            "stream_first_reply_s": stream_bound,
            "idle_execute_s": hostile.commit_timeout_seconds + stream_bound,
            "memory_growth_mib": hostile.memory_bound_mib,
        },
        "streams": {
            "watch": hostile.watch_streams,
            "reflection": hostile.reflection_streams,
            "execute": hostile.execute_streams if run.worker else 0,
        }
        if "idle" in run.parts
        else {},
    }


def _rss_mib(pid: int) -> float | None:
    """None where the process is gone (a worker whose restart failed: its pid is the killed one's),
    which the report counts as a failure rather than the judge crashing before its verdict."""
    try:
        return round(rss_bytes(pid) / 2**20, 1)
    except OSError:
        return None


def _drain(metrics_ports: dict[str, int] | None) -> dict[str, float | None]:
    """Each server's in-flight gauge, once it is 0 (or after 15 s; None: no /metrics page)."""
    drained = {}
    names = {"frontend": "openjev_frontend_in_flight_requests", "worker": "openjev_worker_queue_depth"}
    for name, port in (metrics_ports or {}).items():
        deadline = time.monotonic() + 15
        value = metric(port, names[name])
        while value not in (0.0, None) and time.monotonic() < deadline:
            time.sleep(0.25)
            value = metric(port, names[name])
        drained[names[name]] = value
    return drained


def _log_check(run: Run, finished: list[Outcome], frontend_log: Path) -> str:
    """Whether the frontend log holds exactly one `decide` line per Decide request id."""
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
        for i in run.sent_ids
        if counts.get(i, 0) == 0
        and i in by_id
        and by_id[i].kind in ("cancel", "deadline")
        and by_id[i].status in ("CANCELLED", "DEADLINE_EXCEEDED")
    ]
    missing = [i for i in run.sent_ids if counts.get(i, 0) != 1 and i not in unread]
    said = sorted({f"{by_id[i].kind}:{by_id[i].status}" if i in by_id else "no status" for i in missing})
    return (
        "ok: one frontend log line per request id"
        + (f" ({len(unread)} cancelled before the frontend read them: none)" if unread else "")
        if not missing
        else f"{len(missing)} ids without exactly one line ({', '.join(said)})"
    )
