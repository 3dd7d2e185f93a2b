"""Streaming candidate batches and the tokenization check (the contract's last message)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from openjev.contract import errors
from openjev.contract.errors import ContractError
from openjev.contract.request import parse_request
from openjev.frontend.batches import (
    EXPRESS_CHARS,
    EncodeLanes,
    TokenizedCandidate,
    is_express,
    iter_candidate_batches,
    tokenize_request,
)
from openjev.frontend.turns import Abandoned, Turns

GOLDEN = json.loads((Path(__file__).parents[1] / "contract" / "data" / "tokenization_cases.json").read_text())
ACCEPTED = {"Qwen/Qwen3.8-27B", "open-jev-27b-v1.1"}


def golden_request(index: int = 0):
    return parse_request(GOLDEN["cases"][index]["request"], accepted_models=ACCEPTED)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 7, 16])
def test_batches_cover_every_candidate_in_order(tokenizer, batch_size):
    request = golden_request()  # 3 + 1 + 3 candidates
    batches = list(iter_candidate_batches(request, tokenizer, 16384, batch_size))
    assert all(1 <= len(batch) <= batch_size for batch in batches)
    assert all(len(batch) == batch_size for batch in batches[:-1])
    flat = [candidate for batch in batches for candidate in batch]
    assert [(c.question_index, c.candidate_index) for c in flat] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    ids = GOLDEN["cases"][0]["ids"]
    assert all(list(c.token_ids) == ids[c.question_index][c.candidate_index] for c in flat)
    assert all(isinstance(c, TokenizedCandidate) for c in flat)


def test_tokenize_request_matches_the_golden_ids(tokenizer):
    for index, case in enumerate(GOLDEN["cases"]):
        assert tokenize_request(golden_request(index), tokenizer, 16384) == case["ids"]


def test_batches_are_yielded_before_the_rest_is_tokenized(tokenizer):
    request = golden_request()
    calls = []
    encode = tokenizer.encode

    class Counting:
        surely_too_long = tokenizer.surely_too_long

        def encode(self, prompts):
            calls.append(len(prompts))
            return encode(prompts)

    stream = iter_candidate_batches(request, Counting(), 16384, batch_size=2)
    first = next(stream)
    assert len(first) == 2 and calls == [2]
    assert sum(len(batch) for batch in stream) == 5 and calls == [2, 2, 2, 1]


def test_too_long_candidate_is_an_error_never_truncated(tokenizer):
    request = golden_request()
    lengths = [[len(ids) for ids in question] for question in GOLDEN["cases"][0]["ids"]]
    assert lengths == [[80, 76, 77], [66], [82, 80, 78]]
    with pytest.raises(ContractError) as caught:
        list(iter_candidate_batches(request, tokenizer, 79))
    assert caught.value.message == ("question route: 80 tokens exceeds max_length=79; no silent truncation")
    assert caught.value.message == errors.too_long_message("route", 80, 79)
    assert (
        errors.too_long_message("x" * 300, 80, 79)
        == f"question {'x' * 256}...: 80 tokens exceeds max_length=79; no silent truncation"
    )
    assert len(tokenize_request(request, tokenizer, 82)[2][0]) == 82  # exactly max_length is fine


def test_first_too_long_candidate_in_order_is_reported(tokenizer):
    request = golden_request()
    # Only urgency's first candidate (82 tokens) is over 81; earlier batches were yielded.
    stream = iter_candidate_batches(request, tokenizer, 81, batch_size=2)
    assert len(next(stream)) == 2 and len(next(stream)) == 2
    with pytest.raises(ContractError) as caught:
        next(stream)
    assert caught.value.message == ("question urgency: 82 tokens exceeds max_length=81; no silent truncation")


def test_nothing_is_returned_for_a_too_long_request(tokenizer):
    with pytest.raises(ContractError):
        tokenize_request(golden_request(), tokenizer, 81)


def test_invalid_arguments(tokenizer):
    # match: a ContractError is a ValueError too, and a max_length of 0 makes every prompt too long
    with pytest.raises(ValueError, match="^batch_size must be positive$"):
        next(iter_candidate_batches(golden_request(), tokenizer, 16384, batch_size=0))
    with pytest.raises(ValueError, match="^max_length must be positive$"):
        next(iter_candidate_batches(golden_request(), tokenizer, 0))


class Recorder:
    """An encode that records who ran, how many ran at once, and holds "held" prompts until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running: list[str] = []
        self.order: list[str] = []
        self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, prompts: list[str]) -> list[list[int]]:
        with self.lock:
            self.running.append(prompts[0])
            self.order.append(prompts[0])
            self.peak = max(self.peak, len(self.running))
        if prompts[0].startswith("held"):
            self.release.wait(10)
        with self.lock:
            self.running.remove(prompts[0])
        return [[len(p)] for p in prompts]


