"""Filling a pass: which pending segments, of any number of requests, one forward pass runs.

A pass is one read of every weight, so the aim is as much of every waiting tree as the budget
holds, at any tree depth: a segment may join a pass when its parent has run in an earlier pass
or joins the same pass (the runner computes parents before children inside each layer).
Requests are offered in arrival order, each one's segments in tree order (parents first); a
segment that does not fit is skipped together with its subtree, and smaller ones behind it may
still fill the room. Everything here is ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openjev.worker.planner.plan import PackLimits, Segment


@dataclass(frozen=True)
class Picked:
    """One segment chosen for a pass: owner (the request's position among those offered),
    segment index within its plan, and its parent's position in the pass (None: the parent, if
    any, ran in an earlier pass)."""

    owner: int
    segment: int
    parent_in_pass: int | None


@dataclass
class PendingTree:
    """A request's segments and which of them have run."""

    segments: Sequence[Segment]
    done: list[bool]

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> PendingTree:
        return cls(segments, [False] * len(segments))

    @property
    def finished(self) -> bool:
        return all(self.done)


def fill_pass(
    trees: Sequence[PendingTree], limits: PackLimits, max_depth: int, tokens_per_request: int | None = None
) -> list[Picked]:
    """Choose the next pass. max_depth: tree levels the runner can hold in one pass (1: parents
    must have run before). tokens_per_request: at most this many tokens of one request, so that
    a long prompt's chunks leave room for the requests behind it (None: the whole budget)."""
    picked: list[Picked] = []
    tokens_left = limits.max_tokens
    for owner, tree in enumerate(trees):
        if len(picked) == limits.max_sequences or tokens_left == 0:
            break
        own_left = limits.max_tokens if tokens_per_request is None else tokens_per_request
        position: dict[int, int] = {}  # segment index -> its position in the pass
        depth: dict[int, int] = {}
        for segment in tree.segments:
            i = segment.index
            if tree.done[i]:
                continue
            if len(picked) == limits.max_sequences:
                break
            parent = segment.parent
            if parent is None or tree.done[parent]:
                parent_position, level = None, 0
            elif parent in position and depth[parent] + 1 < max_depth:
                parent_position, level = position[parent], depth[parent] + 1
            else:
                continue  # its parent has not run and does not run in this pass
            if segment.num_tokens > min(tokens_left, own_left):
                continue
            position[i], depth[i] = len(picked), level
            picked.append(Picked(owner, i, parent_position))
            tokens_left -= segment.num_tokens
            own_left -= segment.num_tokens
    return picked


def kept_after_pass(tree: PendingTree, chosen: set[int]) -> set[int]:
    """Segments of this pass whose state a later pass needs: some child runs later."""
    return {
        s.parent
        for s in tree.segments
        if s.parent is not None and s.parent in chosen and s.index not in chosen and not tree.done[s.index]
    }


def pack_passes(segments: Sequence[Segment], limits: PackLimits, max_depth: int) -> list[tuple[int, ...]]:
    """The passes one request takes when it runs alone (segments listed parents first)."""
    for s in segments:
        if s.num_tokens > limits.max_tokens:
            raise ValueError(f"segment {s.index} has {s.num_tokens} tokens > {limits.max_tokens}")
        if s.parent is not None and s.parent >= s.index:
            raise ValueError("segments must list parents before children")
    tree = PendingTree.of(segments)
    passes = []
    while not tree.finished:
        chosen = [p.segment for p in fill_pass([tree], limits, max_depth)]
        for i in chosen:
            tree.done[i] = True
        passes.append(tuple(sorted(chosen)))
    return passes
