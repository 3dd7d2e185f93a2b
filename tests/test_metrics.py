"""The Prometheus endpoints of a real worker and frontend: the documented series are there and
move with traffic (by kind and outcome, tokens, batches, queue, worker health)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openjev.client import Client
from openjev.tools import launch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = json.loads((REPO / "examples" / "contract_example.json").read_text())
NOUL = {"state": "The order arrived broken.", "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}}


@pytest.fixture(scope="module")
def served(demo_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("metrics")
    worker_metrics, frontend_metrics = launch.free_port(), launch.free_port()
    worker = launch.start_worker(demo_model, workdir, ["--metrics-port", str(worker_metrics)])
    frontend = launch.start_frontend(
        demo_model,
        worker.address,
        workdir,
        ["--metrics-port", str(frontend_metrics), "--worker-refresh-seconds", "0.5"],
    )
    try:
        launch.wait_serving(frontend.address)
        yield {
            "worker": worker,
            "frontend": frontend,
            "worker_url": f"http://127.0.0.1:{worker_metrics}/metrics",
            "frontend_url": f"http://127.0.0.1:{frontend_metrics}/metrics",
        }
    finally:
        frontend.stop()
        worker.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}"""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, missing: float | None = None, **labels) -> float:
    """The series' value; one that is not there fails the test (a renamed or dropped series would
    otherwise read as 0) unless `missing` gives its value (a labelled series before its first use)."""
    key = (name, tuple(sorted(labels.items())))
    if key not in samples and missing is not None:
        return missing
    assert key in samples, f"no series {name} {labels}"
    return samples[key]


def test_a_fresh_worker_counts_no_pass(served):
    """The warm-up request before SERVING is not traffic: the pass series start at zero (runs
    first in this module, before any request)."""
    worker = scrape(served["worker_url"])
    assert value(worker, "openjev_worker_launches_total") == 0
    assert value(worker, "openjev_worker_pass_requests_count") == 0
    assert value(worker, "openjev_worker_launch_tokens_sum") == 0


def test_series_move_with_traffic(served):
    frontend_before, worker_before = scrape(served["frontend_url"]), scrape(served["worker_url"])
    with Client(served["frontend"].address) as c:
        c.decide(EXAMPLE, policy="shared", timeout=60)
        c.decide(NOUL, timeout=60)
        with pytest.raises(grpc.RpcError):
            c.decide({"questions": {}}, timeout=60)
    frontend, worker = scrape(served["frontend_url"]), scrape(served["worker_url"])

    def moved(samples, before, name, **labels):
        return value(samples, name, **labels) - value(before, name, missing=0.0, **labels)

    latency = "openjev_frontend_request_seconds_count"
    assert moved(frontend, frontend_before, latency, kind="mixed", outcome="OK") == 1
    assert moved(frontend, frontend_before, latency, kind="noul", outcome="OK") == 1
    assert moved(frontend, frontend_before, latency, kind="unknown", outcome="INVALID_ARGUMENT") == 1
    assert (
        moved(
            frontend, frontend_before, "openjev_frontend_request_seconds_bucket", kind="noul", outcome="OK", le="+Inf"
        )
        == 1
    )
    assert moved(frontend, frontend_before, "openjev_frontend_input_tokens_total") > 0
    assert moved(frontend, frontend_before, "openjev_frontend_saved_tokens_total") > 0
    assert moved(frontend, frontend_before, "openjev_frontend_request_candidates_count") == 2
    assert value(frontend, "openjev_frontend_in_flight_requests") == 0
    assert value(frontend, "openjev_frontend_worker_up", worker=served["worker"].address) == 1
    assert value(frontend, "openjev_frontend_workers_serving") == 1

    assert moved(worker, worker_before, "openjev_worker_execute_seconds_count", kind="mixed", outcome="OK") == 1
    assert moved(worker, worker_before, "openjev_worker_execute_seconds_count", kind="noul", outcome="OK") == 1
    submitted = moved(worker, worker_before, "openjev_worker_submitted_tokens_total")
    computed = moved(worker, worker_before, "openjev_worker_computed_tokens_total")
    saved = moved(worker, worker_before, "openjev_worker_saved_tokens_total")
    assert submitted > 0 and 0 < computed <= submitted and saved > 0  # EXAMPLE under `shared` shares its context
    assert moved(frontend, frontend_before, "openjev_frontend_input_tokens_total") == submitted
    launches = moved(worker, worker_before, "openjev_worker_launches_total")
    assert launches >= 2
    assert moved(worker, worker_before, "openjev_worker_launch_sequences_count") == launches
    # the plans' tokens less those the state cache gave: what the passes ran (no padding on the CPU)
    hit = moved(worker, worker_before, "openjev_worker_state_cache_hit_tokens_total")
    assert moved(worker, worker_before, "openjev_worker_launch_tokens_sum") == computed - hit
    assert moved(worker, worker_before, "openjev_worker_queue_seconds_count") == 2
    assert ("openjev_worker_queue_depth", ()) in worker
    assert worker[("openjev_worker_held_tokens", ())] == 0  # both answered: every held token given back
    assert ("openjev_worker_graph_cache_hits_total", ()) in worker  # 0 on the CPU path
    assert ("process_cpu_seconds_total", ()) in worker and ("process_cpu_seconds_total", ()) in frontend


