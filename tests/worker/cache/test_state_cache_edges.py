"""Edges of the state cache that mutation testing found unpinned: the LRU touch of a key deposited
again, the byte budget's boundaries (an entry or a sum exactly at the budget is kept: only one
*larger* than the budget is refused, docs/state-cache.md), and where prepare() cuts, deposits
and hangs a request (checked on plain segments with a store of 1-byte states, no model)."""

from __future__ import annotations

import random

from openjev.worker.cache.keys import CutRule, NodeKey, token_bytes
from openjev.worker.cache.prepare import PassFit, Prepared, prepare
from openjev.worker.cache.sizing import build_state_cache
from openjev.worker.cache.store import StateCache
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner.plan import Reader, Segment


def store(budget: int) -> StateCache:
    # a "state" here is its size in bytes (the entry adds its tokens' bytes)
    return StateCache(budget, "fp", CutRule(anywhere=False), lambda s: (s, s))


def key(position: int) -> NodeKey:
    return NodeKey("fp", (), position, bytes([position % 256]) * 32)


T = {p: token_bytes(range(p)) for p in (10, 20, 30)}  # 40, 80, 120 bytes


def test_a_key_deposited_again_becomes_the_most_recent():
    """A second deposit of a kept key (another request computed the same state) is a use: the
    next eviction takes another entry, not the one just deposited again."""
    cache = store(1000)
    assert cache.insert(key(10), 300, None, T[10])  # 340 bytes
    assert cache.insert(key(20), 300, 1.5, T[20])  # 380 bytes
    assert cache.insert(key(10), 300, None, T[10])  # kept already: no bytes added
    assert cache.nbytes == 720 and cache.num_inserts == 2
    assert cache.insert(key(30), 300, None, T[30])  # 420 more overflows: the least recent goes
    assert [k.position for k in cache._entries] == [10, 30]
    assert cache.num_evictions == 1


def test_an_existing_score_is_not_replaced():
    """An entry takes a deposit's score only where it had none (the same state has the same score),
    and a deposit again, with a score or not, adds no bytes."""
    cache = store(1000)
    assert cache.insert(key(10), 300, 1.5, T[10])
    assert cache.insert(key(10), 300, 2.5, T[10])
    assert cache.lookup(key(10), lambda: T[10]).score == 1.5  # type: ignore[union-attr]
    assert cache.insert(key(20), 300, None, T[20])
    assert cache.lacks_score(key(20)) and not cache.lacks_score(key(10))
    assert cache.insert(key(20), 300, 0.5, T[20])
    assert not cache.lacks_score(key(20)) and cache.lookup(key(20), lambda: T[20]).score == 0.5  # type: ignore[union-attr]
    assert cache.nbytes == 340 + 380 and cache.num_inserts == 2


def test_an_entry_exactly_the_budget_is_kept():
    """Only an entry *larger* than the whole budget is refused: one of exactly its bytes is kept."""
    cache = store(340)
    assert cache.insert(key(10), 300, None, T[10])
    assert cache.nbytes == 340 == cache.budget_bytes and len(cache) == 1
    assert not store(339).insert(key(10), 300, None, T[10])


def test_entries_filling_the_budget_exactly_evict_nothing():
    """Entries whose bytes sum to exactly the budget are all kept, nothing evicted; a third one
    evicts the least recent ones until it fits."""
    cache = store(720)
    assert cache.insert(key(10), 300, None, T[10])
    assert cache.insert(key(20), 300, None, T[20])
    assert cache.nbytes == 720 and len(cache) == 2 and cache.num_evictions == 0
    assert cache.insert(key(30), 300, None, T[30])
    assert [k.position for k in cache._entries] == [30] and cache.num_evictions == 2


def test_a_chain_filling_the_budget_exactly_is_kept():
    """An entry whose requirements and itself fill the budget exactly fits beside them (only a
    chain larger than the budget is refused without evicting)."""
    cache = store(720)
    assert cache.insert(key(10), 300, None, T[10])
    assert cache.insert(key(20), 300, None, T[20], requires=(key(10),))
    assert cache.nbytes == 720 and [k.position for k in cache._entries] == [20, 10]
    cache = store(719)
    assert cache.insert(key(10), 300, None, T[10])
    assert not cache.insert(key(20), 300, None, T[20], requires=(key(10),))
    assert [k.position for k in cache._entries] == [10]


def test_every_requirement_must_be_kept():
    """An entry is inserted only while *all* the ends it requires are kept: one of two missing
    leaves it unreachable."""
    cache = store(10_000)
    assert cache.insert(key(10), 100, None, T[10])
    assert not cache.insert(key(30), 100, None, T[30], requires=(key(10), key(20)))
    assert not cache.contains(key(30)) and cache.nbytes == 140


