"""Total work per request is bounded and refused early; integers of any length are exact.

Seen before: a 5 MB state with 16 options was refused only after 53 s (tokenized once per
candidate on the serving threads) while a small request waited 47.9 s; a 0.95 MB body with
65,535 candidates cost 2.5 GB in the frontend before tokenization started (one rendered copy of
the state per candidate); 18.2 M submitted tokens took 66 s of worker time."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from openjev.client import Client
from openjev.contract import errors
from openjev.contract.errors import ContractError
from openjev.contract.render import dumps_exact
from openjev.contract.request import parse_request_json
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api

SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}


def _choice(state, n: int) -> dict:
    criteria = dict.fromkeys(map(str, range(n)))
    return {"state": state, "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": criteria}}}


def test_compiled_request_holds_one_copy_of_the_state():
    state = "x" * 100_000
    body = json.dumps(
        {
            "state": state,
            "questions": {
                f"q{i}": {"type": "choice", "instructions": "pick", "criteria": dict.fromkeys(map(str, range(255)))}
                for i in range(16)
            },
        }
    )
    tracemalloc.start()
    request = parse_request_json(body, accepted_models=())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert request.num_candidates == 16 * 255
    assert peak < 8 * 1024 * 1024, f"{peak} bytes: one state copy per candidate would be {4080 * 100_000}"
    assert request.questions[3].prompts[7] == f"Context:\n{state}\n\nQuestion: pick\nProposed answer: 7\n" + (
        "Is this proposed answer correct? Answer Yes or No."
    )
    assert request.rendered_bytes == sum(len(p.encode()) for q in request.questions for p in q.prompts)


def test_rendered_size_limit_is_checked_after_the_contract_checks():
    body = _choice("é" * 1000, 3)
    assert parse_request_json(json.dumps(body), accepted_models=(), max_rendered_bytes=10_000).num_candidates == 3
    with pytest.raises(ContractError) as caught:
        parse_request_json(json.dumps(body), accepted_models=(), max_rendered_bytes=5_000)
    assert caught.value.message == errors.RENDERED_LIMIT
    body["model"] = "other"  # a request the reference refuses keeps the reference's message
    with pytest.raises(ContractError) as caught:
        parse_request_json(json.dumps(body), accepted_models=(), max_rendered_bytes=5_000)
    assert caught.value.message == errors.MODEL_NOT_LOADED


def test_large_state_is_refused_at_once_and_does_not_stall_others(pair):
    big = _choice("word " * 1_000_000, 16)  # 5 MB state, 16 candidates: 80 MB rendered
    with Client(pair.frontend.address) as client:
        small_times = []

        def small():
            started = time.monotonic()
            client.decide(SMALL, timeout=30)
            small_times.append(time.monotonic() - started)

        thread = threading.Thread(target=small)
        started = time.monotonic()
        thread.start()
        with pytest.raises(grpc.RpcError) as caught:
            client.stub.Decide(api.DecideRequest(request_json=json.dumps(big)), timeout=30)
        refused_after = time.monotonic() - started
        thread.join(30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "request exceeds the rendered size limit"
    assert refused_after < 3.0
    assert small_times and small_times[0] < 5.0


def test_token_limit_refuses_before_the_worker_runs(demo_model, pair, tmp_path):
    frontend = launch.start_frontend(demo_model, pair.worker.address, tmp_path, ["--max-request-tokens", "2500"])
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as client:
            fits = client.decide(_choice("word " * 1000, 2), timeout=60)  # ~2 x 1,030 tokens
            assert fits["usage"]["input_tokens"] <= 2500
            with pytest.raises(grpc.RpcError) as caught:
                client.decide(_choice("word " * 1000, 3), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "request exceeds the token limit"
    finally:
        frontend.stop()


def test_integers_of_any_length_are_rendered_exactly(client):
    digits = "9" * 5000 + "1"  # beyond Python's 4,300-digit int <-> str limit
    body = (
        '{"state": {"n": -' + digits + '}, "questions": {"s": {"type": "score", "instructions": "how big?", '
        '"criteria": [{"n": 0}, {"n": 1}]}}}'
    )
    request = parse_request_json(body, accepted_models=())
    assert request.questions[0].prompts[0].startswith('Context:\n{"n": -' + digits + "}\n")
    legend_body = body.replace('[{"n": 0}', '[{"n": ' + digits + "}", 1)
    reply = client.stub.Decide(api.DecideRequest(request_json=legend_body), timeout=60)
    assert list(reply.answers[0].score.legend_json) == ['{"n": ' + digits + "}", '{"n": 1}']
    # the client's contract JSON (what `openjev decide` and the HTTP route print) keeps the digits
    response = client.decide(legend_body, timeout=60)
    assert (
        dumps_exact(response["answers"]["s"]["legend"], sort_keys=False)
        == '{"0": {"n": ' + digits + '}, "1": {"n": 1}}'
    )


def test_large_bodies_are_parsed_one_at_a_time_in_a_child(demo_model, tmp_path):
    """JSON of empty arrays builds ~30 times its size in Python objects while it is parsed (57 MiB
    took 1.6 GB); four such bodies at once took ~4.7 times one's peak memory in the frontend.
    Bodies over 1 MiB take turns (`--large-body-parses 1`): four at once cost about what one
    does, and each is still refused. Since 2026-12-05 the parse runs in a child process: the
    frontend's own peak grows by a fraction of it (the bodies it holds). The child is the small
    `parse_child` entry: a multiprocessing child imported the frontend's main module (gRPC among
    it) and came with spawn's resource tracker, ~60 MiB idle where it is ~20 now."""
    from openjev.tools.soak import child_pids, rss_bytes

    body = json.dumps({"state": [[] for _ in range(3_000_000)], "questions": SMALL["questions"]})
    pair = launch.start_pair(demo_model, tmp_path)
    try:
        pid = pair.frontend.popen.pid
        with Client(pair.frontend.address) as client:
            client.stub.Decide(api.DecideRequest(request_json=json.dumps(SMALL)), timeout=60)

            def send(_: int) -> grpc.StatusCode:
                with pytest.raises(grpc.RpcError) as refused:
                    client.stub.Decide(api.DecideRequest(request_json=body), timeout=300)
                assert "bytes of prompt, more tokens than max_length" in refused.value.details()
                return refused.value.code()

            def peaks() -> tuple[int, int]:
                """The frontend's peak, and its children's summed."""
                return rss_bytes(pid, "VmHWM"), sum(rss_bytes(child, "VmHWM") for child in child_pids(pid))

            start = rss_bytes(pid, "VmHWM")
            assert send(0) == grpc.StatusCode.INVALID_ARGUMENT
            own_one, children_one = peaks()
            with futures.ThreadPoolExecutor(4) as pool:
                assert set(pool.map(send, range(4))) == {grpc.StatusCode.INVALID_ARGUMENT}
            own_four, children_four = peaks()
            [child] = child_pids(pid)
            assert b"openjev.frontend.parse_child" in Path(f"/proc/{child}/cmdline").read_bytes()
            assert "cygrpc" not in Path(f"/proc/{child}/maps").read_text()  # gRPC was never imported there
    finally:
        pair.stop()
    one, four = own_one - start + children_one, own_four - start + children_four
    assert children_one > 100 << 20, "the body builds hundreds of MiB, or this test measures nothing"
    assert own_one - start < children_one / 3, (own_one - start, children_one)
    assert four < 3 * one, f"four bodies at once took the peak {four >> 20} MiB up, one alone {one >> 20} MiB"


def test_a_small_request_does_not_wait_for_a_large_parse(pair):
    """A 23 MiB body of empty arrays parses for seconds holding the GIL; in the frontend's own
    process a small request sent meanwhile waited for the parse to end (2-3 s, docs/reliability.md).
    In a child process it does not."""
    body = json.dumps({"state": [[] for _ in range(6_000_000)], "questions": SMALL["questions"]})
    with Client(pair.frontend.address) as client:

        def large() -> float:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.stub.Decide(api.DecideRequest(request_json=body), timeout=300)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return time.monotonic() - started

        alone = large()  # also starts the parsing child
        with futures.ThreadPoolExecutor(1) as pool:
            beside = pool.submit(large)
            time.sleep(alone / 3)  # the body is sent and its parse under way
            started = time.monotonic()
            client.decide(SMALL, timeout=60)
            small = time.monotonic() - started
            beside.result()
    assert alone > 0.5, "the parse is too short for this test to see a wait"
    assert small < alone / 4, f"a small request took {small:.2f} s beside a {alone:.2f} s large one"
