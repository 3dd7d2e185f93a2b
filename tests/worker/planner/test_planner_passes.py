"""fill_pass: which waiting segments of several requests one pass takes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from openjev.worker.planner import passes
from openjev.worker.planner.passes import PendingTree, Picked, StateRoom, fill_pass, kept_after_pass, pack_passes
from openjev.worker.planner.plan import PackLimits, Reader, Segment

LIMITS = PackLimits(max_sequences=64, max_tokens=4096, chunk_tokens=2048)


def _star(root_tokens: int, tails: list[int]) -> PendingTree:
    """A root segment and its tails (one candidate each)."""
    segments = [Segment(0, None, tuple(range(root_tokens)), 0, (), True)]
    for n, tokens in enumerate(tails, start=1):
        segments.append(Segment(n, 0, tuple(range(tokens)), root_tokens, (Reader(0, n - 1),), False))
    return PendingTree(segments)


def _taken(picked, owner: int) -> list[int]:
    return [p.segment for p in picked if p.owner == owner]


def test_a_request_of_many_candidates_leaves_room_for_the_one_behind_it():
    """640 tails of 3 tokens use 64 segments and ~250 tokens a pass: a one-segment request
    waiting behind them rides in the first pass instead of after ten of them."""
    wide, small = _star(50, [3] * 640), _star(7, [])
    picked = fill_pass([wide, small], LIMITS, max_depth=8, tokens_per_request=LIMITS.chunk_tokens)
    assert _taken(picked, 1) == [0]
    assert len(picked) == LIMITS.max_sequences  # the wide one still fills the rest


def test_two_requests_of_many_candidates_leave_room_for_the_one_behind_them():
    """Two requests of 640 tails took 32 segments each in the first round, all 64 of a pass,
    and a one-segment request behind them first ran in pass 21 (found by a review). The segment
    share is halved like the token share: the small request rides in the first pass, the pass
    stays full."""
    wide1, wide2, small = _star(50, [3] * 640), _star(50, [3] * 640), _star(7, [])
    picked = fill_pass([wide1, wide2, small], LIMITS, max_depth=8, tokens_per_request=LIMITS.chunk_tokens)
    assert _taken(picked, 2) == [0]
    assert len(_taken(picked, 1)) == 16 and len(picked) == LIMITS.max_sequences  # half of what was left


def test_a_tree_that_fits_beside_the_others_runs_whole():
    """A 3,700-token tree and a 10-token request fit one pass of 4,096 tokens together: the
    per-request share (2,048 tokens) is a first round, not a cap that splits the tree in two."""
    tree, small = _star(1000, [900, 900, 900]), _star(10, [])
    picked = fill_pass([tree, small], LIMITS, max_depth=8, tokens_per_request=LIMITS.chunk_tokens)
    assert sorted(_taken(picked, 0)) == [0, 1, 2, 3] and _taken(picked, 1) == [0]
    positions = {(p.owner, p.segment): i for i, p in enumerate(picked)}
    assert all(p.parent_in_pass is None or p.parent_in_pass < positions[(p.owner, p.segment)] for p in picked)


def test_the_first_round_share_still_holds_back_a_long_prompt():
    """Chunks of a long prompt: in the first round it takes one chunk (its share), the short
    request behind it gets in, and the second round adds no chunk that does not fit."""
    chunks = [Segment(i, i - 1 if i else None, tuple(range(2048)), 2048 * i, (), True) for i in range(8)]
    long, short = PendingTree(chunks), _star(5, [])
    picked = fill_pass([long, short], LIMITS, max_depth=8, tokens_per_request=LIMITS.chunk_tokens)
    assert _taken(picked, 0) == [0] and _taken(picked, 1) == [0]


def test_a_shared_pass_holds_at_most_its_shared_tokens():
    """With shared_tokens, a pass that several requests wait for stops there: a long prompt's
    1,024-token chunks and short requests beside them share passes of at most 2,048 tokens, so
    each pass (and each short request riding in it) is over sooner; alone, the long prompt's
    chunks fill the whole budget as before."""
    limits = PackLimits(max_sequences=64, max_tokens=4096, chunk_tokens=1024, shared_tokens=2048)
    chain = [Segment(i, i - 1 if i else None, tuple(range(1024)), 1024 * i, (), True) for i in range(16)]

    def queue() -> list[PendingTree]:
        return [PendingTree(chain)] + [_star(300, [40, 40]) for _ in range(5)]

    def tokens(trees: list[PendingTree], picked) -> int:
        return sum(trees[p.owner].segments[p.segment].num_tokens for p in picked)

    trees = queue()
    picked = fill_pass(trees, limits, 8, limits.chunk_tokens)
    assert tokens(trees, picked) <= 2048 and _taken(picked, 0) == [0] and _taken(picked, 1) == [0, 1, 2]
    trees = queue()
    assert tokens(trees, fill_pass(trees, LIMITS, 8, LIMITS.chunk_tokens)) > 2048  # without the cap
    alone = fill_pass([PendingTree(chain)], limits, 8)
    assert _taken(alone, 0) == [0, 1, 2, 3]  # one request: the whole budget


def test_shared_tokens_lie_between_the_chunk_and_the_budget():
    """A chunk longer than the shared pass would never run beside another request."""
    for shared in (512, 8192):
        with pytest.raises(ValueError, match="shared_tokens"):
            PackLimits(max_tokens=4096, chunk_tokens=1024, shared_tokens=shared)
    assert PackLimits(max_tokens=4096, chunk_tokens=1024, shared_tokens=1024).pass_tokens_shared == 1024
    assert PackLimits(max_tokens=4096, chunk_tokens=1024).pass_tokens_shared == 4096


def _hanging(start: int, tail: int) -> PendingTree:
    """A request whose first segment ran in an earlier pass (or came from the cache): its next
    one reads that parent's state."""
    tree = _star(start, [tail])
    tree.mark_done(0)
    return tree