def test_evicted_keys_leave_no_dependents_behind():
    """The reverse index (what requires a key) drops an evicted key: a worker that keeps evicting
    must not grow it without bound."""
    cache = store(1000)
    for round_ in range(5):
        root = NodeKey("fp", (), 10, bytes([round_]) * 32)
        child = NodeKey("fp", (), 20, bytes([round_]) * 32)
        assert cache.insert(root, 300, None, T[10])
        assert cache.insert(child, 300, None, T[20], requires=(root,))
    assert cache.num_evictions > 0
    assert set(cache._dependents) <= set(cache._entries)


def test_clear_forgets_every_byte_and_requirement():
    """After clear() the whole budget is free again (an insert of it evicts nothing) and no
    requirement of a dropped entry lingers; hits are counted across calls."""
    cache = store(720)
    assert cache.insert(key(10), 300, None, T[10])
    assert cache.insert(key(20), 300, None, T[20], requires=(key(10),))
    cache.clear()
    assert cache.nbytes == 0 and len(cache) == 0 and not cache._dependents
    assert cache.insert(key(30), 600, None, T[30]) and cache.num_evictions == 0
    cache.record_hit(64)
    cache.record_hit(128)
    assert (cache.num_hits, cache.hit_tokens) == (2, 192)


# ---- prepare(): plain segments, a store of 1-byte states, deposits "run" by inserting them ----


def cache_of(deposits_per_segment: int = 4) -> StateCache:
    # the torch runner's rule (cuts on a grid from each anchor) and room for every state
    return StateCache(
        1 << 40, "t", CutRule(anywhere=False), lambda state: (state, 1), deposits_per_segment=deposits_per_segment
    )


def tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 5000) for _ in range(n))


def shared_node(length: int, leaves: int = 2, tail: int = 5, seed: int = 1) -> list[Segment]:
    """A root node of `length` tokens and `leaves` leaves under it, each read by one candidate."""
    root = Segment(0, None, tokens(seed, length), 0, (), True)
    return [root] + [
        Segment(i + 1, 0, tokens(seed + 1 + i, tail), length, (Reader(0, i),), False) for i in range(leaves)
    ]


def deposited(prepared: Prepared) -> list[int]:
    return sorted(k.position for k in prepared.deposits.values())


def run(prepared: Prepared, cache: StateCache) -> None:
    """What the scheduler does with each deposit once its piece ran: keep its state (and the head
    score where the piece is read), requiring the ends above it."""
    for index, node in prepared.deposits.items():
        score = 0.25 if prepared.segments[index].readers else None
        state = ("state", node.position)
        assert cache.insert(node, state, score, prepared.prefix_tokens(index), prepared.requires[index])


def test_a_node_exactly_a_grid_long_keeps_its_end():
    """A branch node of exactly one grid (64 tokens) is long enough to keep its end; shorter
    ones are not (a state at every tiny branch)."""
    assert deposited(prepare(shared_node(64), cache_of())) == [64]
    assert deposited(prepare(shared_node(63), cache_of())) == []


def test_grid_deposits_go_back_1_2_4_8_grids_from_the_end():
    """A branch node's deposits: its end and the last grid point before it, then ever farther
    back, 1, 2, 4, ... grids, `deposits_per_segment` of them; an end on the grid is not counted
    as the last grid point before itself."""
    assert deposited(prepare(shared_node(1024), cache_of())) == [512, 768, 896, 960, 1024]
    assert deposited(prepare(shared_node(1000), cache_of())) == [512, 768, 896, 960, 1000]
    assert deposited(prepare(shared_node(1024), cache_of(deposits_per_segment=2))) == [896, 960, 1024]
    assert deposited(prepare(shared_node(1024), cache_of(deposits_per_segment=0))) == [1024]


def test_deposit_cuts_fill_a_pass_exactly_and_no_more():
    """A plan of exactly a pass's segments still fits one pass once cut (a cut is a piece more):
    with no room left it deposits only the node's end, and each segment of room more takes one
    cut more, the grid points nearest the end first."""
    segments = shared_node(1000, leaves=3)  # 4 segments, 2 levels
    cut = {n: prepare(segments, cache_of(), PassFit(n, 8)) for n in (4, 5, 6)}
    assert [len(p.segments) for p in cut.values()] == [4, 5, 6]
    assert [deposited(p) for p in cut.values()] == [[1000], [960, 1000], [896, 960, 1000]]
    # a plan of more segments than a pass takes several passes anyway: every cut is kept
    assert deposited(prepare(segments, cache_of(), PassFit(3, 8))) == [512, 768, 896, 960, 1000]


