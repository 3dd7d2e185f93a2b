"""The one interface between the planner/engine and a model backend.

The engine walks a plan (segments of a token tree, grouped into launches) and hands each launch
to a runner. A runner owns device memory; the engine only holds opaque state handles and ints.
Both backends (the PyTorch CPU reference in `openjev.worker.model`, the CUDA backend in
`openjev.worker.cuda`) implement `ModelRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SegmentRun:
    """One packed sequence of a launch.

    token_ids: this segment's tokens only (never empty).
    start_position: number of tokens before it in its prompt (= the parent's end position);
        rotary positions continue from here.
    parent_state: the state a runner returned for the parent segment (None: start of prompt).
    keep_state: children will start from this segment's final state, so return it.
    read_head: the head reads this segment's last token, so return its score.
    """

    token_ids: Sequence[int]
    start_position: int
    parent_state: Any | None
    keep_state: bool
    read_head: bool


@dataclass(frozen=True)
class SegmentResult:
    """state: opaque final state (None unless keep_state); head_score: fp32 value as a Python
    float (None unless read_head)."""

    state: Any | None
    head_score: float | None


class ModelRunner(Protocol):
    """A loaded model that executes launches of packed segments."""

    backend: str  # "torch" or "cuda"

    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        """Run one launch: every run's parent_state comes from an earlier launch.
        Results are in the order of `runs`."""
        ...
