"""What the soak reads from the servers: RSS from /proc, JSON log lines, /metrics series.

`rss_bytes`, `child_pids`, `log_events` and `outcome_counts` are shared with tests/reliability (imported from
`openjev.tools.soak`)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident set size of a process, from /proc (Linux); field "VmHWM": its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def child_pids(pid: int) -> list[int]:
    """The process's children, from /proc (Linux): the frontend's body parsers, say."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += map(int, (task / "children").read_text().split())
    return children


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


def metric(port: int, name: str) -> float | None:
    """One unlabelled sample of the /metrics page on a loopback port (None: no page or no sample)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
