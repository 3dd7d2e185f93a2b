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


def test_many_concurrent_clients_then_one_more(pair):
    """32 clients at once for a few seconds, then one more request: every request is answered.
    (With a per-connection HTTP/2 stream cap both servers once began refusing every new stream
    under such load, and kept refusing after it.)"""
    import threading
    import time

    import grpc

    from openjev.client import Client

    body = {"state": "load", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
    statuses: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + 6

    def client_loop() -> None:
        with Client(pair.frontend.address) as client:
            while time.monotonic() < stop_at:
                try:
                    client.decide(body, timeout=60)
                    status = "OK"
                except grpc.RpcError as error:
                    status = error.code().name
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=client_loop) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(statuses) == {"OK"} and statuses["OK"] >= 32, statuses
    with Client(pair.frontend.address) as client:
        assert client.decide(body, timeout=30)["answers"]["q"]["type"] == "noul"


def test_soak_percentiles_are_nearest_rank():
    """p90 of ten values is the ninth (it was the tenth: the maximum, whenever q x n was whole)."""
    from openjev.tools.soak import percentiles

    tenths = percentiles([i / 1000 for i in range(1, 11)])
    assert (tenths["p50"], tenths["p90"], tenths["p99"], tenths["max"]) == (5.0, 9.0, 10.0, 10.0)
    assert percentiles([0.004, 0.001, 0.003, 0.002])["p50"] == 2.0
