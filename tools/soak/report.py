"""The soak's report: its numbers, the rules it must meet (`failures`) and its text."""

from __future__ import annotations

from dataclasses import dataclass, field

from openjev.tools.soak.outcomes import KINDS


@dataclass
class Report:
    clients: int
    requests: int = 0
    by_status: dict = field(default_factory=dict)
    mismatches: int = 0  # cross-talk: OK answers different from the answer alone
    lost: int = 0
    hung: int = 0
    unexpected: list = field(default_factory=list)  # the first 20
    unexpected_count: int = 0
    baseline_differs: int = 0  # valid requests answered otherwise when sent alone a second time
    latency_ms: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_check: str = "skipped"
    after_drain: dict = field(default_factory=dict)  # in-flight gauges after the run (metric -> value)
    hostile: dict = field(default_factory=dict)  # the mix's settings, kills, refusal details

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def failures(report: Report) -> list[str]:
    """Why a report fails the soak's rules (empty: it passes)."""
    problems = []
    if report.lost:
        problems.append(f"{report.lost} requests without a terminal status")
    if report.hung:
        problems.append(f"{report.hung} requests past their bound without a status")
    if report.mismatches:
        problems.append(f"{report.mismatches} answers different from the answer alone (cross-talk)")
    if report.baseline_differs:
        problems.append(
            f"{report.baseline_differs} valid requests answered otherwise when sent alone again (every comparison "
            "assumes one answer per request)"
        )
    if report.unexpected_count:
        problems.append(
            f"{report.unexpected_count} unexpected outcomes (the first {len(report.unexpected)}: {report.unexpected})"
        )
    if report.log_check not in ("skipped",) and not report.log_check.startswith("ok"):
        problems.append(f"log check: {report.log_check}")
    for name, value in report.after_drain.items():
        if value != 0.0:
            problems.append(f"{name} is {value} after the run (a request was not freed)")
    if report.hostile:
        for k in report.hostile["kills"]:
            if "error" in k:
                problems.append(f"the worker did not come back after a kill: {k['error']}")
            elif "down_s" not in k:  # its restart outlasted the run: every later failure was excused
                problems.append(f"the worker killed at {k['at_s']} s was not serving again when the run was judged")
        done, asked = len(report.hostile["kills"]), report.hostile["kills_asked"]
        if done < asked:
            problems.append(f"{done} of {asked} kills done (the clients ended before the rest were due)")
    bound = report.rss.get("bound_mib")
    for name, before in report.rss.get("before_mib", {}).items():
        after = report.rss["after_mib"][name]
        if after is None:
            problems.append(f"{name} was not running when the run was judged")
            continue
        # the peak too: a worker killed and restarted is gone by the end, its growth with it
        growth = max(after, report.rss["peak_mib"][name]) - before
        if bound is not None and growth > bound:
            problems.append(f"{name} RSS grew {growth:.1f} MiB at its peak (bound {bound:g})")
    return problems


def format_report(report: Report) -> str:
    lines = [
        f"soak: {report.requests} Decide requests from {report.clients} clients in {report.seconds} s",
        f"  hung: {report.hung}; lost: {report.lost}; cross-talk (answers different from the answer alone): "
        f"{report.mismatches}; unexpected outcomes: {report.unexpected_count}; {report.log_check}",
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
    if report.after_drain:
        lines.append(
            "  after the run: "
            + ", ".join(f"{k}={v:g}" if v is not None else f"{k}=?" for k, v in report.after_drain.items())
        )
    bound = report.rss.get("bound_mib")
    for name in report.rss.get("before_mib", {}):
        before, after, peak = (report.rss[k][name] for k in ("before_mib", "after_mib", "peak_mib"))
        lines.append(
            f"  RSS {name} MiB: before {before}  after {after}  peak {peak}"
            + (
                f"  (growth at the peak {max(after, peak) - before:+.1f}, bound {bound:g})"
                if bound is not None and after is not None
                else ""
            )
        )
    problems = failures(report)
    lines.append("  verdict: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return "\n".join(lines)
