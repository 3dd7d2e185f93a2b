"""The metrics observers' arithmetic: each series moves by the right amount, in the right unit
(seconds, not milliseconds) and with the right labels; and the pass series of a real worker."""

from __future__ import annotations

import time

import pytest
from test_metrics import scrape

from openjev import metrics
from openjev.client import Client
from openjev.interceptors import RequestInfo
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire

NOUL = {"state": "The order arrived broken.", "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}}


def sample(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class Moves:
    """Deltas of a registry's samples across a block (the registries are process-wide)."""

    def __init__(self, registry, *keys: tuple):
        self.registry, self.keys = registry, keys

    def __enter__(self):
        self.before = {k: sample(self.registry, k[0], **dict(k[1:])) for k in self.keys}
        return self

    def __exit__(self, *exc):
        return False

    def __getitem__(self, key: tuple) -> float:
        return sample(self.registry, key[0], **dict(key[1:])) - self.before[key]


def decide_response(input_tokens: int, saved: int, candidates: int) -> api.DecideResponse:
    response = api.DecideResponse()
    response.usage.input_tokens = input_tokens
    response.metadata.prefix_cache.saved_tokens = saved
    response.metadata.candidate_sequences = candidates
    return response


def test_frontend_observer_records_seconds_tokens_and_candidates_exactly():
    f = "openjev_frontend_"
    latency = (("kind", "choice"), ("outcome", "OK"))
    keys = (
        (f + "request_seconds_bucket", *latency, ("le", "0.025")),
        (f + "request_seconds_bucket", *latency, ("le", "0.01")),
        (f + "request_seconds_sum", *latency),
        (f + "input_tokens_total",),
        (f + "saved_tokens_total",),
        (f + "request_candidates_sum",),
        (f + "request_candidates_count",),
        (f + "in_flight_requests",),
    )
    observer = metrics.FrontendObserver()
    info = RequestInfo(method="/openjev.v1.DecisionService/Decide", request_id="r", kinds={"choice"})
    with Moves(metrics.frontend_registry, *keys) as moved:
        observer.on_start(info)
        assert moved[(f + "in_flight_requests",)] == 1
        observer.on_response(info, decide_response(input_tokens=40, saved=12, candidates=3))
        observer.on_end(info, "OK", 0.02)
    assert moved[keys[0]] == 1 and moved[keys[1]] == 0  # 20 ms: above the 10 ms edge, within 25 ms
    assert moved[keys[2]] == pytest.approx(0.02)
    assert moved[keys[3]] == 40 and moved[keys[4]] == 12
    assert moved[keys[5]] == 3 and moved[keys[6]] == 1
    assert moved[keys[7]] == 0  # back down once the call ended


def test_worker_observer_records_seconds_tokens_queue_and_passes_exactly():
    w = "openjev_worker_"
    latency = (("kind", "noul"), ("outcome", "OK"))
    keys = (
        (w + "execute_seconds_bucket", *latency, ("le", "0.05")),
        (w + "execute_seconds_sum", *latency),
        (w + "queue_seconds_sum",),
        (w + "queue_seconds_bucket", ("le", "0.005")),
        (w + "passes_per_request_sum",),
        (w + "passes_per_request_count",),
        (w + "submitted_tokens_total",),
        (w + "computed_tokens_total",),
        (w + "saved_tokens_total",),
    )
    observer = metrics.WorkerObserver()
    info = RequestInfo(method="/openjev.worker.v1.WorkerService/ExecuteUnary", request_id="r", kinds={"noul"})
    reply = wire.ExecuteUnaryResponse()
    s = reply.summary
    s.submitted_tokens, s.computed_tokens, s.saved_tokens, s.num_launches, s.queue_seconds = 50, 30, 20, 3, 0.004
    with Moves(metrics.worker_registry, *keys) as moved:
        observer.on_response(info, reply)
        observer.on_end(info, "OK", 0.04)
    assert moved[keys[0]] == 1 and moved[keys[1]] == pytest.approx(0.04)
    assert moved[keys[2]] == pytest.approx(0.004) and moved[keys[3]] == 1
    assert moved[keys[4]] == 3 and moved[keys[5]] == 1
    assert (moved[keys[6]], moved[keys[7]], moved[keys[8]]) == (50, 30, 20)


def test_worker_observer_counts_no_tokens_of_a_call_that_ended_without_ok():
    """A summary sent, then the call failed (e.g. its caller left): its tokens are not counted answered."""
    info = RequestInfo(method="/openjev.worker.v1.WorkerService/ExecuteUnary", request_id="r", kinds={"noul"})
    reply = wire.ExecuteUnaryResponse()
    reply.summary.submitted_tokens = 50
    key = ("openjev_worker_submitted_tokens_total",)
    with Moves(metrics.worker_registry, key) as moved:
        observer = metrics.WorkerObserver()
        observer.on_response(info, reply)
        observer.on_end(info, "CANCELLED", 0.01)
    assert moved[key] == 0


def test_state_cache_observer_counts_hits_inserts_and_every_evicted_state():
    w = "openjev_worker_state_cache_"
    keys = ((w + "hits_total",), (w + "hit_tokens_total",), (w + "inserts_total",), (w + "evictions_total",))
    observer = metrics.StateCacheObserver()
    with Moves(metrics.worker_registry, *keys) as moved:
        observer.on_hit(17)
        observer.on_insert(4096)
        observer.on_evict(3, 12288)
    assert [moved[k] for k in keys] == [1, 17, 1, 3]


def test_the_deadline_is_a_latency_bucket_edge():
    """A call cut at the frontend's default 120 s worker deadline is told apart from longer ones."""
    from openjev.frontend.main import parser as frontend_parser

    deadline = frontend_parser().parse_args(["--model", "m"]).worker_deadline_seconds
    assert deadline in metrics.LATENCY_BUCKETS_S
    assert 1024 in metrics.PASS_BUCKETS  # 65,536 candidates at 64 segments a pass


def test_a_real_worker_records_each_pass_and_its_batch_sizes(demo_model, tmp_path):
    """The scheduler's pass hook and the counting runner are wired in: after one request alone, the
    pass series have moved by its passes, and the launches packed its candidates."""
    port = launch.free_port()
    worker = launch.start_worker(demo_model, tmp_path, ["--metrics-port", str(port)])
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        launch.wait_serving(frontend.address)
        before = scrape(url)
        with Client(frontend.address) as c:
            answer = c.decide(NOUL, timeout=60)
        after = scrape(url)
    finally:
        frontend.stop()
        worker.stop()

    def moved(name):
        return after[(name, ())] - before[(name, ())]

    w = "openjev_worker_"
    launches = moved(w + "launches_total")
    assert launches >= 1
    passes = moved(w + "pass_requests_count")
    assert passes >= 1
    assert moved(w + "pass_requests_sum") == passes  # one request: every pass was its alone
    assert moved(w + "passes_per_request_sum") == passes  # ... and it ran in each of them
    assert moved(w + "launch_sequences_count") == launches
    # no prefix sharing for one question: each candidate is one packed sequence of its own tokens
    assert answer["metadata"]["prefix_cache"]["enabled"] is False
    assert moved(w + "launch_sequences_sum") == answer["metadata"]["candidate_sequences"]
    assert moved(w + "launch_tokens_sum") == answer["usage"]["input_tokens"]
    assert 0 <= moved(w + "queue_seconds_sum") < 10  # seconds, on an idle worker


def test_a_worker_gone_from_a_dns_name_leaves_no_worker_up_series(demo_model, tmp_path):
    """A dns:/// target that drops an address: that worker's `worker_up` series goes (a stale 1 or 0
    for a pod long replaced would alert, or count, forever)."""
    from test_dns_workers import in_namespace

    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 wk\n127.0.0.2 wk\n")
    python = in_namespace(tmp_path, hosts)
    port, metrics_port = launch.free_port(), launch.free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    processes = []

    def up_series() -> set[str]:
        return {dict(labels)["worker"] for name, labels in scrape(url) if name == "openjev_frontend_worker_up"}

    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            processes.append(launch.start_worker(demo_model, tmp_path, ["--listen", f"{host}:{port}"], name=host))
        frontend = launch.start(
            "frontend",
            launch.FRONTEND_MODULE,
            ["--model", str(demo_model), "--worker", f"dns:///wk:{port}", "--plaintext"]
            + ["--worker-refresh-seconds", "0.5", "--metrics-port", str(metrics_port)],
            workdir=tmp_path,
            python=python,
        )
        processes.append(frontend)
        launch.wait_serving(frontend.address)
        deadline = time.monotonic() + 15
        while len(up_series()) < 2:
            assert time.monotonic() < deadline, f"both workers never had a series: {up_series()}"
            time.sleep(0.2)
        assert up_series() == {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
        hosts.write_text("127.0.0.1 localhost\n127.0.0.1 wk\n")  # in place: the bind mount shows it
        deadline = time.monotonic() + 15
        while up_series() != {f"127.0.0.1:{port}"}:
            assert time.monotonic() < deadline, f"the dropped worker's series stayed: {up_series()}"
            time.sleep(0.2)
    finally:
        for process in reversed(processes):
            process.stop(timeout_seconds=10)
