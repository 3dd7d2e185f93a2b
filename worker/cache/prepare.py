"""A request's segments as they run with the cache: cut at deposit points, hung from hits.

Walking the plan's segments parents first, each one:
- looks up, when everything above it came from the cache, the deepest cached state on its own
  grid (or at its end): the pieces before it are done, the state is their last piece's, and a
  hit at the end of a segment whose candidates read it needs a cached head score too;
- if it has children (a branch point or a chunk boundary, `keep_state`), deposits its end state
  (when its node is at least a grid long: the segment, or the long node it is the last chunk
  of) and the states at a few grid points before the end (the last
  one before the end, then ever farther back: 1, 2, 4, ... grids), where a later request that
  shares only part of it can hang; a prompt that runs alone from its start (a leaf at the root,
  e.g. a noul question, or the last piece of such a prompt longer than `chunk_tokens`, whose
  earlier pieces have no other child) deposits those grid points too, once per request.
(Requests under policy `off` do not come here: the scheduler runs them with no cache.)

Every cut is one the runner computes exactly (keys.CutRule), so the pieces compute the same bits
the plan's own segments would: a hit changes which tokens run, never a result.

A plan that fits one pass (segments, tree levels) still fits it once cut: a deposit cut that
would need a segment or a level more is left out, those farthest before the end first.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openjev.worker.cache.keys import Hasher, NodeKey, advance, token_bytes
from openjev.worker.cache.store import Entry, StateCache
from openjev.worker.planner.plan import Reader, Segment


@dataclass
class Prepared:
    """segments: the plan's segments cut into pieces (parents first; readers on each segment's
    last piece); done: pieces already computed (their states or scores came from the cache);
    states: the cached state of done pieces that children hang from; scores: candidates answered
    by a cached head score; deposits: pieces whose final state (and score) goes into the cache;
    requires: per deposit, the states a later lookup passes on its way down to it (the ends of
    the plan segments above it, root first: store.py keeps it only while they are kept);
    hit_tokens: tokens of the done pieces."""

    segments: tuple[Segment, ...]
    done: tuple[int, ...] = ()
    states: dict[int, Any] = field(default_factory=dict)
    scores: tuple[tuple[Reader, float], ...] = ()
    deposits: dict[int, NodeKey] = field(default_factory=dict)
    requires: dict[int, tuple[NodeKey, ...]] = field(default_factory=dict)
    hit_tokens: int = 0

    def prefix_tokens(self, index: int) -> bytes:
        """The tokens before the end of piece `index` (what a deposit is keyed and checked by)."""
        return b"".join(token_bytes(tokens) for tokens in _path(self.segments, index))


@dataclass(frozen=True)
class PassFit:
    """One pass's room: most segments and most tree levels (parent, child, ...) it holds."""

    max_sequences: int
    max_depth: int


@dataclass(frozen=True)
class _Path:
    hasher: Hasher | None  # the tokens up to this segment's end (None: not hashed, a leaf)
    anchors: tuple[int, ...]
    anchor: int
    cached: bool  # its end state came from the cache: its children may look up
    last_piece: int | None
    depth: int = 0  # pieces that run on the chain up to its last piece (0: that piece is done)
    # the keys a lookup below its end passes (its end's included, root first); None: its end is
    # neither kept nor cached (shorter than a grid), so nothing below it can ever be looked up
    chain: tuple[NodeKey, ...] | None = ()
    # a prompt that runs alone from its start: the root, or a piece of a long one (chunk_tokens)
    # whose parent is such a piece with no other child and no reader; it deposits as a root does
    solo: bool = False


