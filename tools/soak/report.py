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
    unexpected: list = field(default_factory=list)
    latency_ms: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)
    seconds: float = 0.0
    log_check: str = "skipped"
    hostile: dict = field(default_factory=dict)  # the mix's settings, kills, refusal details, drain

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
