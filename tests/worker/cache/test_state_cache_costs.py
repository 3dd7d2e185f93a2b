"""What the state cache may cost a request besides its answer (which stays exact): passes, copies
of states it cannot keep, memory it pins after eviction, and hits it counts."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest

from openjev.worker.cache.keys import GRID_TOKENS, CutRule
from openjev.worker.cache.prepare import PassFit, prepare
from openjev.worker.cache.sizing import build_state_cache, min_state_bytes
from openjev.worker.cache.store import StateCache
from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner import PackLimits
from openjev.worker.planner.plan import Segment
from openjev.worker.scheduler import Cancelled

TEMPERATURE = 2.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 5000) for _ in range(n)]


def _choice(rng: random.Random, state: list[int], candidates: int, tail: int = 5) -> list[QuestionWork]:
    return [QuestionWork("choice", tuple(tuple(state + _tokens(rng, tail) + [c]) for c in range(candidates)))]


def _engine(runner, budget: int, limits: PackLimits | None = None) -> Engine:
    return Engine(runner, pack_limits=limits or PackLimits(), state_cache=build_state_cache(runner, budget, "t"))


def test_deposits_keep_a_one_pass_plan_in_one_pass(torch_runner):
    """62 candidates over a 1,000-token state are 63 segments, one pass of 64; the deposit cuts
    of the shared node (4 grid points before its end) would make it 67 and two passes. The
    request still runs in one pass, deposits what fits, and a second one hangs from it."""
    rng = random.Random(1)
    state = _tokens(rng, 1000)
    first, second = _choice(rng, state, 62), _choice(rng, state, 62)
    engine = _engine(torch_runner, 256 << 20)
    got = engine.execute(first, temperature=TEMPERATURE, policy="default")
    assert got.num_launches == 1
    assert engine.state_cache is not None and len(engine.state_cache) >= 1
    again = engine.execute(second, temperature=TEMPERATURE, policy="default")
    assert again.cache_hit_tokens > 0 and again.num_launches == 1
    alone = Engine(torch_runner)
    for work, result in ((first, got), (second, again)):
        assert result.head_scores == alone.execute(work, temperature=TEMPERATURE, policy="default").head_scores


def _chain(lengths: list[int]) -> list[Segment]:
    """A chain of segments, each continuing its parent; the last one read by one candidate."""
    from openjev.worker.planner.plan import Reader

    rng, segments, start = random.Random(2), [], 0
    for i, n in enumerate(lengths):
        last = i == len(lengths) - 1
        readers = (Reader(0, 0),) if last else ()
        segments.append(Segment(i, i - 1 if i else None, tuple(_tokens(rng, n)), start, readers, not last))
        start += n
    return segments


def _cache() -> StateCache:
    return StateCache(1 << 40, "t", CutRule(anywhere=False), lambda state: (state, 1), deposits_per_segment=4)


@pytest.mark.parametrize("max_depth", [3, 4, 5, 8])
def test_deposit_cuts_keep_the_plans_levels(max_depth):
    """Three 300-token segments in a chain: each cut adds a level, and the pieces that run stay
    within `max_depth` levels (no cut at all at 3); without a pass to fit, every deposit is cut."""
    segments = _chain([300, 300, 300])
    prepared = prepare(segments, _cache(), PassFit(64, max_depth))
    assert len(prepared.segments) <= max_depth
    assert len(prepared.segments) == 3 if max_depth == 3 else len(prepared.segments) > 3
    assert len(prepare(segments, _cache()).segments) > 8


def test_the_floor_is_the_smallest_state_kept(torch_runner):
    """The smallest state the cache keeps is a grid long: its bytes, as the runner measures them,
    are min_state_bytes (it counted the GDN state alone, so budgets of up to 2.5x it were on and
    kept nothing)."""
    engine = _engine(torch_runner, 256 << 20)
    cache = engine.state_cache
    assert cache is not None
    prompt = tuple(_tokens(random.Random(4), GRID_TOKENS + 1))  # deposits its state at the grid point
    engine.execute([QuestionWork("noul", (prompt,))], temperature=TEMPERATURE, policy="default")
    kept = {k.position: e.nbytes for k, e in cache._entries.items()}
    assert kept == {GRID_TOKENS: min_state_bytes(torch_runner.config, torch_runner.dtype.itemsize)}
    assert cache.min_entry_bytes == kept[GRID_TOKENS]


def test_budget_below_one_state_is_off(torch_runner):
    """A budget that cannot hold one state keeps nothing: the cache is off, nothing is cut or copied."""
    floor = min_state_bytes(torch_runner.config, torch_runner.dtype.itemsize)
    rng = random.Random(3)
    state = _tokens(rng, 700)
    copied: list = []

    def measure(state):
        copied.append(state)
        return state, floor

    for budget in (1, floor - 1):
        engine = _engine(torch_runner, budget)
        cache = engine.state_cache
        assert cache is not None and not cache.enabled
        cache._measure = measure
        for _ in range(2):
            assert engine.execute(_choice(rng, state, 62), temperature=TEMPERATURE, policy="default").num_launches == 1
        assert copied == [] and len(cache) == 0
    assert _engine(torch_runner, floor).state_cache.enabled  # type: ignore[union-attr]


def _cancelled_hit(engine: Engine, work: list[QuestionWork]) -> None:
    started = threading.Event()
    with pytest.raises(Cancelled):
        engine.execute(work, temperature=TEMPERATURE, policy="shared", should_stop=started.is_set, on_start=started.set)


def test_a_cancelled_request_pins_no_state_the_cache_dropped(torch_runner):
    """A request hanging from cached states is cancelled; once the cache drops them, nothing holds
    them (by reference counting alone: no cycle through the request's error), and the cancelled
    request counts no hit."""
    rng = random.Random(4)
    engine = _engine(torch_runner, 256 << 20, PackLimits(max_sequences=2, max_tokens=256, chunk_tokens=256))
    cache = engine.state_cache
    assert cache is not None
    state = _tokens(rng, 1500)
    engine.execute(_choice(rng, state, 3, tail=600), temperature=TEMPERATURE, policy="shared")
    refs = [weakref.ref(layer.keys) for entry in cache._entries.values() for layer in entry.state.layers[3:4]]
    hits = (cache.num_hits, cache.hit_tokens)
    gc.disable()
    try:
        _cancelled_hit(engine, _choice(rng, state, 3, tail=600))
        assert (cache.num_hits, cache.hit_tokens) == hits
        cache.clear()
        assert refs and [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()
        engine.close()
