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

from openjev.tools.soak.cli import main, start_soak_pair
from openjev.tools.soak.hostile import DURING_KILL, HOSTILE_PARTS, KILL_SLACK_SECONDS, Hostile, WorkerControl
from openjev.tools.soak.judge import percentiles
from openjev.tools.soak.outcomes import EXPECTED, KINDS, Outcome
from openjev.tools.soak.probes import child_pids, log_events, outcome_counts, rss_bytes
from openjev.tools.soak.report import Report, failures, format_report
from openjev.tools.soak.run import run_load
from openjev.tools.soak.workload import (
    MEDIUM,
    STATES,
    baseline,
    comparable,
    invalid_requests,
    oversized_requests,
    valid_requests,
)

# The names `openjev.tools.soak` had as one module (tests, benchmarks and docs import them from here).
__all__ = [
    "DURING_KILL",
    "EXPECTED",
    "HOSTILE_PARTS",
    "KILL_SLACK_SECONDS",
    "KINDS",
    "MEDIUM",
    "STATES",
    "Hostile",
    "Outcome",
    "Report",
    "WorkerControl",
    "baseline",
    "child_pids",
    "comparable",
    "failures",
    "format_report",
    "invalid_requests",
    "log_events",
    "main",
    "oversized_requests",
    "outcome_counts",
    "percentiles",
    "rss_bytes",
    "run_load",
    "start_soak_pair",
    "valid_requests",
]
