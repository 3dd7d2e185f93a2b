"""A short hostile soak (the code of `make soak`): valid and invalid clients beside idle streams
on both ports, oversized requests, client cancellations and short deadlines, and a `kill -9` of
the worker restarted on its port. No request may hang past its bound, be lost, or get another
request's answer; nothing stays in flight afterwards.

Found by it (2026-11-30, CPU demo pair): requests in flight when the worker is killed can stay
blocked in the frontend past --worker-deadline-seconds (until the frontend stops), with
openjev_frontend_in_flight_requests stuck above 0: issue 14's finding 3 is not fully fixed. The
test is xfail (not strict) until it is."""

from __future__ import annotations

import pytest

from openjev.tools import soak


@pytest.mark.xfail(
    strict=False,
    reason="issue 14 finding 3 recurs under the hostile mix: a request in flight at a worker kill "
    "can outlive --worker-deadline-seconds in the frontend",
)
def test_short_hostile_soak_has_no_hung_lost_or_cross_talk(demo_model, tmp_path):
    hostile = soak.Hostile(
        watch_streams=34, reflection_streams=9, execute_streams=2, kills=1, request_bound_seconds=25.0
    )
    pair, worker, metrics = soak.start_soak_pair(demo_model, tmp_path, hostile)
    try:
        report = soak.run_load(
            pair.frontend.address,
            clients=4,
            requests=5000,
            duration=30,
            seed=3,
            timeout=45,
            pids={"worker": pair.worker.popen.pid, "frontend": pair.frontend.popen.pid},
            frontend_log=pair.frontend.log_path,
            hostile=hostile,
            worker=worker,
            metrics_ports=metrics,
        )
    finally:
        pair.frontend.stop()
        worker.stop()
    print(soak.format_report(report))
    assert report.hung == 0 and report.lost == 0 and report.mismatches == 0, soak.format_report(report)
    assert soak.failures(report) == [], soak.format_report(report)
    kinds = {key.split(":")[0] for key in report.by_status}
    assert {"valid", "invalid", "oversized", "idle_watch", "idle_reflection", "idle_execute"} <= kinds
    assert report.by_status.get("oversized:INVALID_ARGUMENT", 0) > 0
    assert report.by_status.get("idle_watch:RESOURCE_EXHAUSTED", 0) >= 2  # 34 streams, a cap of 32
    assert report.by_status.get("idle_execute:CANCELLED", 0) > 0  # the commit timeout
    assert len(report.hostile["kills"]) == 1 and "error" not in report.hostile["kills"][0]
