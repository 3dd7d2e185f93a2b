"""Large bodies parsed in child processes (`frontend/parsing.py`): real spawned children, the
contract's own parser; faults are real kills of those children."""

from __future__ import annotations

import functools
import json
import operator
import os
import signal
import threading
import time

import pytest
from garbage import left_in_cycles

from openjev.contract.errors import ContractError
from openjev.contract.request import parse_request_json
from openjev.frontend.parsing import PARSE_FAILED, SHUTTING_DOWN, BodyParsers, ParseFailed
from openjev.frontend.turns import Abandoned

PARSE = functools.partial(
    parse_request_json,
    accepted_models=frozenset({"open-jev"}),
    max_questions=16,
    max_candidates=64,
    max_rendered_bytes=1 << 28,
    chat_template_bytes=100,
)
QUESTIONS = {"q": {"type": "choice", "instructions": "pick", "criteria": {"a": None, "b": "the second"}}}
# ~1 s of parsing on a CI core: long enough to act on the child meanwhile
SLOW = json.dumps({"state": [[] for _ in range(3_000_000)], "questions": QUESTIONS})


@pytest.fixture
def parsers():
    made = BodyParsers(PARSE)
    yield made
    made.close()


def _busy(parsers: BodyParsers, body: str, **kw) -> tuple[threading.Thread, dict]:
    """`body` parsed on a thread; returns once its child has it."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = parsers(body, **kw)
        except Exception as error:  # what the caller would see
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not parsers.children():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # the body is sent and being parsed
    return thread, outcome


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped counts as gone
        return stat.read().split(") ")[1].startswith("Z")


def test_a_body_parses_in_a_child_as_in_the_frontend(parsers):
    bodies = [
        json.dumps({"state": {"n": 10**40, "s": "\u00e9t\u00e9"}, "questions": QUESTIONS}),
        json.dumps({"state": [[1, 2.5, None, True]], "questions": QUESTIONS, "model": "open-jev"}),
        "{",
        "[]",
        json.dumps({"state": "x", "questions": QUESTIONS, "model": "other"}),
        json.dumps({"state": "x", "questions": {f"q{i}": QUESTIONS["q"] for i in range(17)}}),
    ]
    answered = 0
    for body in bodies:
        try:
            expected = PARSE(body)
        except ContractError as error:
            with pytest.raises(ContractError) as caught:
                parsers(body)
            assert caught.value.message == error.message
        else:
            assert parsers(body) == expected
            answered += 1
    assert answered == 2
    assert len(parsers.children()) == 1  # one child, kept between calls


def test_a_refused_body_is_freed_without_the_cycle_collector(parsers):
    """The child's error, raised from a local, once held the frame of its own traceback: every
    refused large body, and the frames above it, waited for a full collection (a soak's frontend
    grew 160 MiB on 4 MiB bodies, 2026-12-05). Now nothing of the call is left for the collector."""
    body = json.dumps({"state": "x", "questions": QUESTIONS, "model": "other"})

    def refused() -> None:
        with pytest.raises(ContractError):
            parsers(body)

    assert left_in_cycles(refused) == ([], [])


def test_a_child_killed_while_parsing_fails_that_request_only(parsers):
    thread, outcome = _busy(parsers, SLOW)
    [pid] = parsers.children()
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert isinstance(outcome.get("error"), ParseFailed) and str(outcome["error"]) == PARSE_FAILED
    body = json.dumps({"state": "s", "questions": QUESTIONS})
    assert parsers(body) == PARSE(body)
    assert parsers.children() != [pid]


def test_a_request_no_longer_wanted_stops_its_child(parsers):
    wanted = threading.Event()
    wanted.set()
    thread, outcome = _busy(parsers, SLOW, wanted=wanted.is_set)
    [pid] = parsers.children()
    wanted.clear()
    left = time.monotonic()
    thread.join(30)
    assert isinstance(outcome.get("error"), Abandoned)
    assert time.monotonic() - left < 5  # a recheck and the child's kill (loose: CI's loaded cores)
    assert _gone(pid) and parsers.children() == []


def test_close_stops_busy_children_and_refuses_more(parsers):
    """Their callers are told the frontend is stopping (UNAVAILABLE in the servicer), not that a
    child ran out of memory."""
    thread, outcome = _busy(parsers, SLOW)
    [pid] = parsers.children()
    parsers.close()
    thread.join(30)
    error = outcome.get("error")
    assert isinstance(error, ParseFailed) and error.stopping and str(error) == SHUTTING_DOWN
    assert _gone(pid) and parsers.children() == []
    with pytest.raises(ParseFailed) as caught:
        parsers(json.dumps({"state": "s", "questions": QUESTIONS}))
    assert caught.value.stopping


def test_close_while_a_body_is_being_sent(parsers):
    """close() closed a busy child's pipe under the thread writing to it: that thread's send
    raised TypeError (a server error, no log line) instead of ParseFailed (a review, 2026-12-05)."""
    parsers(json.dumps({"state": "warm", "questions": QUESTIONS}))
    huge = json.dumps({"state": "x" * (300 << 20), "questions": QUESTIONS})  # seconds in the pipe
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = parsers(huge)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.05)
    parsers.close()
    thread.join(60)
    assert isinstance(outcome.get("error"), ParseFailed) and outcome["error"].stopping, outcome


def test_a_child_that_ended_while_idle_is_replaced_unseen(parsers):
    """An idle child that died (killed by an operator or the kernel) failed the next, unrelated
    request (a review, 2026-12-05); it is replaced before the body is sent. A TERM sent to the
    whole process group leaves children alone: the frontend decides when they end."""
    body = json.dumps({"state": "s", "questions": QUESTIONS})
    parsers(body)
    [pid] = parsers.children()
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    assert not _gone(pid) and parsers(body) == PARSE(body) and parsers.children() == [pid]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert parsers(body) == PARSE(body)
    assert len(parsers.children()) == 1 and parsers.children() != [pid]


def test_a_child_out_of_memory_is_parse_failed_not_stopping():
    """A MemoryError in the child (the fault: a parse that asks for 2 EiB) is PARSE_FAILED, the
    request's own failure (RESOURCE_EXHAUSTED), not a MemoryError and not the frontend stopping."""
    parsers = BodyParsers(functools.partial(operator.mul, 1 << 60))
    try:
        with pytest.raises(ParseFailed) as caught:
            parsers("ab")
        assert str(caught.value) == PARSE_FAILED and not caught.value.stopping
    finally:
        parsers.close()


def test_close_stops_idle_children():
    parsers = BodyParsers(PARSE)
    body = json.dumps({"state": "s", "questions": QUESTIONS})
    assert parsers(body) == PARSE(body)
    [pid] = parsers.children()
    parsers.close()
    assert parsers.children() == []
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