def test_deposit_cuts_fill_a_pass_s_levels_exactly_and_no_more():
    """Likewise for tree levels: each cut above the leaves is a level more."""
    segments = shared_node(1000, leaves=3)  # 2 levels
    got = [deposited(prepare(segments, cache_of(), PassFit(64, depth))) for depth in (2, 3, 4)]
    assert got == [[1000], [960, 1000], [896, 960, 1000]]
    assert deposited(prepare(segments, cache_of(), PassFit(64, 1))) == [512, 768, 896, 960, 1000]


def test_only_a_prompt_that_runs_alone_deposits_in_its_leaf():
    """A leaf deposits grid states only where its prompt runs alone from the start: the root, or
    the last piece of a long prompt cut in chunks. A leaf under a node another candidate ends at
    (a reader) or that branches (two children), or a chunk of a node under a branch, does not:
    a later request hangs at that node's end."""
    root, leaf = tokens(3, 300), tokens(4, 300)

    def positions(segments: list[Segment]) -> list[int]:
        return deposited(prepare(segments, cache_of()))

    chunks = [Segment(0, None, root, 0, (), True), Segment(1, 0, leaf, 300, (Reader(0, 0),), False)]
    assert positions(chunks) == [64, 192, 256, 300, 364, 492, 556]
    read = [Segment(0, None, root, 0, (Reader(0, 0),), True), Segment(1, 0, leaf, 300, (Reader(0, 1),), False)]
    assert positions(read) == [64, 192, 256, 300]
    branch = [Segment(0, None, root, 0, (), True)] + [
        Segment(i, 0, tokens(4 + i, 300), 300, (Reader(0, i),), False) for i in (1, 2)
    ]
    assert positions(branch) == [64, 192, 256, 300]
    # a 500-token prompt under the branch point, cut in chunks of 200 and 300: the chunk
    # deposits as a node does, the last piece (not alone from its start) does not
    under = [
        *branch[:2],
        Segment(2, 0, tokens(8, 200), 300, (), True),
        Segment(3, 2, leaf, 500, (Reader(0, 2),), False),
    ]
    assert positions(under) == [64, 192, 256, 300, 428, 492, 500]  # 300 + 64k: a grid anchored at the branch


def test_a_request_hangs_from_the_deepest_state_it_shares():
    """A second request sharing 900 of the first's 1,024 tokens hangs from the state at 896 (the
    deepest grid point it shares): that piece is done, its state handed over, the 4 tokens after
    it run, and its end is deposited; a repeat of it hangs at its end, where its leaves run."""
    cache = cache_of()
    first = shared_node(1024)
    run(prepare(first, cache), cache)
    second = [Segment(0, None, first[0].token_ids[:900], 0, (), True), *shared_node(900, seed=50)[1:]]
    got = prepare(second, cache)
    assert (got.hit_tokens, got.done, got.states) == (896, (0,), {0: ("state", 896)})
    assert [(s.start_position, s.num_tokens, s.parent) for s in got.segments[:2]] == [(0, 896, None), (896, 4, 0)]
    assert deposited(got) == [900] and got.scores == ()
    run(got, cache)
    again = prepare(second, cache)
    assert (again.hit_tokens, again.done, again.states, again.deposits) == (900, (0,), {0: ("state", 900)}, {})
    assert [s.start_position for s in again.segments] == [0, 900, 900]


def test_a_hit_at_a_read_end_needs_and_answers_its_score():
    """A node's end kept without a head score cannot answer a candidate that ends there: the
    lookup falls back a grid and the end is deposited again, with the score; then a repeat
    takes the candidate's score from the cache. Readers stay on a segment's last piece."""
    cache = cache_of()
    node, leaf = tokens(3, 300), tokens(4, 300)
    unread = [Segment(0, None, node, 0, (), True), Segment(1, 0, leaf, 300, (Reader(0, 0),), False)]
    run(prepare(unread, cache), cache)
    read = [Segment(0, None, node, 0, (Reader(0, 0),), True), Segment(1, 0, leaf, 300, (Reader(0, 1),), False)]
    got = prepare(read, cache)
    assert (got.hit_tokens, got.scores, deposited(got)) == (256, (), [300])
    assert [bool(s.readers) for s in got.segments] == [False, True, True]
    run(got, cache)
    again = prepare(read, cache)
    assert (again.done, again.scores, again.deposits) == ((0, 1), ((Reader(0, 0), 0.25),), {})
    assert again.hit_tokens == 556  # and the leaf below hangs from the first request's 556


