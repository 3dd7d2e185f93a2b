"""A refused or failed request leaves nothing of itself for the cycle collector: its frames, its
body and its messages are freed when its caller lets go of the error. An error held by a local of
a frame in its own traceback (or grpc's call object, which raises itself) once kept every frame of
the request, and the request with them, until a full collection: a soak's frontend grew 160 MiB
on refused 4 MiB bodies (2026-12-05). The frontend's decide path runs here in process, as the HTTP
route runs it, in front of a real worker on loopback."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from fake_worker import FailsPartWay, fake_describe, part_way_body, serve_fake
from garbage import left_in_cycles

from openjev.export import load_export_meta
from openjev.frontend.http.app import HttpCallContext
from openjev.frontend.service import DecisionServicer, Refused
from openjev.frontend.worker_link import WorkerLink
from openjev.tokenizer import PromptTokenizer
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api

FRONTEND = Path(DecisionServicer.__module__.replace(".", "/")).parent.name  # "frontend"
MAX_REQUEST_TOKENS = 2000


def _choice(state: str, candidates: int) -> str:
    criteria = {f"option {i}": None for i in range(candidates)}
    return json.dumps(
        {"state": state, "questions": {"q": {"type": "choice", "instructions": "Pick", "criteria": criteria}}}
    )


REFUSED = {
    # more than one batch of candidates: the Execute stream, cut off part-way by the token limit
    "stream over the token limit": (_choice("word " * 150, 20), {}, "INVALID_ARGUMENT"),
    # one batch: ExecuteUnary, refused while tokenizing
    "unary over the token limit": (_choice("word " * 300, 12), {}, "INVALID_ARGUMENT"),
    # a body over the size parsed in a child process, refused there
    "large body refused by its parser": (
        json.dumps({"state": "x" * (1 << 20), "questions": {}}),
        {},
        "INVALID_ARGUMENT",
    ),
    # the worker call's deadline (this frontend's cap) passes: grpc's error is the call itself
    "worker stream past its deadline": (_choice("word " * 40, 20), {"worker_seconds": 0.001}, "DEADLINE_EXCEEDED"),
    "worker unary call past its deadline": (_choice("word " * 40, 3), {"worker_seconds": 0.001}, "DEADLINE_EXCEEDED"),
}


@contextlib.contextmanager
def _servicer(demo_model, address: str):
    """A DecisionServicer in this process, linked to the worker at `address`, once SERVING."""
    meta = load_export_meta(demo_model)
    tokenizer = PromptTokenizer.from_export(demo_model)
    link = WorkerLink(
        address,
        fingerprint=tokenizer.fingerprint,
        max_length=meta.max_length,
        model_id=meta.model_id,
        temperature=meta.temperature,
        max_request_tokens=MAX_REQUEST_TOKENS,
    )
    link.start()
    made = DecisionServicer(meta, tokenizer, link, max_request_tokens=MAX_REQUEST_TOKENS)
    try:
        deadline = time.monotonic() + 30
        while link.state.problem is not None:
            assert time.monotonic() < deadline, link.state.problem
            time.sleep(0.05)
        yield made
    finally:
        made.close()
        link.close()


@pytest.fixture(scope="module")
def servicer(demo_model, tmp_path_factory):
    worker = launch.start_worker(demo_model, tmp_path_factory.mktemp("worker"))
    try:
        with _servicer(demo_model, worker.address) as made:
            yield made
    finally:
        worker.stop()


def _refused(servicer: DecisionServicer, body: str) -> str:
    context = HttpCallContext("cycles", None)
    try:
        servicer.answer(api.DecideRequest(request_json=body), context, "cycles", {})
    except Refused as refused:
        return refused.code.name
    raise AssertionError("answered")


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_request_leaves_no_cycle(servicer, case, monkeypatch):
    body, options, code = REFUSED[case]
    if "worker_seconds" in options:
        monkeypatch.setattr(servicer, "worker_deadline_seconds", options["worker_seconds"])

    def refused() -> None:
        assert _refused(servicer, body) == code

    ours = left_in_cycles(refused, lambda frame: Path(frame.f_code.co_filename).parent.name == FRONTEND)
    assert ours == ([], [])


# a worker that fails the stream after its first batch: the frontend then checks the candidates
# it had not tokenized yet (valid, or over the token limit)
PART_WAY = {
    "valid request, the worker's refusal": (part_way_body("word " * 300, "word " * 40), "RESOURCE_EXHAUSTED"),
    "over the token limit after the worker's refusal": (
        part_way_body("word " * 1500, "word " * 40),
        "INVALID_ARGUMENT",
    ),
}


@pytest.mark.parametrize("case", PART_WAY)
def test_a_request_whose_worker_failed_part_way_leaves_no_cycle(demo_model, case):
    body, code = PART_WAY[case]
    server, port = serve_fake(FailsPartWay(fake_describe(demo_model)))
    try:
        with _servicer(demo_model, f"127.0.0.1:{port}") as made:

            def refused() -> None:
                assert _refused(made, body) == code

            ours = left_in_cycles(refused, lambda frame: Path(frame.f_code.co_filename).parent.name == FRONTEND)
        assert ours == ([], [])
    finally:
        server.stop(0)