def prepare(segments: Sequence[Segment], cache: StateCache, fit: PassFit | None = None) -> Prepared:
    if not cache.enabled:
        return Prepared(tuple(segments))
    rule = cache.rule
    heights = _heights(segments)
    # the cap applies where the plan itself fits one pass (a longer one takes several anyway)
    room = fit if fit and len(segments) <= fit.max_sequences and max(heights, default=0) <= fit.max_depth else None
    running = 0  # pieces that run, so far
    pieces: list[tuple[int | None, Sequence[int], int, tuple[Reader, ...]]] = []  # parent, tokens, start, readers
    done: list[int] = []
    states: dict[int, Any] = {}
    scores: list[tuple[Reader, float]] = []
    deposits: dict[int, NodeKey] = {}
    requires: dict[int, tuple[NodeKey, ...]] = {}
    hit_tokens = 0
    paths: list[_Path] = []
    planned: set[NodeKey] = set()  # deposits already planned by this request (prompts sharing a prefix)
    root = _Path(hashlib.sha256(), (), 0, True, None, solo=True)
    children = [0] * len(segments)
    for s in segments:
        if s.parent is not None:
            children[s.parent] += 1
    for seg in segments:
        parent = root if seg.parent is None else paths[seg.parent]
        # its parent is the same tree node, cut at a multiple of chunk_tokens (a long prompt's pieces)
        continues = seg.parent is not None and children[seg.parent] == 1 and not segments[seg.parent].readers
        solo = seg.parent is None or (parent.solo and continues)
        start, end = seg.start_position, seg.end_position
        if not parent.cached and not seg.keep_state and not solo:  # a leaf under computed work: runs as planned
            pieces.append((parent.last_piece, seg.token_ids, start, seg.readers))
            paths.append(_Path(None, (), 0, False, len(pieces) - 1, parent.depth + 1, None))
            running += 1
            continue
        anchors, anchor = parent.anchors, parent.anchor
        if not rule.neutral(start, anchor):
            anchors, anchor = (*anchors, start), start
        look = parent.cached
        grid = rule.grid_points(start, end, anchor)
        hasher: Hasher | None = None
        digests: dict[int, bytes] = {}
        if parent.hasher is not None and (look or seg.keep_state or solo):
            digests, end_hasher = advance(parent.hasher, start, seg.token_ids, [*grid, end])
            hasher = end_hasher if seg.keep_state else None
        key = _Keys(cache.fingerprint, anchors, digests)

        hit, entry = start, None
        if look and digests:
            hit, entry = _deepest_hit(cache, seg, [*grid, end], key, functools.partial(_prefix, segments, seg.index))
        points: list[int] = []
        base = parent.depth if hit == start else 0  # the level its first running piece takes
        if digests and (seg.keep_state or solo) and parent.chain is not None:
            points = [
                q for q in _deposit_points(cache, seg, grid, hit, anchor, key, continues) if key(q) not in planned
            ]
            if room is not None:  # each cut is one piece and one level more: keep those that fit
                later = len(segments) - seg.index - 1  # plan segments still to come, a piece each at most
                levels = room.max_depth - base - heights[seg.index]
                cuts = [q for q in points if q < end]  # ascending: the farthest before the end first
                allowed = max(0, min(levels, room.max_sequences - running - 1 - later))
                dropped = set(cuts[: max(0, len(cuts) - allowed)])
                points = [q for q in points if q not in dropped]
            planned.update(key(q) for q in points)
        bounds = sorted({start, end, *(q for q in points if q < end), *([hit] if start < hit < end else [])})
        first = len(pieces)
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            index = len(pieces)
            up = parent.last_piece if index == first else index - 1
            readers = seg.readers if hi == end else ()
            pieces.append((up, seg.token_ids[lo - start : hi - start], lo, readers))
            if hi <= hit:
                done.append(index)
                if hi == hit and entry is not None:
                    states[index] = entry.state
                    if readers:
                        assert entry.score is not None  # _deepest_hit takes none without one
                        scores.extend((r, entry.score) for r in readers)
            if hi in points:
                deposits[index] = key(hi)
                assert parent.chain is not None  # no points below an unreachable end
                requires[index] = parent.chain
        hit_tokens += hit - start
        runs = sum(1 for hi in bounds[1:] if hi > hit)  # its pieces after the hit run
        running += runs
        # its end is reachable when this request keeps it (here or at an identical segment's end),
        # it is cached already, or it was hit
        reachable = parent.chain is not None and end in digests
        if reachable and not (hit == end or key(end) in planned):
            reachable = cache.contains(key(end))
        chain = (*parent.chain, key(end)) if reachable and parent.chain is not None else None
        paths.append(
            _Path(hasher, anchors, anchor, hit == end, len(pieces) - 1, base + runs if hit < end else 0, chain, solo)
        )
    has_child = [False] * len(pieces)
    for up, *_ in pieces:
        if up is not None:
            has_child[up] = True
    out = tuple(
        Segment(i, up, tokens, start, readers, has_child[i]) for i, (up, tokens, start, readers) in enumerate(pieces)
    )
    return Prepared(out, tuple(done), states, tuple(scores), deposits, requires, hit_tokens)


