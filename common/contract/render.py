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
- `candidate_prompt` / `noul_prompt` apply Python's `str.strip()`. The reference trims (Rust
  `trim`) at wrap time instead; because every prompt starts with "Context:" and ends with
  "Answer Yes or No.", either strip is a no-op, so the place does not matter.
- `chat_wrap` is plain concatenation and does not strip again.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_CHAT_PREFIX = "<|im_start|>user\n"
DEFAULT_CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

_CANDIDATE_QUESTION = "\nIs this proposed answer correct? Answer Yes or No."
_NOUL_TAIL = "Is the answer to this question yes? Answer Yes or No."


def render_value(value: Any) -> str:
    """A string as is; any other JSON value as `json.dumps(sort_keys=True, ensure_ascii=False)`."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def prompt_head(state_text: str, instructions_text: str) -> str:
    """The start every candidate prompt of a question shares (state and instructions rendered)."""
    return f"Context:\n{state_text}\n\nQuestion: {instructions_text}\n"


def candidate_prompt(head: str, option: str) -> str:
    """A choice or score candidate: `head` from `prompt_head`, `option` already rendered."""
    return f"{head}Proposed answer: {option}{_CANDIDATE_QUESTION}".strip()


def noul_prompt(head: str) -> str:
    """The single candidate of a noul question."""
    return (head + _NOUL_TAIL).strip()


def chat_wrap(prompt: str, chat_prefix: str, chat_suffix: str) -> str:
    """The text that is tokenized: prefix + (already stripped) prompt + suffix."""
    return f"{chat_prefix}{prompt}{chat_suffix}"
