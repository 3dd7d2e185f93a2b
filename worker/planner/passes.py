"""Filling a pass: which pending segments, of any number of requests, one forward pass runs.

A pass is one read of every weight, so the aim is as much of every waiting tree as the budget
holds, at any tree depth: a segment may join a pass when its parent has run in an earlier pass
or joins the same pass (the runner computes parents before children inside each layer).
Requests are offered in arrival order, each one's segments in tree order (parents first); a
segment that does not fit is skipped together with its subtree, and smaller ones behind it may
still fill the room. Where the runner holds a pass's states in fixed slots (the CUDA runner's
captured passes), a pass also keeps within its room for states (`StateRoom`): parents' states
read from earlier passes, their ancestors' key rows, and states it keeps for later passes.
Everything here is ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from openjev.worker.planner.plan import PackLimits, Segment


@dataclass(frozen=True)
class StateRoom:
    """What a pass can hold besides its own tokens (None: unbounded): states of parents that ran
    in earlier passes (or came from the cache) and states it keeps for later passes, each at most
    `states`; the parents' ancestor rows, at most `context` (counted per parent: a bound)."""

    states: int
    context: int


@dataclass(frozen=True)
class Picked:
    """One segment chosen for a pass: owner (the request's position among those offered),
    segment index within its plan, and its parent's position in the pass (None: the parent, if
    any, ran in an earlier pass)."""

    owner: int
    segment: int
    parent_in_pass: int | None


class PendingTree:
    """A request's segments and which of them have run. Segments before `first_pending` have
    all run, so a pass over a request of tens of thousands of candidates does not rescan them;
    smallest_from[i], the fewest tokens of any segment from i on, ends a scan where nothing left
    fits (without it a pass with 63 tokens of room walked all of 60,000 65-token candidates)."""

    def __init__(self, segments: Sequence[Segment]):
        self.segments = segments
        self.smallest_from = list(accumulate((s.num_tokens for s in reversed(segments)), min))[::-1]
        self.done = [False] * len(segments)
        self.children: list[list[int]] = [[] for _ in segments]
        for s in segments:
            if s.parent is not None:
                self.children[s.parent].append(s.index)
        self.first_pending = 0
        self._num_done = 0

    @property
    def finished(self) -> bool:
        return self._num_done == len(self.segments)

    def mark_done(self, index: int) -> None:
        if not self.done[index]:
            self.done[index] = True
            self._num_done += 1
            while self.first_pending < len(self.done) and self.done[self.first_pending]:
                self.first_pending += 1


