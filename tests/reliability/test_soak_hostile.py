"""A short hostile soak (the code of `make soak`): valid and invalid clients beside idle streams
on both ports, oversized requests, client cancellations and short deadlines, and a `kill -9` of
the worker restarted on its port. No request may hang past its bound, be lost, or get another
request's answer; nothing stays in flight afterwards.

Found by it: a request in flight when the worker was killed could stay blocked in the frontend
past --worker-deadline-seconds (until the frontend stopped), with the in-flight gauge stuck above
0 (gRPC's own retries; test_worker_loss.py reproduces it every time and says why).

Memory is reported, not judged, here: 30 s puts the "before" reading inside the allocator's
growth from the first oversized bodies; `make soak` (75 s) judges it."""

from __future__ import annotations

from openjev.tools import soak


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
    problems = [p for p in soak.failures(report) if not p.startswith(("frontend RSS", "worker RSS"))]
    assert problems == [], soak.format_report(report)
    kinds = {key.split(":")[0] for key in report.by_status}
    assert {"valid", "invalid", "oversized", "idle_watch", "idle_reflection", "idle_execute"} <= kinds
    assert report.by_status.get("oversized:INVALID_ARGUMENT", 0) > 0
    assert report.by_status.get("idle_watch:RESOURCE_EXHAUSTED", 0) >= 2  # 34 streams, a cap of 32
    assert report.by_status.get("idle_execute:CANCELLED", 0) > 0  # the commit timeout
    assert len(report.hostile["kills"]) == 1 and "down_s" in report.hostile["kills"][0]  # back, in time
    assert report.by_status.get("valid:OK", 0) > 0 and report.baseline_differs == 0
