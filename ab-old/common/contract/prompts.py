"""A question's candidate prompts, rendered on demand.

A request may carry 65,536 candidates over a large state. Holding every prompt as its own string
would keep one copy of the state per candidate (2.5 GB for a 0.95 MB body was measured), so a
question keeps the parts once -- the state text is the request's one rendered copy, shared by
every question -- and a prompt is built only when it is read (`Prompts[i]`), one batch at a time
by the tokenizing stream. `rendered_bytes` gives the UTF-8 size of every prompt without building
any of them, so a request can be refused on size before tokenization starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from openjev.contract.render import NOUL_TAIL, candidate_prompt, noul_prompt, prompt_head

_HEAD_BYTES = len(prompt_head("", "").encode("utf-8"))
_CANDIDATE_BYTES = len(candidate_prompt("", "").encode("utf-8"))  # "Proposed answer: " + question
_NOUL_BYTES = len(NOUL_TAIL.encode("utf-8"))


def utf8_size(text: str) -> int:
    """len(text.encode("utf-8")) without the copy when the text is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class Prompts(Sequence[str]):
    """The prompts of one question: noul when `options` is None (one prompt), else one per option.

    Equal to any sequence of the same strings (tests compare with tuples)."""

    __slots__ = ("_state", "_instructions", "_options")

    def __init__(self, state_text: str, instructions_text: str, options: Sequence[str] | None):
        self._state = state_text
        self._instructions = instructions_text
        self._options = options

    def __len__(self) -> int:
        return 1 if self._options is None else len(self._options)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        head = prompt_head(self._state, self._instructions)
        if self._options is None:
            if index not in (0, -1):
                raise IndexError(index)
            return noul_prompt(head)
        return candidate_prompt(head, self._options[index])

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Prompts({len(self)} prompts)"

    def rendered_bytes(self, state_bytes: int) -> int:
        """UTF-8 bytes of all prompts together (the strip in the builders removes nothing: a
        prompt starts with "Context:" and ends with "Answer Yes or No.")."""
        head = _HEAD_BYTES + state_bytes + utf8_size(self._instructions)
        if self._options is None:
            return head + _NOUL_BYTES
        return sum(head + _CANDIDATE_BYTES + utf8_size(option) for option in self._options)
