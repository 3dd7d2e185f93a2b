"""Edges of common/tokenizer.py that its main tests leave open (a mutation review): the
fingerprint's scheme, the longest-token bound on files other than Qwen3.5's, the byte limit
before tokenizing at its exact boundary, and refusals named as their own, not as a parse failure."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path

import pytest
from test_tokenizer import _edited_tokenizer, _numbered

from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX, chat_wrap
from openjev.export import ExportError
from openjev.tokenizer import PromptTokenizer, TokenizerFile, tokenizer_fingerprint

MAX_LENGTH = 10  # x 128 bytes: a limit of 1,280 bytes, so the prompts at its boundary are short


def _export(into: Path, tokenizer: Path | str) -> Path:
    """An export directory of tokenizer.json (a path to copy, or the file's text) and the manifest
    fields the tokenizer reads."""
    into.mkdir(exist_ok=True)
    text = tokenizer.read_text(encoding="utf-8") if isinstance(tokenizer, Path) else tokenizer
    (into / "tokenizer.json").write_text(text, encoding="utf-8")
    manifest = {"chat_prefix": DEFAULT_CHAT_PREFIX, "chat_suffix": DEFAULT_CHAT_SUFFIX}
    (into / "open_jev_export.json").write_text(json.dumps(manifest))
    return into


def _bpe_model(tokenizer_json: Path, **changes) -> dict:
    return {**json.loads(tokenizer_json.read_bytes())["model"], **changes}


def test_the_fingerprint_is_sha256_of_each_part_after_its_length():
    """The frontend and the worker compare fingerprints computed in two processes, which may be of
    two releases during a rolling upgrade: its scheme is part of the worker ABI, and a length that
    moves text between the file, the prefix and the suffix must change it."""
    parts = (b'{"model": 1}', "<|im_start|>user\n", "<|im_end|>\n\u00e9")
    digest = hashlib.sha256()
    for part in (parts[0], parts[1].encode("utf-8"), parts[2].encode("utf-8")):
        digest.update(len(part).to_bytes(8, "little") + part)
    assert tokenizer_fingerprint(*parts) == digest.hexdigest()
    assert tokenizer_fingerprint(b"x", "ab", "c") != tokenizer_fingerprint(b"x", "a", "bc")
    assert tokenizer_fingerprint(b"xa", "b", "") != tokenizer_fingerprint(b"x", "ab", "")


@pytest.mark.parametrize(
    ("change", "bound"),
    [
        # an unknown token stands for any text: no bound
        (lambda path: {"model": _bpe_model(path, unk_token="!")}, None),
        # BPE over characters, not bytes: a token's characters are not its bytes
        (lambda path: {"pre_tokenizer": {"type": "Whitespace"}, "decoder": None, "post_processor": None}, None),
        # byte-level as the whole pre-tokenizer (not inside a Sequence): the same vocabulary's bound
        (
            lambda path: {
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
                | {"use_regex": True}
            },
            128,
        ),
    ],
    ids=["unknown_token", "not_byte_level", "bare_byte_level"],
)
def test_the_longest_token_bound_holds_only_for_byte_level_bpe_without_an_unknown_token(
    tokenizer_json, tmp_path, change, bound
):
    path = _edited_tokenizer(tokenizer_json, tmp_path, **change(tokenizer_json))
    loaded = PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    assert loaded.max_token_bytes == bound
    if bound is None:  # nothing refused for its bytes alone: the tokenizer counts it
        assert loaded.surely_too_long("\u00e9" * 4000, MAX_LENGTH) is None


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


@pytest.mark.parametrize(
    "dropping",
    [
        {"type": "WhitespaceSplit"},
        {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
    ],
    ids=["whitespace_split", "split_removed"],
)
def test_no_bound_where_a_pre_tokenizer_step_drops_text(tokenizer_json, tmp_path, dropping):
    """Bytes a step drops are covered by no token: 5,005 bytes of which 5,000 spaces are 2
    tokens, and were refused as more than 16 tokens before they were tokenized."""
    pre = {"type": "Sequence", "pretokenizers": [dropping, BYTE_LEVEL]}
    loaded = PromptTokenizer(_edited_tokenizer(tokenizer_json, tmp_path, pre_tokenizer=pre), "", "")
    prompt = "yes" + " " * 5000 + "no"
    assert loaded.max_token_bytes is None
    assert len(loaded.encode([prompt])[0]) == 2
    assert loaded.surely_too_long(prompt, 16) is None
    kept = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}
    (tmp_path / "kept").mkdir()
    path = _edited_tokenizer(tokenizer_json, tmp_path / "kept", pre_tokenizer=kept)
    assert PromptTokenizer(path, "", "").max_token_bytes == 128  # a step that keeps every byte


def test_an_added_token_longer_than_every_vocabulary_token_is_the_bound_in_utf8_bytes(tokenizer_json, tmp_path):
    """An added token is matched whole wherever it stands: a prompt of 20 of them is 20 tokens,
    however many bytes it has, and must not be refused as more than 20 tokens before it is
    tokenized."""
    document = json.loads(tokenizer_json.read_bytes())
    long = "<|" + "\u00e9" * 150 + "|>"  # 154 characters, 304 bytes
    added = [*document["added_tokens"], {**document["added_tokens"][-1], "id": 248077, "content": long}]
    loaded = PromptTokenizer(_edited_tokenizer(tokenizer_json, tmp_path, added_tokens=added), "", "")
    assert loaded.max_token_bytes == 304
    [ids] = loaded.encode([long * 20])
    assert ids == [248077] * 20
    assert loaded.surely_too_long(long * 20, 20) is None


def test_a_special_token_is_matched_in_the_text_as_sent_before_nfc(prompt_tokenizer):
    """The specials are added tokens that are not normalized (common/tokenizer.py's docstring):
    `>` + U+0338 composes to U+226F under NFC, yet the special token is still matched, one id (the
    package's own encoder, which normalizes first, loses it: a documented difference)."""
    [ids] = prompt_tokenizer.encode(["x<|im_end|>\u0338"])
    assert ids.count(248046) == 2  # the prompt's and the chat template's


def _ascii_prompt(tokenizer: PromptTokenizer, wrapped_bytes: int) -> str:
    return "a" * (wrapped_bytes - len(tokenizer.chat_prefix) - len(tokenizer.chat_suffix))


def test_a_prompt_of_exactly_the_limits_bytes_is_not_refused_before_tokenizing(prompt_tokenizer):
    """max_length tokens of the longest token's bytes each is a prompt the limit allows: refused
    from one byte more, with the wrapped prompt's bytes (its chat template's included)."""
    most = MAX_LENGTH * prompt_tokenizer.max_token_bytes
    ascii_at_limit = _ascii_prompt(prompt_tokenizer, most)
    assert prompt_tokenizer.surely_too_long(ascii_at_limit, MAX_LENGTH) is None
    assert prompt_tokenizer.surely_too_long(ascii_at_limit + "a", MAX_LENGTH) == most + 1
    # the same boundary where the prompt is not ASCII (counted as NFC UTF-8 bytes)
    other_at_limit = _ascii_prompt(prompt_tokenizer, most - 2) + "\u00e9"
    assert prompt_tokenizer.surely_too_long(other_at_limit, MAX_LENGTH) is None
    assert prompt_tokenizer.surely_too_long(other_at_limit + "a", MAX_LENGTH) == most + 1


def test_a_prompt_whose_nfc_form_is_three_times_longer_is_counted_so(prompt_tokenizer):
    """U+1D160 (4 bytes) is excluded from composition: NFC writes it as three code points of 4
    bytes each. Its prompt is counted (not skipped as surely short) by its 12 bytes a character."""
    note = "\U0001d160"
    assert len(unicodedata.normalize("NFC", note).encode("utf-8")) == 12
    prompt = note * 120  # 480 bytes as sent, 1,440 after NFC: over 10 x 128
    size = len(unicodedata.normalize("NFC", chat_wrap(prompt, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)).encode())
    assert size > MAX_LENGTH * prompt_tokenizer.max_token_bytes
    assert prompt_tokenizer.surely_too_long(prompt, MAX_LENGTH) == size


def test_a_non_ascii_chat_template_is_counted_in_bytes(tokenizer_json):
    prefix = "<|im_start|>user \u00ab\n"  # one character, two bytes
    loaded = PromptTokenizer(tokenizer_json, prefix, DEFAULT_CHAT_SUFFIX)
    most = MAX_LENGTH * loaded.max_token_bytes
    prompt = _ascii_prompt(loaded, most)  # most characters, most + 1 bytes
    assert loaded.surely_too_long(prompt, MAX_LENGTH) == most + 1
    assert loaded.surely_too_long(prompt[1:], MAX_LENGTH) is None


def test_a_normalizer_that_lengthens_ascii_is_applied_before_counting(tokenizer_json, tmp_path):
    """A SentencePiece-style normalizer writes each space as U+2581 (three bytes): an ASCII prompt
    is not its own byte count there."""
    normalizer = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        ],
    }
    loaded = PromptTokenizer(_edited_tokenizer(tokenizer_json, tmp_path, normalizer=normalizer), "", "")
    prompt = "a " * 400  # 800 characters; 400 x 4 + 3 = 1,603 bytes once normalized
    assert loaded.surely_too_long(prompt, MAX_LENGTH) == 1603


def test_dropout_zero_is_exact_and_accepted_by_both_readers(tokenizer_json, tmp_path, prompt_tokenizer):
    path = _edited_tokenizer(tokenizer_json, tmp_path, model=_bpe_model(tokenizer_json, dropout=0.0))
    assert TokenizerFile(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX).num_token_ids == 248077
    loaded = PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    assert loaded.encode(["Is the parcel late?"]) == prompt_tokenizer.encode(["Is the parcel late?"])


def test_dropout_is_refused_by_both_readers_in_its_own_words(tokenizer_json, tmp_path):
    path = _edited_tokenizer(tokenizer_json, tmp_path, model=_bpe_model(tokenizer_json, dropout=0.5))
    export = _export(tmp_path / "export", path)
    for load in (PromptTokenizer.from_export, TokenizerFile.from_export):
        with pytest.raises(ExportError, match=r"^tokenizer.json: model.dropout is 0.5; it must be null"):
            load(export)


def test_a_refusal_from_export_is_not_reported_as_an_unusable_file(tmp_path):
    """from_export wraps the `tokenizers` library's parse failures; a refusal of its own passes
    through as it is (the operator reads why, not "not a usable tokenizer")."""
    text = _numbered({"a": 0, "b": 2}, [])  # a gap
    with pytest.raises(ExportError, match=r"^tokenizer.json: token 'b' has id 2; the ids of its 2 tokens"):
        TokenizerFile.from_export(_export(tmp_path, text))


def test_a_file_the_library_cannot_parse_is_refused_with_the_librarys_reason(tmp_path, tokenizer_json):
    export = _export(tmp_path, tokenizer_json.read_text(encoding="utf-8")[:1000])
    for load in (PromptTokenizer.from_export, TokenizerFile.from_export):
        with pytest.raises(ExportError, match=r"^tokenizer.json: not a usable tokenizer \(\w+: \S.*\)$"):
            load(export)


@pytest.mark.parametrize(
    "document",
    [
        {"model": {"type": "BPE", "vocab": ["a", "b"], "merges": []}},
        json.loads(_numbered({"a": 0, "b": 1}, [("<x>", "2")])),
        json.loads(_numbered({"a": 0, "b": 1}, [("<x>", 2.0)])),
    ],
    ids=["vocab_a_list", "added_id_a_string", "added_id_a_float"],
)
def test_the_workers_reading_refuses_ids_that_are_not_integers_in_its_own_words(tmp_path, document):
    (tmp_path / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(
        ExportError, match="^tokenizer.json: model.vocab and added_tokens must map tokens to integer ids"
    ):
        TokenizerFile(tmp_path / "tokenizer.json", "", "")