def run_through(gate: Turns, recorder: Recorder, first: list[str], then: list[str]) -> None:
    """`first` take the slots and hold them; `then` arrive one by one and must wait."""
    threads = []
    for name in [*first, *then]:
        threads.append(threading.Thread(target=gate, args=([name],)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while name in first and name not in recorder.running and time.monotonic() < deadline:
            time.sleep(0.005)
        if name in then:
            time.sleep(0.05)
    assert recorder.order == first
    recorder.release.set()
    for thread in threads:
        thread.join(10)


def test_encode_gate_lets_waiters_in_in_arrival_order():
    recorder = Recorder()
    gate = Turns(recorder, 1, "tokenized")
    run_through(gate, recorder, ["held"], ["w1", "w2", "w3"])
    assert recorder.order == ["held", "w1", "w2", "w3"]
    assert recorder.peak == 1


def test_encode_gate_runs_at_most_its_slots_at_once():
    recorder = Recorder()
    gate = Turns(recorder, 2, "tokenized")
    run_through(gate, recorder, ["held-a", "held-b"], ["held-c", "held-d", "held-e"])
    assert sorted(recorder.order) == ["held-a", "held-b", "held-c", "held-d", "held-e"]
    assert recorder.peak == 2
    assert gate(["abc"]) == [[3]]  # every slot came back


def test_encode_gate_passes_on_errors_and_frees_the_slot():
    def fail(prompts: list[str]) -> list[list[int]]:
        raise ValueError("bad")

    gate = Turns(fail, 1, "tokenized")
    for _ in range(2):
        with pytest.raises(ValueError):
            gate(["x"])


def test_a_batch_whose_client_left_while_waiting_is_not_encoded():
    """Its turn comes after the client has gone (a cancelled request's batches once took their
    turns, holding a later request 19 s instead of 3.7): Abandoned, the encoder not run, and the
    slot passed on to the next waiter."""
    recorder = Recorder()
    gate = Turns(recorder, 1, "tokenized")
    outcomes: dict[str, object] = {}

    def send(name: str, wanted) -> None:
        try:
            outcomes[name] = gate([name], wanted)
        except Abandoned as error:
            outcomes[name] = error

    holder = threading.Thread(target=send, args=("held", None))
    holder.start()
    deadline = time.monotonic() + 5
    while "held" not in recorder.running and time.monotonic() < deadline:
        time.sleep(0.005)
    gone, after = (threading.Thread(target=send, args=(n, w)) for n, w in (("gone", lambda: False), ("next", None)))
    gone.start()
    time.sleep(0.05)
    after.start()
    time.sleep(0.05)
    recorder.release.set()
    for thread in (holder, gone, after):
        thread.join(10)
    assert isinstance(outcomes["gone"], Abandoned) and "went away" in str(outcomes["gone"])
    assert recorder.order == ["held", "next"] and outcomes["next"] == [[4]]
    assert gate(["abc"], lambda: True) == [[3]]  # the slot came back


def test_small_batches_pass_large_ones_that_hold_every_slot():
    """Two batches of megabytes hold the large lane's slots; a small batch is encoded at once
    in the express lane, and a third large one waits its turn."""
    recorder = Recorder()
    lanes = EncodeLanes(recorder, slots=2)
    large = "held" + "x" * EXPRESS_CHARS
    holders = [threading.Thread(target=lanes, args=([large + str(i)],)) for i in range(3)]
    for thread in holders:
        thread.start()
    deadline = time.monotonic() + 5
    while len(recorder.running) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        assert lanes(["small"]) == [[5]]  # returns while both large slots are held
        assert len(recorder.running) == 2  # the third large batch still waits
    finally:
        recorder.release.set()
        for thread in holders:
            thread.join(10)
    assert recorder.peak == 3 and len(recorder.order) == 4


def test_candidates_over_one_state_take_the_express_lane_by_what_is_encoded():
    """16 candidates over a 20 KB state are 320 KB of prompts but about 20 KB of encoding (the
    state's pieces are encoded once): the express lane, while both large slots are held. They
    were measured by the sum and queued behind the megabyte requests."""
    recorder = Recorder()
    lanes = EncodeLanes(recorder, slots=2)
    large = "held" + "x" * EXPRESS_CHARS
    holders = [threading.Thread(target=lanes, args=([large + str(i)],)) for i in range(2)]
    state = "Context:\n" + "a line of the state\n" * 1000
    candidates = [f"{state}Proposed answer: option {i}" for i in range(16)]
    answered: list = []
    for thread in holders:
        thread.start()
    try:
        deadline = time.monotonic() + 5
        while len(recorder.running) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        small = threading.Thread(target=lambda: answered.append(lanes(candidates)))
        small.start()
        small.join(5)
        assert answered == [[[len(c)] for c in candidates]]  # returned while both large slots are held
        assert not is_express([state + "x" * EXPRESS_CHARS, state + "y"])  # what is fresh still counts
        assert is_express(["abc", "abd"]) and is_express([])
    finally:
        recorder.release.set()
        for thread in holders:
            thread.join(10)


def test_a_large_batch_is_encoded_a_candidate_at_a_time_and_refused_at_the_first_too_long(tokenizer):
    """A batch of large prompts is encoded candidate by candidate, each checked before the next:
    the first one over max_length ends the request with one prompt encoded, not 16 (a refused
    33 MB request raised the frontend's peak memory from 0.4 to 2.5 GiB)."""
    criteria = {f"c{i}": f"option {i}" for i in range(16)}
    request = _request({"q": {"type": "choice", "instructions": "word\n" * 14000, "criteria": criteria}})
    encoded: list[int] = []

    def encode(prompts):
        encoded.append(len(prompts))
        return tokenizer.encode(prompts)

    with pytest.raises(ContractError) as caught:
        list(iter_candidate_batches(request, tokenizer, 1000, encode=encode))
    assert "tokens exceeds max_length=1000" in caught.value.message
    assert encoded == [1]
    # the same candidates within max_length: every one encoded, ids as the whole batch's
    ids = [c.token_ids for batch in iter_candidate_batches(request, tokenizer, 100_000, encode=encode) for c in batch]
    assert encoded[1:] == [1] * 16 and ids == tokenizer.encode(list(request.questions[0].prompts))


def _request(questions: dict):
    return parse_request({"state": "A short state.", "questions": questions}, accepted_models=ACCEPTED)


def test_a_prompt_too_long_to_tokenize_is_refused_by_its_bytes(tokenizer):
    """A prompt whose bytes alone exceed max_length times the longest token's is refused without
    being encoded (a 60 MB one took the tokenizer 100 s and 14 GB of memory to count)."""
    assert tokenizer.max_token_bytes == 128
    huge = {"q": {"type": "noul", "instructions": "word " * 4000}}
    encoded: list[int] = []

    def encode(prompts):
        encoded.extend(len(p) for p in prompts)
        return tokenizer.encode(prompts)

    with pytest.raises(ContractError) as caught:
        list(iter_candidate_batches(_request(huge), tokenizer, 100, encode=encode))
    assert (
        caught.value.message.startswith("question q: ")
        and "bytes of prompt, more tokens than max_length=100" in caught.value.message
    )
    assert encoded == []
    # an earlier candidate over max_length by its count is still the one reported
    both = {"first": {"type": "noul", "instructions": " ".join(f"w{i}" for i in range(200))}, **huge}
    with pytest.raises(ContractError) as caught:
        tokenize_request(_request(both), tokenizer, 100)
    assert (
        caught.value.message.startswith("question first: ") and "tokens exceeds max_length=100" in caught.value.message
    )


def test_a_waiter_whose_call_ends_leaves_the_queue_before_its_turn():
    """A call that ended while it waited (client gone, deadline passed) once stayed parked until
    its turn, holding a server thread after gRPC had freed its call slot: 33 such calls behind
    one slow parse made health RESOURCE_EXHAUSTED (a review, 2026-12-04). It now leaves within
    RECHECK_SECONDS, and the waiters behind it keep their order."""
    from openjev.frontend.turns import RECHECK_SECONDS

    recorder = Recorder()
    gate = Turns(recorder, 1, "tokenized")
    live = threading.Event()
    live.set()
    outcomes: dict[str, object] = {}
    ended: dict[str, float] = {}

    def send(name: str, wanted) -> None:
        try:
            outcomes[name] = gate([name], wanted)
        except Abandoned as error:
            outcomes[name] = error
        ended[name] = time.monotonic()

    threads = [threading.Thread(target=send, args=("held", None))]
    threads[0].start()
    deadline = time.monotonic() + 5
    while "held" not in recorder.running and time.monotonic() < deadline:
        time.sleep(0.005)
    for name, wanted in (("leaving", live.is_set), ("next", None)):
        threads.append(threading.Thread(target=send, args=(name, wanted)))
        threads[-1].start()
        time.sleep(0.05)
    left_at = time.monotonic()
    live.clear()
    threads[1].join(5)
    assert isinstance(outcomes["leaving"], Abandoned) and "went away" in str(outcomes["leaving"])
    assert ended["leaving"] - left_at < RECHECK_SECONDS + 1.0
    assert recorder.running == ["held"] and "next" not in outcomes  # the holder still runs
    recorder.release.set()
    for thread in threads:
        thread.join(10)
    assert recorder.order == ["held", "next"] and outcomes["next"] == [[4]]
    assert gate(["abc"], lambda: True) == [[3]]  # the slot came back
