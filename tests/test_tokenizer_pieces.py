"""Piecewise tokenization (openjev.pieces) gives the ids of whole-text encoding, bit for bit, and
is used only for the tokenizer configuration its cut is proven for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX
from openjev.contract.request import parse_request
from openjev.pieces import CUT, PieceEncoder, split_at_cuts
from openjev.tokenizer import PromptTokenizer

WORKLOAD = Path(__file__).parents[1] / "benchmarks" / "workload.jsonl"
# what the cut's proof turns on: line feeds and other whitespace (Unicode and ASCII controls that
# str.isspace() and the regex may see differently), combining marks after a line feed, letters
# and digits either side, contractions, punctuation runs before newlines, specials, CJK, emoji
PARTS = [
    "\n", "\n\n", "\r\n", "\r", " ", "  ", "\t", " \n", "\u00a0", "\u0085", "\u2028", "\u3000", "\x1c", "\x0b",
    "a", "Zeta", "é", "e\u0301", "\u0301", "\u0308x", "1", "2024", ".", "?!", "-", "'s", "'LL", "'",
    "<|im_start|>", "<|im_end|>", "<think>", "人力资源管理", "😀", "\u200b", "{", "}", '"',
]  # fmt: skip


def whole(tokenizer: PromptTokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)]


def test_the_project_tokenizer_is_encoded_piecewise(prompt_tokenizer):
    assert prompt_tokenizer.pieces is not None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(PARTS), max_size=40).map("".join), min_size=1, max_size=4))
def test_random_texts_match_whole_encoding(prompt_tokenizer, texts):
    pieces = PieceEncoder(lambda batch: whole(prompt_tokenizer, batch))
    assert pieces.encode(texts) == whole(prompt_tokenizer, texts)
    assert pieces.encode(texts) == whole(prompt_tokenizer, texts)  # now from the memo


def test_cuts_fall_only_after_a_line_feed_before_non_space():
    text = "a\nb\n \nc\n\n\u00a0d\n\u0301e\r\nf"
    cuts = [m.start() for m in CUT.finditer(text)]
    assert [text[c - 1 : c + 1] for c in cuts] == ["\nb", "\nc", "\n\u0301", "\nf"]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(PARTS), max_size=60).map("".join))
def test_the_fast_split_cuts_where_the_cut_pattern_does(text):
    assert split_at_cuts(text) == CUT.split(text)


def test_workload_prompts_match_whole_encoding(prompt_tokenizer):
    lines = WORKLOAD.read_text().splitlines()
    prompts = []
    for line in lines[:: max(1, len(lines) // 40)]:
        request = parse_request(json.loads(line)["request"], accepted_models=())
        prompts += [p for q in request.questions for p in q.prompts]
    wrapped = [DEFAULT_CHAT_PREFIX + p + DEFAULT_CHAT_SUFFIX for p in prompts]
    assert prompt_tokenizer.encode(prompts) == whole(prompt_tokenizer, wrapped)
    encoded: list[str] = []
    pieces = PieceEncoder(lambda batch: encoded.extend(batch) or whole(prompt_tokenizer, batch))
    assert pieces.encode(wrapped) == whole(prompt_tokenizer, wrapped)
    # candidates share their state's and question's pieces: each is encoded once
    assert sum(map(len, encoded)) < sum(map(len, wrapped)) / 2
    encoded.clear()
    assert pieces.encode(wrapped) == whole(prompt_tokenizer, wrapped) and not encoded  # all from the memo


def test_the_memo_stays_inside_its_budget(prompt_tokenizer):
    pieces = PieceEncoder(lambda batch: whole(prompt_tokenizer, batch), max_bytes=2000)
    texts = [f"line {i}\n" * 3 + f"tail {i}" for i in range(50)]
    assert pieces.encode(texts) == whole(prompt_tokenizer, texts)
    assert 0 < pieces.nbytes <= 2000 and 5 < len(pieces._memo) < 100


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+|\S+"),
        lambda d: d.update(normalizer={"type": "NFKC"}),
        lambda d: d["added_tokens"].append({**d["added_tokens"][0], "id": 999_999, "content": "<|a\nb|>"}),
        lambda d: d["added_tokens"][0].update(lstrip=True),
    ],
)
def test_other_tokenizer_configurations_are_encoded_whole(tokenizer_json, tmp_path, change):
    document = json.loads(tokenizer_json.read_text())
    change(document)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    # still a valid file (PromptTokenizer builds it), whose pieces are not the proven configuration
    assert PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX).pieces is None


def test_every_character_after_a_line_feed(prompt_tokenizer):
    """Each code point below U+3100 (and a few above) right after a cut, with letters, spaces,
    punctuation and a combining mark around it: what a regex or normalizer disagreement with
    str.isspace() would break."""
    chars = [chr(c) for c in range(0x3100) if not 0xD800 <= c < 0xE000] + ["\u180e", "\ufeff", "\U0001f600"]
    texts = [pre + c + post for c in chars for pre, post in (("a\n", "b"), ("x.\n", " \u0301"))]
    pieces = PieceEncoder(lambda batch: whole(prompt_tokenizer, batch))
    assert pieces.encode(texts) == whole(prompt_tokenizer, texts)