@dataclass(frozen=True)
class _Keys:
    """The keys of one segment's positions (digests: at its grid points and end)."""

    fingerprint: str
    anchors: tuple[int, ...]
    digests: dict[int, bytes]

    def __call__(self, position: int) -> NodeKey:
        return NodeKey(self.fingerprint, self.anchors, position, self.digests[position])


def _deepest_hit(
    cache: StateCache, seg: Segment, candidates: list[int], key: _Keys, prefix: Callable[[int], bytes]
) -> tuple[int, Entry | None]:
    """The deepest cached position of the segment (and its entry), else (start, None)."""
    for position in reversed(candidates):
        found = cache.lookup(key(position), functools.partial(prefix, position))
        if found is None:
            continue
        if position == seg.end_position and seg.readers and found.score is None:
            continue  # its candidates need a score that entry never had
        return position, found
    return seg.start_position, None


def _deposit_points(
    cache: StateCache, seg: Segment, grid: list[int], hit: int, anchor: int, key: _Keys, continues: bool
) -> list[int]:
    """Where this segment leaves states: its end (if its node is at least a grid long: the
    segment, or the long node whose last chunk it is) and up to `deposits_per_segment` grid
    points before it, spaced 1, 2, 4, ... grids back; none at or before the hit, none already
    cached."""
    rule, end = cache.rule, seg.end_position
    # a leaf's end (a whole prompt) serves only an identical prompt: its grid points serve more;
    # a short node's end is left out (it would keep a state at every tiny branch), but a long
    # node's last chunk may be a few tokens, and without its end nothing below it is reachable
    points = [end] if seg.keep_state and (seg.num_tokens >= rule.grid or continues) else []
    for k in range(cache.deposits_per_segment):
        position = rule.floor(end - 1 - rule.grid * ((1 << k) - 1), anchor)
        if position <= hit:
            break
        points.append(position)
    kept = sorted({q for q in points if q > hit and (q == end or q in grid)})
    # an end kept without a score (no reader then) is deposited again when this one reads it
    return [q for q in kept if not cache.contains(key(q)) or (q == end and seg.readers and cache.lacks_score(key(q)))]


def _heights(segments: Sequence[Segment]) -> list[int]:
    """Per segment, the segments on its longest chain down to a leaf, itself included."""
    heights = [1] * len(segments)
    for seg in reversed(segments):  # parents first in the plan, so children are done here
        if seg.parent is not None:
            heights[seg.parent] = max(heights[seg.parent], heights[seg.index] + 1)
    return heights


def _path(segments: Sequence[Segment], index: int) -> list[Sequence[int]]:
    """The token ids of segment `index` and its ancestors, root first."""
    chain: list[Sequence[int]] = []
    at: int | None = index
    while at is not None:
        chain.append(segments[at].token_ids)
        at = segments[at].parent
    return chain[::-1]


def _prefix(segments: Sequence[Segment], index: int, position: int) -> bytes:
    """The tokens before `position` on the path of plan segment `index`."""
    tokens = [t for part in _path(segments, index) for t in part]
    return token_bytes(tokens[:position])
