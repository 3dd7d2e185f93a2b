"""Packing: limits hold, parents run in an earlier pass or the same one, nothing is lost or run twice."""

import random
import sys
import tracemalloc
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openjev.contract.literals import PREFIX_POLICIES
from openjev.worker.planner import CostModel, PackLimits, build_tree, plan_request
from openjev.worker.planner.packing import split_into_segments
from openjev.worker.planner.passes import pack_passes
from openjev.worker.planner.plan import Reader, default_chunk_tokens
from openjev.worker.planner.tree import TreeNode

BALANCED = CostModel(seconds_per_launch=1e-3, seconds_per_token=1e-5, seconds_per_attention_pair=1e-9)


def check_launches(plan, limits, max_depth=1 << 16):
    launch_of = {}
    for n, launch in enumerate(plan.launches):
        assert 1 <= len(launch) <= limits.max_sequences
        assert sum(plan.segments[i].num_tokens for i in launch) <= limits.max_tokens
        for i in launch:
            assert i not in launch_of, "a segment runs twice"
            launch_of[i] = n
    assert sorted(launch_of) == list(range(len(plan.segments)))
    for launch in plan.launches:  # levels inside one pass stay within the runner's depth
        depth = {}
        for i in launch:
            parent = plan.segments[i].parent
            depth[i] = depth[parent] + 1 if parent in depth else 0
            assert depth[i] < max_depth
    for s in plan.segments:
        assert s.index == list(plan.segments).index(s)
        assert 0 < s.num_tokens <= limits.chunk_tokens
        if s.parent is not None:
            assert launch_of[s.parent] <= launch_of[s.index], "a parent runs in an earlier pass or the same one"
            parent = plan.segments[s.parent]
            assert s.start_position == parent.end_position
        else:
            assert s.start_position == 0
        has_child = any(t.parent == s.index for t in plan.segments)
        assert s.keep_state == has_child
        assert s.readers or has_child, "a segment nobody reads is wasted work"


def test_long_node_becomes_a_chain():
    node = TreeNode(None, 0, array("I", range(10)), (Reader(0, 0),))
    child = TreeNode(0, 10, array("I", [7]), (Reader(0, 1),))
    segments = split_into_segments([node, child], chunk_tokens=4)
    assert [(s.parent, s.start_position, s.num_tokens, s.readers, s.keep_state) for s in segments] == [
        (None, 0, 4, (), True),
        (0, 4, 4, (), True),
        (1, 8, 2, (Reader(0, 0),), True),  # only the last piece is read
        (2, 10, 1, (Reader(0, 1),), False),
    ]
    # Four tokens a pass: the chain runs one piece per pass, the child in its parent's pass.
    assert pack_passes(segments, PackLimits(max_sequences=16, max_tokens=4, chunk_tokens=4), 8) == [(0,), (1,), (2, 3)]
    # A runner that holds one level per pass: the child waits for the next pass.
    limits = PackLimits(max_sequences=16, max_tokens=4, chunk_tokens=4)
    assert pack_passes(segments, limits, 1) == [(0,), (1,), (2,), (3,)]


def test_a_tree_that_fits_runs_in_one_pass():
    prefix = list(range(100, 160))
    candidates = [[prefix + [1, c] for c in range(5)], [prefix + [2, 7]]]
    plan = plan_request(candidates, "shared", PackLimits())
    assert len(plan.segments) > 1 and plan.num_launches == 1
    # one level per pass: a weight read per tree depth
    assert plan_request(candidates, "shared", PackLimits(), max_pass_depth=1).num_launches == 3


def test_sequence_limit_splits_launches():
    candidates = [[[q, c] for c in range(20)] for q in range(3)]  # 60 two-token prompts
    plan = plan_request(candidates, "off", PackLimits(max_sequences=16, max_tokens=4096))
    assert [len(launch) for launch in plan.launches] == [16, 16, 16, 12]


def test_token_limit_lets_smaller_segments_fill_the_room():
    candidates = [[[1] * 3000, [2] * 3000, [3] * 1000, [4] * 1000, [5] * 96]]
    limits = PackLimits(max_sequences=16, max_tokens=4096, chunk_tokens=4096)
    plan = plan_request(candidates, "off", limits)
    check_launches(plan, limits)
    # in order, skipping what does not fit: 3000+1000+96, then 3000+1000
    assert plan.launches == ((0, 2, 4), (1, 3))


token = st.integers(min_value=0, max_value=3)


@st.composite
def requests(draw):
    """Prompts drawn from a small alphabet over a few stems, so tries branch a lot."""
    # Stems up to 150 tokens so that 64-token boundaries (fixed) are crossed and shared.
    stems = draw(st.lists(st.lists(token, min_size=0, max_size=150), min_size=1, max_size=3))
    questions = []
    for _ in range(draw(st.integers(1, 4))):
        question = []
        for _ in range(draw(st.integers(1, 6))):
            stem = draw(st.sampled_from(stems))
            tail = draw(st.lists(token, min_size=0, max_size=30))
            question.append(stem + tail if stem + tail else [0])
        questions.append(question)
    return questions


