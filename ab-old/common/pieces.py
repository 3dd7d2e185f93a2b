"""Exact piecewise tokenization: prompts cut where the Qwen3.5 tokenizer provably starts afresh,
each piece encoded once and remembered.

A request's candidates repeat one state and question, and an agent's next request repeats the
state again; encoding every prompt whole costs the state's length once per candidate per request.
Cut right after a line feed that a non-whitespace character follows, and the ids of the whole are
the ids of the part before the cut followed by the ids of the part after it:
- special tokens are matched first, on the raw text; none contains whitespace, none strips it
  (lstrip/rstrip off), so no match spans the line feed;
- NFC: a line feed is a starter that composes with nothing, so normalizing never crosses it;
- pre-tokenizer regex (QWEN3_5_PAT_STR): a match that holds the line feed can grow only over
  whitespace or [\\r\\n], and the character after the cut is neither, so a match ends exactly at
  the cut. No match before it reads past the cut: the one lookahead, `\\s+(?!\\S)`, comes after
  `\\s*[\\r\\n]+` in the alternation, which already matches any whitespace run that ends in a line
  feed. With no look-behind, matching after the cut starts as on a fresh string;
- byte-level mapping (no prefix space, no regex of its own) and BPE act within one pre-token.
This holds for that configuration only: `PieceEncoder.applies` checks a tokenizer.json for it and
the caller encodes whole otherwise. tests/test_tokenizer_pieces.py compares piecewise and whole
encoding on random texts built from the characters that matter here.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer

# zero-width: after "\n", before a character str.isspace() calls non-space. Python's \s is a
# superset of the Unicode White_Space the regex's \s means, so every cut found is a safe one.
CUT = re.compile(r"(?<=\n)(?=\S)")
# The same cuts, found as the line feeds they follow: a literal to scan for, where CUT's
# lookbehind is tried at every character (15x slower on a 17k-character prompt).
_CUT_AFTER = re.compile(r"\n(?=\S)")


MEMO_BYTES = 32 << 20  # pieces' text and ids remembered, counted as the objects' sizes
MAX_PIECE_CHARS = 1 << 20  # a longer piece is encoded, not remembered
ENTRY_OVERHEAD = 100  # the dict slot and the array's header, roughly

EncodeBatch = Callable[[list[str]], list[list[int]]]


def split_at_cuts(text: str) -> list[str]:
    """`CUT.split(text)`: the pieces between cuts, in order."""
    pieces, start = [], 0
    for match in _CUT_AFTER.finditer(text):
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    return pieces


class PieceEncoder:
    """Encodes texts piece by piece through `encode_batch` (texts -> ids, no special tokens
    added), remembering pieces up to `max_bytes` (text and ids; least recently used first out)."""

    def __init__(self, encode_batch: EncodeBatch, max_bytes: int = MEMO_BYTES):
        self._encode_batch = encode_batch
        self._max_bytes = max_bytes
        self._memo: OrderedDict[str, array] = OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def applies(tokenizer_json: dict, pattern: str) -> bool:
        """Whether a tokenizer.json's configuration (its normalizer, pre_tokenizer, model type and
        added tokens) is the one the cut was proven for."""
        pre = tokenizer_json.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if not steps or len(steps) != 2:
            return False
        split, byte_level = steps
        added = tokenizer_json.get("added_tokens") or []
        return (
            tokenizer_json.get("normalizer") == {"type": "NFC"}
            and split == {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
            and byte_level.get("type") == "ByteLevel"
            and byte_level.get("add_prefix_space") is False
            and byte_level.get("use_regex") is False
            and (tokenizer_json.get("model") or {}).get("type") == "BPE"
            and all(not t.get("lstrip") and not t.get("rstrip") and not re.search(r"\s", t["content"]) for t in added)
        )

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, pattern: str, encode_batch: EncodeBatch) -> PieceEncoder | None:
        """An encoder where the loaded tokenizer's configuration (read from its parts, not by
        parsing its multi-MB file again) is the proven one, else None."""
        config = {
            "normalizer": None if tokenizer.normalizer is None else json.loads(tokenizer.normalizer.__getstate__()),
            "pre_tokenizer": None
            if tokenizer.pre_tokenizer is None
            else json.loads(tokenizer.pre_tokenizer.__getstate__()),
            "model": {"type": type(tokenizer.model).__name__},
            "added_tokens": [
                {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip}
                for t in tokenizer.get_added_tokens_decoder().values()
            ],
        }
        return cls(encode_batch) if cls.applies(config, pattern) else None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        split = [split_at_cuts(text) for text in texts]
        found: dict[str, array] = {}
        with self._lock:
            for pieces in split:
                for piece in pieces:
                    if piece not in found and piece in self._memo:
                        self._memo.move_to_end(piece)
                        found[piece] = self._memo[piece]
        missing = list({piece for pieces in split for piece in pieces if piece not in found})
        if missing:
            for piece, encoded in zip(missing, self._encode_batch(missing), strict=True):
                found[piece] = array("I", encoded)
            self._remember({piece: found[piece] for piece in missing})
        out: list[list[int]] = []
        for pieces in split:
            joined: list[int] = []
            for piece in pieces:
                joined.extend(found[piece])
            out.append(joined)
        return out

    def _remember(self, new: dict[str, array]) -> None:
        with self._lock:
            for piece, ids in new.items():
                if len(piece) > MAX_PIECE_CHARS or piece in self._memo:
                    continue
                self._memo[piece] = ids
                self.nbytes += _cost(piece, ids)
            while self.nbytes > self._max_bytes and self._memo:
                old, ids = self._memo.popitem(last=False)
                self.nbytes -= _cost(old, ids)


def _cost(piece: str, ids: array) -> int:
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + ENTRY_OVERHEAD
