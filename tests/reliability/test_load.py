"""Load: concurrent clients, a mix of valid and invalid requests, bounded in count and time
(the same code as `make soak`, smaller). Every valid answer equals the answer to the same
request sent alone, every invalid one gets its exact message, no request is lost (one frontend
log line per request id), and memory stays steady."""

from __future__ import annotations

from openjev.tools import soak


def test_concurrent_mixed_load_has_no_cross_talk_or_loss(pair):
    report = soak.run_load(
        pair.frontend.address,
        clients=6,
        requests=120,
        duration=45,
        invalid_fraction=0.3,
        seed=1,
        pids={"worker": pair.worker.popen.pid, "frontend": pair.frontend.popen.pid},
        frontend_log=pair.frontend.log_path,
    )
    print(soak.format_report(report))
    assert soak.failures(report) == []
    assert report.requests == 120 and report.lost == 0 and report.mismatches == 0
    assert report.by_status.get("valid:OK", 0) > 50 and report.by_status.get("invalid:INVALID_ARGUMENT", 0) > 20
    assert set(report.by_status) == {"valid:OK", "invalid:INVALID_ARGUMENT"}
    for name, before in report.rss["before_mib"].items():
        assert report.rss["after_mib"][name] - before < 96, report.rss  # steady, not growing per request
