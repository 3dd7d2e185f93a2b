"""Prompt rendering: JSON values to text, candidate prompts, the chat wrapper.

All text the model sees is built here, so the frontend (tokenization) and any offline tool render
byte-for-byte the same prompts as the reference service.

Decisions:
- A JSON value is rendered exactly as Python's `json.dumps(value, sort_keys=True,
  ensure_ascii=False)` with its default separators (", " and ": "): floats are Python's `repr`
  (`1e+16`, `-0.0`, `1e-05`), non-ASCII characters are kept, control characters and quotes are
  escaped. A string is used as is. Integers are rendered as Python renders them (also beyond
  64 bits); the Rust reference would turn an integer beyond 64 bits, and a literal `-0`, into a
  float. The contract names Python's `json.dumps` as the rule, so we follow Python there.
- Integers of any length are kept exactly. Python refuses to convert an integer of more than
  `sys.get_int_max_str_digits()` digits (4,300 by default) between text and int, a guard against
  quadratic conversion time; lifting it process-wide would lift it for every caller. So the request
  decoder keeps such a literal as `BigInt` (its digits, never converted) and the renderer writes the
  digits back as they came. The request's size limits bound how many digits there can be.
- `candidate_prompt` / `noul_prompt` apply Python's `str.strip()`. The reference trims (Rust
  `trim`) at wrap time instead; because every prompt starts with "Context:" and ends with
  "Answer Yes or No.", either strip is a no-op, so the place does not matter.
- `chat_wrap` is plain concatenation and does not strip again.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
from typing import Any

DEFAULT_CHAT_PREFIX = "<|im_start|>user\n"
DEFAULT_CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

CANDIDATE_QUESTION = "\nIs this proposed answer correct? Answer Yes or No."
NOUL_TAIL = "Is the answer to this question yes? Answer Yes or No."


class BigInt:
    """An integer literal too long for Python's int <-> str conversion limit, kept as its text."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BigInt) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"BigInt({len(self.text)} characters)"


def parse_int(text: str) -> int | BigInt:
    """json's parse_int hook: an int, or a BigInt beyond the conversion limit."""
    limit = sys.get_int_max_str_digits()
    if limit and len(text) - text.startswith("-") > limit:
        return BigInt(text)
    return int(text)


def dumps_exact(value: Any, *, sort_keys: bool, indent: int | None = None) -> str:
    """`json.dumps(value, sort_keys=..., ensure_ascii=False)` that also writes BigInt digits.

    json calls `default` for a BigInt; it stands in a random marker string, which is replaced by
    the digits afterwards (no request text can contain a marker made after it arrived), all in
    one pass: a replace per BigInt copied the whole text each time (4,000 BigInts of 4,301 digits
    took 35 s)."""
    digits: list[str] = []
    nonce = secrets.token_hex(16)

    def default(o: Any) -> str:
        if not isinstance(o, BigInt):
            raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
        digits.append(o.text)
        return f"\x00bigint-{nonce}-{len(digits) - 1}\x00"

    text = json.dumps(value, sort_keys=sort_keys, ensure_ascii=False, default=default, indent=indent)
    if not digits:
        return text
    # a marker as json writes it: "\u0000bigint-NONCE-I\u0000", quotes included
    marker = re.compile(
        re.escape(json.dumps(f"\x00bigint-{nonce}-")[:-1]) + r"(\d+)" + re.escape(json.dumps("\x00")[1:])
    )
    return marker.sub(lambda found: digits[int(found.group(1))], text)


def render_value(value: Any) -> str:
    """A string as is; any other JSON value as `json.dumps(sort_keys=True, ensure_ascii=False)`."""
    if isinstance(value, str):
        return value
    return dumps_exact(value, sort_keys=True)


def prompt_head(state_text: str, instructions_text: str) -> str:
    """The start every candidate prompt of a question shares (state and instructions rendered)."""
    return f"Context:\n{state_text}\n\nQuestion: {instructions_text}\n"


def candidate_prompt(head: str, option: str) -> str:
    """A choice or score candidate: `head` from `prompt_head`, `option` already rendered."""
    return f"{head}Proposed answer: {option}{CANDIDATE_QUESTION}".strip()


def noul_prompt(head: str) -> str:
    """The single candidate of a noul question."""
    return (head + NOUL_TAIL).strip()


def chat_wrap(prompt: str, chat_prefix: str, chat_suffix: str) -> str:
    """The text that is tokenized: prefix + (already stripped) prompt + suffix."""
    return f"{chat_prefix}{prompt}{chat_suffix}"