def test_deposits_below_a_node_require_its_end():
    """The deposits of a node under a branch point require the branch point's end (a lookup
    passes it on the way down), the root's require nothing: evicting that end drops them all."""
    cache = cache_of()
    root, node = tokens(3, 1024), tokens(4, 300)
    segments = [
        Segment(0, None, root, 0, (), True),
        Segment(1, 0, node, 1024, (), True),
        Segment(2, 0, tokens(5, 5), 1024, (Reader(0, 0),), False),
        *(Segment(i, 1, tokens(3 + i, 5), 1324, (Reader(0, i),), False) for i in (3, 4)),
    ]
    got = prepare(segments, cache)
    by_position = {k.position: got.requires[i] for i, k in got.deposits.items()}
    end = next(k for k in got.deposits.values() if k.position == 1024)
    assert sorted(by_position) == [512, 768, 896, 960, 1024, 1088, 1216, 1280, 1324]
    assert all(by_position[p] == () for p in (512, 768, 896, 960, 1024))
    assert all(by_position[p] == (end,) for p in (1088, 1216, 1280, 1324))
    run(got, cache)
    cache._evict(end)
    assert sorted(k.position for k in cache._entries) == [512, 768, 896, 960]


def test_a_piece_taken_from_the_cache_leaves_its_room_in_the_pass_to_cuts():
    """Room for deposit cuts counts the pieces that run: the piece a request hangs from is done,
    so the node below its hit still gets the one cut a pass of 5 leaves it."""
    cache = cache_of()
    first = shared_node(1024)
    run(prepare(first, cache), cache)
    second = [
        Segment(0, None, first[0].token_ids[:900], 0, (), True),  # hits 896; its 4 tokens after run
        Segment(1, 0, tokens(60, 300), 900, (), True),
        *(Segment(i, 1, tokens(60 + i, 5), 1200, (Reader(0, i),), False) for i in (2, 3)),
    ]
    got = prepare(second, cache, PassFit(5, 8))
    assert got.hit_tokens == 896
    assert len(got.segments) - len(got.done) == 5
    assert deposited(got) == [900, 1156, 1200]  # the node starts a grid at 900


def test_a_node_under_computed_work_deposits_only_what_is_not_kept():
    """A node whose parent runs (no lookup below it) leaves no state the cache holds already: its
    end and grid states were kept by an earlier request, so it is not cut again for them."""
    cache = cache_of()
    root, node = tokens(3, 1024), tokens(4, 300)
    leaves = [Segment(i, 1, tokens(3 + i, 5), 1324, (Reader(0, i),), False) for i in (2, 3)]
    run(prepare([Segment(0, None, root, 0, (), True), Segment(1, 0, node, 1024, (), True), *leaves], cache), cache)
    # the root is read now and its end has no score: it runs from 960, so nothing below it is looked up
    read = [Segment(0, None, root, 0, (Reader(0, 0),), True), Segment(1, 0, node, 1024, (), True), *leaves]
    got = prepare(read, cache)
    assert got.hit_tokens == 960 and deposited(got) == [1024]
    assert [s.start_position for s in got.segments] == [0, 960, 1024, 1324, 1324]


def test_one_request_deposits_a_state_once():
    """Two questions over the same prompt (unshared segments of one request) deposit its states
    once: the second plans no cut for a state the first will leave."""
    root = tokens(3, 1024)
    segments = [
        Segment(0, None, root, 0, (), True),
        Segment(1, 0, tokens(4, 5), 1024, (Reader(0, 0),), False),
        Segment(2, None, root, 0, (), True),
        Segment(3, 2, tokens(5, 5), 1024, (Reader(1, 0),), False),
    ]
    got = prepare(segments, cache_of())
    assert deposited(got) == [512, 768, 896, 960, 1024]
    assert [s.start_position for s in got.segments if s.parent is None] == [0, 0]


# ---- the engine: what a hit saves is what the runner does not compute ----


class _Counting:
    """The demo model's torch runner, counting the tokens each pass computes."""

    def __init__(self, runner):
        self._runner = runner
        self.tokens = 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run_launch(self, runs):
        self.tokens += sum(len(r.token_ids) for r in runs)
        return self._runner.run_launch(runs)


def test_the_tokens_a_hit_counts_are_not_computed(torch_runner):
    """A request hanging from cached states computes its plan's tokens less the hit's (a hit
    that recomputed the piece it was handed, reporting it skipped, answered the same bits)."""
    state = list(tokens(9, 700))
    asks = [
        [QuestionWork("choice", tuple(tuple(state + list(tokens(seed + c, 6))) for c in range(3)))] for seed in (10, 20)
    ]
    counting = _Counting(torch_runner)
    engine = Engine(counting, state_cache=build_state_cache(counting, 256 << 20, "t"))
    engine.execute(asks[0], temperature=2.0, policy="shared")
    counting.tokens = 0
    got = engine.execute(asks[1], temperature=2.0, policy="shared")
    assert got.cache_hit_tokens == 700
    assert counting.tokens == got.num_computed_tokens - got.cache_hit_tokens == 3 * 6
    assert got.head_scores == Engine(torch_runner).execute(asks[1], temperature=2.0, policy="shared").head_scores