def fill_pass(
    trees: Sequence[PendingTree],
    limits: PackLimits,
    max_depth: int,
    tokens_per_request: int | None = None,
    room: StateRoom | None = None,
) -> list[Picked]:
    """Choose the next pass. max_depth: tree levels the runner can hold in one pass (1: parents
    must have run before). tokens_per_request: where several requests wait, each first takes at
    most this many tokens and half the pass's segments (and half the tokens and segments left, but
    the first to take any), in arrival order, so that long prompts' chunks or a request of many
    candidates leave room for the requests behind them; then the requests the first round gave
    nothing, then the others, each in arrival order, fill whatever room is left (in plain arrival
    order a request whose segment was over half the room waited while later ones took it; None:
    one round, the whole budget). Where several wait, the pass holds at most
    limits.pass_tokens_shared tokens. room: the pass's room for states, or None (the runner has
    no such limit)."""
    shared = tokens_per_request is not None
    fill = _Fill(trees, limits, max_depth, room, limits.pass_tokens_shared if shared else limits.max_tokens)
    everyone = list(range(len(trees)))
    if tokens_per_request is None:
        fill.round(everyone, limits.max_tokens, limits.max_sequences)
    else:
        fill.round(everyone, tokens_per_request, max(1, limits.max_sequences // 2), halves=True)
        took = {p.owner for p in fill.picked}
        fill.round([o for o in everyone if o not in took] + sorted(took), limits.max_tokens, limits.max_sequences)
    if room is not None:
        fill.keep_within(room.states)
    return fill.picked


class _Fill:
    """A pass being filled: what it holds, and where each tree's picked segments sit in it."""

    def __init__(
        self, trees: Sequence[PendingTree], limits: PackLimits, max_depth: int, room: StateRoom | None, tokens: int
    ):
        self.trees, self.limits, self.max_depth, self.room = trees, limits, max_depth, room
        self.outside: set[tuple[int, int]] = set()  # (owner, parent segment) read from earlier passes
        self.context = 0  # their ancestor rows, counted per parent
        self.picked: list[Picked] = []
        self.tokens_left = tokens  # the pass's token room
        self.position: list[dict[int, int]] = [{} for _ in trees]  # segment -> its position in the pass
        self.depth: list[dict[int, int]] = [{} for _ in trees]

    def round(self, order: list[int], tokens_each: int, segments_each: int, halves: bool = False) -> None:
        """Offer each tree of `order` at most `tokens_each` tokens and `segments_each` segments more;
        halves: and, but the first to take any, at most half the tokens and segments left (two
        long prompts' chunks, or two requests of many candidates, would otherwise take every pass
        between them; the first keeps its whole share, or a chunk over half the pass could wait
        for good)."""
        for owner in order:
            tree = self.trees[owner]
            if len(self.picked) == self.limits.max_sequences or self.tokens_left == 0:
                return
            position, depth = self.position[owner], self.depth[owner]
            own_tokens, own_segments = tokens_each, segments_each
            if halves and self.picked:  # the first with work keeps its whole share
                own_tokens = min(own_tokens, self.tokens_left // 2)
                # segments too: two requests of many candidates took all 64 between them
                own_segments = min(own_segments, max(1, (self.limits.max_sequences - len(self.picked)) // 2))
            for segment in tree.segments[tree.first_pending :]:
                i = segment.index
                if tree.done[i] or i in position:
                    continue
                if len(self.picked) == self.limits.max_sequences or own_segments == 0:
                    break
                if tree.smallest_from[i] > min(self.tokens_left, own_tokens):
                    break  # no segment from here on fits
                parent = segment.parent
                if parent is None or tree.done[parent]:
                    parent_position, level = None, 0
                elif parent in position and depth[parent] + 1 < self.max_depth:
                    parent_position, level = position[parent], depth[parent] + 1
                else:
                    continue  # its parent has not run and does not run in this pass
                if segment.num_tokens > min(self.tokens_left, own_tokens):
                    continue
                if parent_position is None and parent is not None and not self._reads_state(owner, segment):
                    continue  # no room for its parent's state: a later pass
                position[i], depth[i] = len(self.picked), level
                self.picked.append(Picked(owner, i, parent_position))
                self.tokens_left -= segment.num_tokens
                own_tokens -= segment.num_tokens
                own_segments -= 1

    def _reads_state(self, owner: int, segment: Segment) -> bool:
        """Take room for the state of a parent computed in an earlier pass, if there is room."""
        assert segment.parent is not None
        if self.room is None or (owner, segment.parent) in self.outside:
            return True
        # the parent's ancestors are every row before this segment; an empty pass takes it whatever
        # their count (else a prompt longer than the room never runs: that pass runs eagerly)
        full = len(self.outside) == self.room.states or self.context + segment.start_position > self.room.context
        if full and self.picked:
            return False
        self.outside.add((owner, segment.parent))
        self.context += segment.start_position
        return True

    def keep_within(self, states: int) -> None:
        """Drop the last picked segments (leaves of the pass: children come after parents)
        until at most `states` of those left have a child that runs later. The first never goes:
        alone it keeps at most one state."""
        while len(self.picked) > 1 and self._num_kept() > states:
            last = self.picked.pop()
            del self.position[last.owner][last.segment], self.depth[last.owner][last.segment]
            self.tokens_left += self.trees[last.owner].segments[last.segment].num_tokens

    def _num_kept(self) -> int:
        chosen: list[set[int]] = [set(p) for p in self.position]
        return sum(len(kept_after_pass(tree, chosen[o])) for o, tree in enumerate(self.trees) if chosen[o])


def kept_after_pass(tree: PendingTree, chosen: set[int]) -> set[int]:
    """Segments of this pass whose state a later pass needs: some child runs later."""
    return {i for i in chosen if any(c not in chosen and not tree.done[c] for c in tree.children[i])}


def pack_passes(segments: Sequence[Segment], limits: PackLimits, max_depth: int) -> list[tuple[int, ...]]:
    """The passes one request takes when it runs alone (segments listed parents first)."""
    for s in segments:
        if s.num_tokens > limits.max_tokens:
            raise ValueError(f"segment {s.index} has {s.num_tokens} tokens > {limits.max_tokens}")
        if s.parent is not None and s.parent >= s.index:
            raise ValueError("segments must list parents before children")
    tree = PendingTree(segments)
    passes = []
    while not tree.finished:
        chosen = [p.segment for p in fill_pass([tree], limits, max_depth)]
        for i in chosen:
            tree.mark_done(i)
        passes.append(tuple(sorted(chosen)))
    return passes