def test_a_pass_reads_at_most_its_room_of_parents_states():
    """12 requests each continue a state of 300 tokens: a pass with room for 8 parents' states
    takes 8 (the first ones), one with room for 1,000 ancestor rows takes 3; unbounded, all 12."""
    trees = [_hanging(300, 20) for _ in range(12)]
    share = LIMITS.chunk_tokens
    assert len(fill_pass(trees, LIMITS, 8, share)) == 12
    picked = fill_pass(trees, LIMITS, 8, share, StateRoom(states=8, context=10**6))
    assert [p.owner for p in picked] == list(range(8))
    picked = fill_pass(trees, LIMITS, 8, share, StateRoom(states=8, context=1000))
    assert [p.owner for p in picked] == [0, 1, 2]


def test_a_pass_keeps_at_most_its_room_of_states():
    """Ten 100-token contexts, listed before their two 10-token candidates each: a pass of 1,040
    tokens holds the contexts and 4 candidates, so 8 contexts would be kept for a later pass.
    With room for 3 kept states the pass drops its last segments until 3 are left to keep."""
    segments = [Segment(i, None, tuple(range(100)), 0, (), True) for i in range(10)]
    for c in range(20):
        segments.append(Segment(10 + c, c // 2, tuple(range(10)), 100, (Reader(c, 0),), False))
    limits = PackLimits(max_sequences=64, max_tokens=1040, chunk_tokens=1040)

    def kept(picked):
        tree = PendingTree(segments)
        return kept_after_pass(tree, {p.segment for p in picked})

    assert len(kept(fill_pass([PendingTree(segments)], limits, 8))) == 8
    picked = fill_pass([PendingTree(segments)], limits, 8, room=StateRoom(states=3, context=10**6))
    assert len(kept(picked)) == 3
    positions = {p.segment: i for i, p in enumerate(picked)}
    assert all(p.parent_in_pass is None or p.parent_in_pass < positions[p.segment] for p in picked)


def test_two_long_prompts_leave_room_for_a_short_request_behind_them():
    """Two requests each continuing a long prompt by a 2,048-token chunk took the whole
    4,096-token pass between them, pass after pass, and a 20-token request behind them waited
    for the first to finish. A request's first share is at most half of what the pass has left
    while others wait behind it: the first chunk and the short request run, the second chunk
    waits its turn."""
    long1, long2, short = _hanging(2048, 2048), _hanging(2048, 2048), _star(20, [])
    picked = fill_pass([long1, long2, short], LIMITS, 8, LIMITS.chunk_tokens)
    assert (_taken(picked, 0), _taken(picked, 1), _taken(picked, 2)) == ([1], [], [0])


def test_a_chunk_over_half_the_pass_still_runs_first():
    """With chunks as large as the pass (allowed, warned: chunk_fills_pass; the transformers
    backend's whole prompts), the first request's chunk keeps its whole share even though the
    halving caps the others: one short request arriving each pass does not hold an 8-chunk
    request back for good."""
    limits = PackLimits(max_sequences=64, max_tokens=2048, chunk_tokens=2048)
    chain = [Segment(i, i - 1 if i else None, tuple(range(2048)), 2048 * i, (), i < 7) for i in range(8)]
    chain[-1] = Segment(7, 6, tuple(range(2048)), 2048 * 7, (Reader(0, 0),), False)
    long = PendingTree(chain)
    queue = [long, _star(30, [])]
    for _ in range(8):
        picked = fill_pass(queue, limits, 8, limits.chunk_tokens)
        for p in picked:
            queue[p.owner].mark_done(p.segment)
        queue = [t for t in queue if not t.finished] + [_star(30, [])]
    assert long.finished


def test_an_empty_pass_takes_a_parent_state_beyond_its_room():
    """A segment whose parent's rows alone exceed the room (a prompt longer than the runner's
    context budget) still runs, in a pass of its own: it would otherwise never run."""
    picked = fill_pass([_hanging(3000, 20), _hanging(300, 20)], LIMITS, 8, None, StateRoom(states=8, context=1000))
    assert [p.owner for p in picked] == [0]


def test_the_room_left_goes_first_to_requests_the_first_round_skipped():
    """A long prompt's chunk and five 600-token requests in arrival order: the first round gives
    S1 and S2 their share and skips S3-S5 (over half the room left); the room left then goes to S3,
    the earliest of them, not to the last to arrive (which the first round once let take it)."""
    chunks = [Segment(i, i - 1 if i else None, tuple(range(2048)), 2048 * i, (), True) for i in range(4)]
    trees = [PendingTree(chunks)] + [_star(600, []) for _ in range(5)]
    picked = fill_pass(trees, LIMITS, max_depth=8, tokens_per_request=LIMITS.chunk_tokens)
    assert sorted({p.owner for p in picked}) == [0, 1, 2, 3]


class _CountedSegments(Sequence):
    """A request's segments that count how many a pass's scan looks at."""

    def __init__(self, segments: list[Segment]):
        self.segments, self.looked_at = segments, 0

    def __len__(self) -> int:
        return len(self.segments)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            return self.segments[key]

        def walk():
            for segment in self.segments[key]:
                self.looked_at += 1
                yield segment

        return walk()


def test_a_full_pass_stops_scanning_where_nothing_left_fits():
    """60,000 candidates of 65 tokens, unshared: 63 fill 4,095 of the 4,096 tokens, and the scan
    ends at the next one instead of walking the other 59,936 (every pass, quadratic over the
    request: 22 s to plan such a request and ~40 ms a pass)."""
    segments = _CountedSegments([Segment(i, None, tuple(range(65)), 0, (Reader(i, 0),), False) for i in range(60_000)])
    picked = fill_pass([PendingTree(segments)], LIMITS, max_depth=1)
    assert len(picked) == 63 and segments.looked_at == 64


def test_the_room_left_goes_to_a_skipped_request_before_one_that_took_its_share():
    """A 4,000-token star takes 2,000 tokens of its 2,048 share (root and one child); a 1,500-token request
    behind it is over half the room left and is skipped; in the second round the skipped one
    comes first, so it rides in this pass instead of the star taking all of it."""
    picked = fill_pass([_star(1000, [1000] * 3), _star(1500, [])], LIMITS, 8, LIMITS.chunk_tokens)
    assert (_taken(picked, 0), _taken(picked, 1)) == ([0, 1], [0])


def test_the_first_round_share_holds_back_a_segment_that_fits_the_pass():
    """The star's 2,000-token child fits the pass but not the 1,048 tokens left of its share: it
    waits (its 10-token sibling behind it does not), and the 1,500-token request behind gets half
    the room left (taking the child first left it 543)."""
    picked = fill_pass([_star(1000, [2000, 10]), _star(1500, [])], LIMITS, 8, LIMITS.chunk_tokens)
    assert (_taken(picked, 0), _taken(picked, 1)) == ([0, 2], [0])


def test_the_first_round_share_holds_back_a_segment_over_half_the_pass_segments():
    """With 2 sequences a pass, a request's first share is 1 segment: its root runs, and the
    request behind it takes the other slot before the root's children."""
    limits = PackLimits(max_sequences=2, max_tokens=4096, chunk_tokens=2048)
    picked = fill_pass([_star(10, [5, 5]), _star(10, [])], limits, 8, limits.chunk_tokens)
    assert (_taken(picked, 0), _taken(picked, 1)) == ([0], [0])


def test_parents_rows_may_fill_the_context_room_exactly():
    """Two parents of 500 rows each fill a room of 1,000 rows: both run (at most `context`);
    one row more and the second waits."""
    room = StateRoom(states=8, context=1000)
    picked = fill_pass([_hanging(500, 20), _hanging(500, 20)], LIMITS, 8, LIMITS.chunk_tokens, room)
    assert [p.owner for p in picked] == [0, 1]
    picked = fill_pass([_hanging(500, 20), _hanging(501, 20)], LIMITS, 8, LIMITS.chunk_tokens, room)
    assert [p.owner for p in picked] == [0]


def test_siblings_reading_one_earlier_parent_take_one_state():
    """Two candidates continue the same 300-token context that ran earlier: its state is one of
    the room's states whoever reads it, so with room for one both run."""
    tree = PendingTree(_star(300, [20, 20]).segments)
    tree.mark_done(0)
    picked = fill_pass([tree], LIMITS, 8, room=StateRoom(states=1, context=10**6))
    assert _taken(picked, 0) == [1, 2]


def test_a_pass_with_no_room_to_keep_states_still_runs_its_first_segment():
    """A long prompt's chunks with no room for kept states: the pass drops back to its first
    chunk, which keeps one state (the most a lone segment can), never to an empty pass."""
    chunks = [Segment(i, i - 1 if i else None, tuple(range(2048)), 2048 * i, (), True) for i in range(4)]
    picked = fill_pass([PendingTree(chunks)], LIMITS, 8, room=StateRoom(states=0, context=10**6))
    assert picked == [Picked(0, 0, None)]


def test_pack_passes_refuses_segments_over_the_budget_or_before_their_parent(monkeypatch):
    """Either would never run (pack_passes would loop for good): refused before any pass is
    filled."""

    def no_pass(*args, **kwargs):
        raise AssertionError("filled a pass for input that should be refused")

    limits = PackLimits(max_sequences=8, max_tokens=256, chunk_tokens=128)
    fits = Segment(0, None, tuple(range(256)), 0, (Reader(0, 0),), False)
    assert pack_passes([fits], limits, 8) == [(0,)]
    monkeypatch.setattr(passes, "fill_pass", no_pass)
    with pytest.raises(ValueError, match="257 tokens > 256"):
        pack_passes([Segment(0, None, tuple(range(257)), 0, (Reader(0, 0),), False)], limits, 8)
    root = Segment(0, None, (1, 2), 0, (), True)
    for parent in (1, 2):  # itself, or a later segment
        child = Segment(1, parent, (3, 4), 2, (Reader(0, 0),), False)
        with pytest.raises(ValueError, match="parents before children"):
            pack_passes([root, child], limits, 8)