@settings(max_examples=150, deadline=None)
@given(
    requests(),
    st.sampled_from(PREFIX_POLICIES),
    st.integers(1, 5),
    st.integers(8, 80),
    st.integers(1, 4),
)
def test_random_tries_respect_limits_and_account_exactly(candidates, policy, max_sequences, max_tokens, max_depth):
    limits = PackLimits(max_sequences=max_sequences, max_tokens=max_tokens, chunk_tokens=max_tokens)
    plan = plan_request(candidates, policy, limits, BALANCED, max_pass_depth=max_depth)
    check_launches(plan, limits, max_depth)
    # Each candidate's path from the root spells its prompt.
    for s in plan.segments:
        for r in s.readers:
            tokens, node = [], s
            while node is not None:
                tokens = list(node.token_ids) + tokens
                node = None if node.parent is None else plan.segments[node.parent]
            assert tokens == list(candidates[r.question][r.candidate])
    assert plan.num_submitted_tokens == sum(len(t) for q in candidates for t in q)
    assert plan.num_saved_tokens == plan.num_submitted_tokens - plan.num_computed_tokens
    off = plan_request(candidates, "off", limits)
    shared = plan_request(candidates, "shared", limits)
    # The full trie computes least; fixed and default can only share less.
    assert shared.num_computed_tokens <= plan.num_computed_tokens <= off.num_computed_tokens
    if plan.executed_policy == "fixed":
        for node in build_tree(candidates, "fixed"):
            assert node.start_position % 64 == 0
    if plan.executed_policy in ("off", "default"):
        assert plan.scope != "across_questions"


def test_planned_segments_hold_four_bytes_an_id():
    """A planned request keeps its segments until it ends. As tuples of Python ints (36 bytes an
    id) a request at the worker's default token limit held 145 MiB under `off`, where the limit
    counts 16 MiB; the ids are kept as array('I'), with the same tokens in the same order."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 240000) for _ in range(3000)] for _ in range(3)]
    plan = plan_request([[array("I", p) for p in prompts]], "off", PackLimits(chunk_tokens=1024))
    held = [sys.getsizeof(segment.token_ids) for segment in plan.segments]
    ids = sum(len(segment.token_ids) for segment in plan.segments)
    assert ids == 9000 and sum(held) <= 4 * ids + 128 * len(held), (ids, sum(held))
    by_reader = {segment.readers[0].candidate: segment for segment in plan.segments if segment.readers}
    for c, prompt in enumerate(prompts):  # each prompt's pieces, root first, are its ids
        pieces, at = [], by_reader[c]
        while at is not None:
            pieces.insert(0, list(at.token_ids))
            at = None if at.parent is None else plan.segments[at.parent]
        assert sum(pieces, []) == prompt


@pytest.mark.parametrize("policy", ["off", "shared", "auto"])
def test_planning_allocates_little_beyond_the_ids(policy):
    """The planner works on array('I') throughout. With tuples of Python ints, planning 256
    candidates of 16,384 tokens (the worker's default token limit) peaked at 193 MiB beyond the
    16 MiB of ids and took 2 s (2026-12-05; 48 MiB for the 4 MiB of ids here); here 64
    candidates of 16,384 may allocate at most three times their ids (the shared trie's slices
    take about twice) while planned."""
    rng = random.Random(1)
    candidates = [[array("I", (rng.randrange(1000, 240000) for _ in range(16384))) for _ in range(63)]]
    candidates.append([array("I", candidates[0][0])])  # one prompt twice: the trie shares it
    ids_bytes = 4 * 64 * 16384
    tracemalloc.start()
    try:
        plan_request(candidates, policy, PackLimits(), BALANCED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 3 * ids_bytes, f"{peak / 2**20:.1f} MiB allocated while planning {ids_bytes / 2**20:.0f} MiB of ids"


def test_empty_tree_nodes_are_refused():
    """An empty node has no last token to read or state to keep."""
    root = TreeNode(None, 0, array("I", [1, 2]), (Reader(0, 0),))
    for nodes in (
        [TreeNode(None, 0, array("I"), (Reader(0, 0),))],
        [root, TreeNode(0, 2, array("I"), (Reader(0, 1),))],
    ):
        with pytest.raises(ValueError, match="must not be empty"):
            split_into_segments(nodes, 2048)


def test_pack_limits_refuse_a_chunk_over_the_budget_or_below_one_token():
    assert PackLimits(max_tokens=4096, chunk_tokens=4096).chunk_tokens == 4096
    with pytest.raises(ValueError, match="exceeds the pass budget"):
        PackLimits(max_tokens=4096, chunk_tokens=4097)
    for chunk in (0, -64):
        with pytest.raises(ValueError, match="must be positive"):
            PackLimits(chunk_tokens=chunk)


@pytest.mark.parametrize(
    "pass_tokens, chunk",
    [(4096, 2048), (4032, 1984), (4000, 1984), (2048, 1024), (2112, 1024), (192, 64), (128, 64), (64, 64)],
)
def test_the_default_chunk_is_half_the_pass_down_to_the_64_token_grid(pass_tokens, chunk):
    """Half the pass, cut down to a multiple of 64 (`fixed` stays aligned only on that grid, and
    a chunk over half the pass leaves no room beside it); never below 64, the smallest chunk."""
    assert default_chunk_tokens(pass_tokens) == chunk
