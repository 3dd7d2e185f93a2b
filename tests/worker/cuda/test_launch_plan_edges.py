"""Edges of the host-side pass layout on the CPU (no CUDA needed): what plan_launch refuses
before any index reaches a kernel, and the graph keys at the budget's bounds. Each test
checks a rule against a model written here (the vocabulary's last id, a key's limit itself,
every token count up to the budget), not against the code's own arithmetic."""

from __future__ import annotations

import pytest

from openjev.worker.cuda.buckets import MAX_STATE_SLOTS, Bucketing, PassBudget
from openjev.worker.cuda.launch import plan_launch
from openjev.worker.runner_api import SegmentRun


@pytest.mark.parametrize("chunked_from", [None, 0, 64])
def test_token_ids_must_lie_inside_the_vocabulary(chunked_from):
    """The embedding and head read row `id` of a [vocab, D] table: the last id is vocab - 1,
    so an id equal to the vocabulary's size (or negative) would read past the table."""
    vocab = 5
    plan = plan_launch([SegmentRun([0, vocab - 1] * 40, 0, None, False, True)], vocab, chunked_from=chunked_from)
    assert min(plan.ids) == 0 and max(plan.ids) == vocab - 1
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            plan_launch([SegmentRun([1] * 79 + [bad], 0, None, False, True)], vocab, chunked_from=chunked_from)


@pytest.mark.parametrize("chunked_from", [None, 0, 64])
def test_an_empty_run_is_refused(chunked_from):
    """A run of no tokens has no last row for the head: first in the pass its head row would
    be -1, after another run that run's row (another sequence's score)."""
    first = SegmentRun([1, 1], 0, None, False, True)
    for runs in (
        [SegmentRun([], 0, None, False, True), first],
        [first, SegmentRun([], 2, None, False, True, parent_in_pass=0)],
        [first, SegmentRun([], 0, None, False, True)],
    ):
        with pytest.raises(ValueError, match="empty"):
            plan_launch(runs, 2, chunked_from=chunked_from)


@pytest.mark.parametrize(
    "tokens,tile_from",
    [(4096, 1100), (4096, 1500), (4097, 1024), (1153, 1100), (300, 0), (17, 0), (1, 0)],
)
def test_every_token_count_up_to_the_budget_lands_on_a_warm_key(tokens, tile_from):
    """Whatever the budget's top count and tile start (non-monotone buckets where tile_from
    lies between fine sizes; a top count just past a bucket's edge), every pass within the
    budget, kept or not, shallow or at the depth, maps to a key warm_up captures, and that key
    holds it: else it is captured mid-serving or runs eagerly."""
    budget = PassBudget(tokens=tokens, segments=8, depth=4, context=64, tile_from=tile_from)
    bucketing = Bucketing(budget)
    warm = set(bucketing.keys())
    for n in range(1, tokens + 1):
        for kept, levels in ((0, 1), (1, budget.depth)):
            key, why = bucketing.key(n, 1, levels, 0, kept, 0, n)
            assert key in warm, (n, kept, levels, key, why)
            assert key.tokens >= n and key.levels >= levels and key.segments >= 2 and key.kept >= (kept > 0)


def test_a_pass_at_each_limit_of_the_key_fits_and_one_more_does_not():
    """Each bound the static buffers are sized by admits a pass exactly at it: a pass whose
    ancestors fill the context, whose key rows fill the kv_rows buffer, with the most tokens,
    segments, sequences, parents, kept states and levels."""
    budget = PassBudget(tokens=512, segments=16, depth=4, context=1024, tile_from=256)
    for chunked_from in (None, 0, 128):
        b = Bucketing(budget, chunked_from=chunked_from)
        levels = 0 if chunked_from == 0 else budget.depth
        chunked = 0 if chunked_from is None else budget.depth
        at_limit = dict(
            tokens=budget.tokens,
            segments=b.max_segments,
            levels=levels,
            parents=MAX_STATE_SLOTS,
            kept=MAX_STATE_SLOTS,
            base=budget.context,
            kv_rows=b.kv_rows,
            chunked_levels=chunked,
            callers=budget.segments,
        )
        key, why = b.key(**at_limit)
        assert key is not None and key in set(b.keys()), (chunked_from, why)
        for name in ("tokens", "segments", "levels", "chunked_levels", "parents", "kept", "base", "kv_rows", "callers"):
            key, why = b.key(**(at_limit | {name: at_limit[name] + 1}))
            assert key is None and why, (chunked_from, name)


@pytest.mark.parametrize("chunked_from", [None, 0, 128])
@pytest.mark.parametrize("level_keys", [False, True])
def test_no_key_has_more_levels_than_the_budgets_depth(chunked_from, level_keys):
    """A key's level launches and level_off entries are sized by its levels: none exceeds the
    depth the runner holds, down to a depth of 1 and for long passes (tiled keys) too."""
    for depth in (1, 2, 3, 8):
        budget = PassBudget(tokens=512, segments=8, depth=depth, context=64, tile_from=128)
        keys = Bucketing(budget, chunked_from=chunked_from, level_keys=level_keys).keys()
        assert any(budget.long(k.tokens) for k in keys)
        assert all(k.levels <= depth and k.chunked_levels <= depth for k in keys), (depth, keys)
