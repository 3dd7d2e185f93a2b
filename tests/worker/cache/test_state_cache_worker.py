"""The state cache in a real worker process: `--state-cache-bytes 0` turns it off, hits travel
in the Execute stream's trailing metadata, the log line and the Prometheus series, and the
answers and the summary (reuse inside the request) are those of the worker with no cache."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openjev import interceptors
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.worker.cache.sizing import CPU_DEFAULT_BYTES
from openjev.worker.service import CACHE_HIT_TOKENS_KEY
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc


@pytest.fixture(scope="module")
def workers(demo_model, tmp_path_factory):
    started = {}
    try:
        for name, extra in (("on", []), ("off", ["--state-cache-bytes", "0"])):
            port = launch.free_port()
            process = launch.start_worker(
                demo_model, tmp_path_factory.mktemp(name), ["--metrics-port", str(port), *extra], name=name
            )
            started[name] = (process, f"http://127.0.0.1:{port}/metrics")
        yield started
    finally:
        for process, _ in started.values():
            process.stop()


def execute(address: str, questions: list[list[list[int]]], request_id: str, timeout: float = 60):
    header = wire.ExecuteHeader(request_id=request_id, prefix_policy=api.PREFIX_POLICY_SHARED)
    for candidates in questions:
        header.questions.append(wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=len(candidates)))
    batch = wire.CandidateBatch(
        candidates=[
            wire.Candidate(question_index=q, candidate_index=c, token_ids=ids)
            for q, candidates in enumerate(questions)
            for c, ids in enumerate(candidates)
        ]
    )
    messages = [
        wire.ExecuteRequest(header=header),
        wire.ExecuteRequest(batch=batch),
        wire.ExecuteRequest(commit=wire.Commit()),
    ]
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(
            iter(messages), timeout=timeout, metadata=((interceptors.REQUEST_ID_KEY, request_id),)
        )
        responses = list(call)
        trailing = dict(call.trailing_metadata() or ())
    answers = [
        (list(r.question.probabilities), list(r.question.head_scores)) for r in responses if r.HasField("question")
    ]
    summary = next(r.summary for r in responses if r.HasField("summary"))
    return answers, summary, int(trailing[CACHE_HIT_TOKENS_KEY])


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return samples[name]


def test_hits_reported_and_answers_unchanged(workers):
    rng = random.Random(2)
    state = [rng.randrange(1000, 5000) for _ in range(700)]
    asks = [[[state + [rng.randrange(1000, 5000) for _ in range(20)] + [c] for c in (7, 8, 9)]] for _ in range(3)]
    got = {
        name: [execute(process.address, q, f"{name}-{i}") for i, q in enumerate(asks)]
        for name, (process, _) in workers.items()
    }
    for (a_answers, a_summary, _), (b_answers, b_summary, _) in zip(got["on"], got["off"], strict=True):
        assert a_answers == b_answers
        assert (a_summary.saved_tokens, a_summary.computed_tokens) == (
            b_summary.saved_tokens,
            b_summary.computed_tokens,
        )
    on_hits = [hit for *_, hit in got["on"]]
    assert on_hits[0] == 0 and all(640 <= hit <= 700 for hit in on_hits[1:])
    assert [hit for *_, hit in got["off"]] == [0, 0, 0]

    on, off = workers["on"][1], workers["off"][1]
    assert metric(on, "openjev_worker_state_cache_hit_tokens_total") == sum(on_hits)
    assert metric(on, "openjev_worker_state_cache_bytes") > 0
    assert metric(on, "openjev_worker_state_cache_budget_bytes") == CPU_DEFAULT_BYTES
    assert metric(off, "openjev_worker_state_cache_hit_tokens_total") == 0
    assert metric(off, "openjev_worker_state_cache_budget_bytes") == 0

    lines = [json.loads(line) for line in workers["on"][0].log_text().splitlines() if line.startswith("{")]
    logged = {
        line["request_id"]: line["cache_hit_tokens"]
        for line in lines
        if line.get("event") == "execute" and "cache_hit_tokens" in line
    }
    assert [logged[f"on-{i}"] for i in range(3)] == on_hits


def test_a_call_whose_caller_left_in_its_last_pass_is_not_counted_answered(demo_model, tmp_path):
    """A request that hangs from cached states and whose caller's deadline passes in its last
    pass: the worker finishes it, but no one gets the answer. Its log line says so (outcome),
    and neither the cache's hit counters nor the token counters count it (they did, with the
    log line OK: a review, 2026-12-04)."""
    from openjev.tools.soak import log_events

    port = launch.free_port()
    process = launch.start_worker(demo_model, tmp_path, ["--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}/metrics"
    rng = random.Random(5)
    state = [rng.randrange(1000, 5000) for _ in range(1500)]
    try:
        execute(process.address, [[state + [7], state + [8]]], "deposit")
        before = {name: metric(url, name) for name in COUNTED}
        long_tails = [[state + [rng.randrange(1000, 5000) for _ in range(1800)] + [c] for c in (7, 8)]]  # one pass
        with pytest.raises(grpc.RpcError) as caught:
            execute(process.address, long_tails, "late", timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 60  # the worker finishes the pass, then logs the call
        while not (lines := [e for e in log_events(process.log_text(), "execute") if e["request_id"] == "late"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # the call's end is counted after its log line
        after = {name: metric(url, name) for name in COUNTED}
    finally:
        process.stop()
    assert lines[0]["status"] == "OK" and lines[0]["cache_hit_tokens"] >= 1408, lines  # it did hang from the cache
    assert lines[0]["outcome"] == "DEADLINE_EXCEEDED", lines
    assert after == before


COUNTED = (
    "openjev_worker_state_cache_hits_total",
    "openjev_worker_state_cache_hit_tokens_total",
    "openjev_worker_submitted_tokens_total",
    "openjev_worker_computed_tokens_total",
    "openjev_worker_queue_seconds_count",
)
