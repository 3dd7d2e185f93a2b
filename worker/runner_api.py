"""The one interface between the scheduler and a model backend.

The scheduler packs segments of token trees, of any number of requests and at any tree depth,
into passes; a pass is one forward pass, one read of every weight. A runner owns device memory;
the scheduler only holds opaque state handles and ints. Both backends (the PyTorch CPU
reference in `openjev.worker.model`, the CUDA backend in `openjev.worker.cuda`) implement
`ModelRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SegmentRun:
    """One packed sequence of a pass.

    token_ids: this segment's tokens only (never empty).
    start_position: number of tokens before it in its prompt (= the parent's end position);
        rotary positions continue from here.
    parent_state: the state a runner returned for the parent segment in an earlier pass.
    parent_in_pass: or the index of an earlier run of the same pass that is the parent: the
        child continues from that run's final state within the pass (at most one of the two;
        neither: start of prompt).
    keep_state: children in later passes will start from this segment's final state, so return it.
    read_head: the head reads this segment's last token, so return its score.
    """

    token_ids: Sequence[int]
    start_position: int
    parent_state: Any | None
    keep_state: bool
    read_head: bool
    parent_in_pass: int | None = None


@dataclass(frozen=True)
class SegmentResult:
    """state: opaque final state (None unless keep_state); head_score: fp32 value as a Python
    float (None unless read_head)."""

    state: Any | None
    head_score: float | None


class ModelRunner(Protocol):
    """A loaded model that executes passes of packed segments."""

    backend: str  # "torch" or "cuda"
    # Most tree levels one pass may hold (1: every parent must have run in an earlier pass).
    max_pass_depth: int
    # Optional (absent: unbounded): the most parents' states from earlier passes and the most
    # kept states one pass holds (max_pass_states), and the most ancestor key rows of those
    # parents (max_pass_context); the CUDA runner's captured passes have fixed slots for them.
    # Optional too: device_lost() -> str | None, asked after a pass failed: why the device can run
    # nothing more (a sticky CUDA error), or None where the failure was the pass's own.

    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        """Run one pass. A run's parent is a state from an earlier pass or an earlier run of
        this pass. Results are in the order of `runs`."""
        ...


def pass_depths(runs: Sequence[SegmentRun]) -> list[int]:
    """Each run's level inside its pass (0: its parent, if any, ran in an earlier pass).
    Raises ValueError for a malformed pass."""
    depths: list[int] = []
    for i, run in enumerate(runs):
        parent = run.parent_in_pass
        if parent is None:
            depths.append(0)
            continue
        if run.parent_state is not None:
            raise ValueError(f"run {i} names a parent state and a parent in the pass")
        if not 0 <= parent < i:
            raise ValueError(f"run {i}: parent_in_pass {parent} is not an earlier run of the pass")
        parent_run = runs[parent]
        if run.start_position != parent_run.start_position + len(parent_run.token_ids):
            raise ValueError(f"run {i}: start_position is not its in-pass parent's end position")
        depths.append(depths[parent] + 1)
    return depths