def test_frontend_sees_worker_go_down(served):
    """Worker health as the frontend sees it: a stopped worker is 0 within a few refreshes."""
    import time

    served["worker"].stop()
    deadline = time.monotonic() + 15
    while value(scrape(served["frontend_url"]), "openjev_frontend_worker_up", worker=served["worker"].address) != 0:
        assert time.monotonic() < deadline, "worker_up stayed 1 after the worker stopped"
        time.sleep(0.2)
    assert value(scrape(served["frontend_url"]), "openjev_frontend_workers_serving") == 0


def test_idle_connections_to_the_metrics_port_hold_bounded_threads(monkeypatch, capfd):
    """Connections that never send a request: at most MAX_METRICS_CONNECTIONS get a thread, each
    for the handler's timeout (here 4 and 2 s); a scrape answers once they are dropped (1,000 such
    connections held 1,000 threads of a worker for as long as they stayed open)."""
    import socket
    import threading
    import time

    from prometheus_client import CollectorRegistry, Counter

    from openjev import metrics

    monkeypatch.setattr(metrics, "MAX_METRICS_CONNECTIONS", 4)
    monkeypatch.setattr(metrics._MetricsHandler, "timeout", 2)
    registry = CollectorRegistry()
    Counter("t_scrapes", "a series to find", registry=registry).inc()
    port = launch.free_port()
    before = threading.active_count()
    server = metrics.serve(registry, "127.0.0.1:0", port, "test")
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        time.sleep(1.0)
        assert threading.active_count() - before <= 1 + 2 * 4  # the server's thread, 4 handlers and their timers
        time.sleep(1.5)  # the handlers' sockets time out
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert "t_scrapes_total 1.0" in reply.read().decode()
        assert "Traceback" not in capfd.readouterr().err  # a timed-out client is no error to print
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        server.server_close()


def test_a_client_trickling_its_request_is_cut_at_the_connection_limit(monkeypatch):
    """A byte every 0.3 s passes a 1 s socket timeout forever; the connection's own limit (1 s
    here) ends it all the same, so 64 such clients cannot hold the port."""
    import socket
    import time

    from prometheus_client import CollectorRegistry

    from openjev import metrics

    monkeypatch.setattr(metrics._MetricsHandler, "timeout", 1)
    port = launch.free_port()
    server = metrics.serve(CollectorRegistry(), "127.0.0.1:0", port, "test")
    trickle = socket.create_connection(("127.0.0.1", port))
    started = time.monotonic()
    try:
        with pytest.raises(OSError):  # the server shut the connection: a write fails in the end
            for byte in b"GET /metrics HTTP/1.1\r\n" * 10:
                trickle.sendall(bytes([byte]))
                time.sleep(0.3)
                assert time.monotonic() - started < 5, "the trickle was never cut"
    finally:
        trickle.close()
        server.shutdown()
        server.server_close()


def test_histograms_reach_the_largest_values_the_defaults_allow():
    """A call may last the frontend's default 120 s worker deadline, and a request of 65,536
    candidates at 64 segments a pass runs 1,024 passes: each lands in a finite bucket (latency
    buckets ended at 30 s and pass buckets at 128, so both read as +Inf)."""
    from openjev import metrics
    from openjev.contract.request import MAX_CANDIDATES
    from openjev.frontend.main import parser as frontend_parser
    from openjev.worker.main import parser as worker_parser

    deadline = frontend_parser().parse_args(["--model", "m"]).worker_deadline_seconds
    segments = worker_parser().parse_args(["--model", "m"]).max_launch_sequences
    assert max(metrics.LATENCY_BUCKETS_S) >= deadline == 120.0
    assert max(metrics.worker_passes_per_request._upper_bounds[:-1]) >= MAX_CANDIDATES // segments == 1024
