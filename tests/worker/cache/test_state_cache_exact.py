"""The state cache on the real PyTorch runner (demo export, real tokenizer, workload requests):
answers with cache hits are bit for bit those of the same requests with no cache, under random
agent sessions, a tiny budget that keeps evicting, and concurrent requests hanging from one node."""

from __future__ import annotations

import random
import threading

import pytest
from cache_requests import session_request, states_of, to_work

from openjev.worker.cache.sizing import build_state_cache
from openjev.worker.engine import Engine, ExecutionResult, QuestionWork
from openjev.worker.planner import PackLimits
from openjev.worker.planner.policy import plan_request
from openjev.worker.runner_api import SegmentRun

TEMPERATURE = 2.0
POLICIES = ("off", "default", "shared", "fixed", "auto")


def cached_engine(runner, budget: int = 256 << 20, limits: PackLimits | None = None) -> Engine:
    return Engine(
        runner, pack_limits=limits or PackLimits(), state_cache=build_state_cache(runner, budget, "demo-test")
    )


def same_bits(a: ExecutionResult, b: ExecutionResult) -> None:
    assert a.head_scores == b.head_scores
    assert a.probabilities == b.probabilities
    # the public accounting is the plan's (reuse inside the request), cache or not
    assert (a.num_saved_tokens, a.num_computed_tokens, a.scope, a.enabled) == (
        b.num_saved_tokens,
        b.num_computed_tokens,
        b.scope,
        b.enabled,
    )


def test_cuts_on_the_grid_are_exact(torch_runner, tokenizer, workload):
    """The premise: a prompt run whole and the same prompt cut at every multiple of 64 tokens
    (each piece from its parent's kept state, one pass each) end with the same head score bit
    for bit; a cut off the grid is allowed to differ (it moves the GDN chunks)."""
    state = states_of(workload, 6000, 9000, 1)[0]
    prompt = to_work(tokenizer, session_request(random.Random(3), workload, state))[0].candidates[0]
    assert len(prompt) > 1200

    def run_cut(cuts: list[int]) -> float:
        bounds = [0, *cuts, len(prompt)]
        parent = None
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            last = hi == len(prompt)
            (result,) = torch_runner.run_launch(
                [SegmentRun(prompt[lo:hi], lo, parent, keep_state=not last, read_head=last)]
            )
            parent = result.state
        return result.head_score

    whole = run_cut([])
    assert run_cut(list(range(64, len(prompt), 64))) == whole
    assert run_cut([512, 1152]) == whole
    # off the grid the bits move (so the grid is what the cache must respect), and a cut off
    # the grid starts a new one there (an anchor): 164 and 228 are on the grid of 100
    off_grid = run_cut([100])
    assert off_grid != whole
    assert run_cut([100, 164, 228]) == off_grid


def test_random_sessions_match_no_cache(torch_runner, tokenizer, workload):
    """Agents asking about a few shared states (short, ~500, ~1,500 and ~4,000 tokens, the last
    longer than a chunk), every policy, with a small pass budget so trees spread over passes."""
    rng = random.Random(17)
    states = states_of(workload, 300, 900, 1) + states_of(workload, 2000, 3000, 1)
    states += states_of(workload, 6000, 8000, 1) + states_of(workload, 15000, 20000, 1)
    limits = PackLimits(max_sequences=16, max_tokens=2048, chunk_tokens=1024)
    with_cache, without = cached_engine(torch_runner, limits=limits), Engine(torch_runner, pack_limits=limits)
    hits = others = 0
    for _ in range(14):
        work = to_work(tokenizer, session_request(rng, workload, rng.choice(states)))
        policy = rng.choice(POLICIES)
        a = with_cache.execute(work, temperature=TEMPERATURE, policy=policy)
        b = without.execute(work, temperature=TEMPERATURE, policy=policy)
        same_bits(a, b)
        assert b.cache_hit_tokens == 0
        assert policy != "off" or a.cache_hit_tokens == 0  # the reference path skips nothing
        others += policy != "off"
        hits += a.cache_hit_tokens > 0
    assert hits >= others * 2 // 3, f"only {hits} of the {others} requests not under `off` hit the cache"
    cache = with_cache.state_cache
    assert cache is not None and cache.num_hits == hits and cache.nbytes <= cache.budget_bytes


def test_second_question_hangs_deep(torch_runner, tokenizer, workload):
    """A second question about a ~1,500-token state hangs from a cached state within two grids
    of where the two prompts part, and computes only the rest."""
    state = states_of(workload, 6000, 9000, 1)[0]
    first = to_work(tokenizer, session_request(random.Random(1), workload, state))
    second_request = session_request(random.Random(2), workload, state)
    second = to_work(tokenizer, second_request)
    engine = cached_engine(torch_runner)
    engine.execute(first, temperature=TEMPERATURE)
    got = engine.execute(second, temperature=TEMPERATURE)
    same_bits(got, Engine(torch_runner).execute(second, temperature=TEMPERATURE))
    a, b = first[0].candidates[0], second[0].candidates[0]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common - 2 * 64 < got.cache_hit_tokens <= common


def test_hang_inside_a_node_that_starts_off_the_grid(torch_runner):
    """A branch at 100 tokens (off the grid) starts a node whose cuts are exact only at 100 + 64k:
    the second request parts from the first inside that node and hangs from the state at 356,
    not 320 (on the grid from 0), and its answers equal those with no cache."""
    rng = random.Random(11)
    toks = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    head, middle, other = toks(100), toks(300), toks(40)
    first = [
        QuestionWork("choice", (tuple(head + middle + [7, 8]), tuple(head + middle + [7, 9]))),
        QuestionWork("choice", (tuple(head + other + [5]), tuple(head + other + [6]))),
    ]
    second = [
        QuestionWork("choice", (tuple(head + middle[:280] + [11]), tuple(head + middle[:280] + [12]))),
        first[1],
    ]
    engine = cached_engine(torch_runner)
    engine.execute(first, temperature=TEMPERATURE, policy="shared")
    got = engine.execute(second, temperature=TEMPERATURE, policy="shared")
    same_bits(got, Engine(torch_runner).execute(second, temperature=TEMPERATURE, policy="shared"))
    # the shared head (100) and the first question's node up to 356; the second question's
    # 40-token node is shorter than a grid, so no request leaves a state at its end
    assert got.cache_hit_tokens == 356


def test_a_repeat_of_a_prompt_longer_than_the_budget_hangs_deep(torch_runner):
    """A 6,000-token prompt runs as chunks whose deposits need more than a 32 MiB budget: the
    chunks' later deposits must not evict the earlier ends a lookup passes on its way down (they
    did, and a repeat hit nothing while its unreachable states filled the budget). The repeat
    hangs from the first chunk's end and the second's, and is exact."""
    rng = random.Random(3)
    work = [QuestionWork("noul", (tuple(rng.randrange(1000, 5000) for _ in range(6000)),))]
    engine = cached_engine(torch_runner, budget=32 << 20)
    cache = engine.state_cache
    assert cache is not None
    engine.execute(work, temperature=TEMPERATURE, policy="auto")
    assert cache.num_evictions > 0 and cache.nbytes <= cache.budget_bytes
    repeats = [engine.execute(work, temperature=TEMPERATURE, policy="auto") for _ in range(2)]
    assert [r.cache_hit_tokens for r in repeats] == [5952, 5952]  # the last grid point before the end
    same_bits(repeats[0], Engine(torch_runner).execute(work, temperature=TEMPERATURE, policy="auto"))


@pytest.mark.parametrize("state_tokens", [2000, 3500])
def test_a_question_about_a_long_prompt_alone_hangs_near_its_end(torch_runner, state_tokens):
    """A noul question runs alone from its start and deposits grid states before its end; past
    chunk_tokens (2,048) its last piece hangs from a chunk, and it deposited nothing: a second
    question about the same 3,500-token state hit only the chunk's 2,048 tokens (found by a
    review). Now both lengths hang within a grid of where the two prompts part, exactly."""
    rng = random.Random(4)
    toks = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    state = toks(state_tokens)
    first, second = ([QuestionWork("noul", (tuple(state + toks(40)),))] for _ in range(2))
    engine = cached_engine(torch_runner)
    engine.execute(first, temperature=TEMPERATURE, policy="auto")
    got = engine.execute(second, temperature=TEMPERATURE, policy="auto")
    assert state_tokens - 64 < got.cache_hit_tokens <= state_tokens
    same_bits(got, Engine(torch_runner).execute(second, temperature=TEMPERATURE, policy="auto"))


def test_nothing_is_kept_below_a_node_no_lookup_can_pass(torch_runner):
    """A 10-token node two questions share is shorter than a grid, so its end is never kept and
    no lookup goes below it: the 300-token nodes under it keep no states either (they did: a
    dozen states in the budget that nothing could reach), while the third question's node,
    hanging from the kept 1,000-token root, keeps and hits its own."""
    rng = random.Random(0)
    toks = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    state, short = toks(1000), toks(10)
    a, b, c = toks(300), toks(300), toks(300)
    work = [
        QuestionWork("choice", tuple(tuple(state + short + a + [k]) for k in (1, 2))),
        QuestionWork("choice", tuple(tuple(state + short + b + [k]) for k in (1, 2))),
        QuestionWork("choice", tuple(tuple(state + c + [k]) for k in (1, 2))),
    ]
    engine = cached_engine(torch_runner)
    cache = engine.state_cache
    assert cache is not None
    engine.execute(work, temperature=TEMPERATURE, policy="shared")
    kept = sorted((k.position, k.anchors) for k in cache._entries)
    assert kept and all(anchors in ((), (1000,)) for _, anchors in kept), kept  # none under 1,010
    assert any(anchors == (1000,) for _, anchors in kept)  # the third question's node
    again = engine.execute(work, temperature=TEMPERATURE, policy="shared")
    assert again.cache_hit_tokens == 1300
    same_bits(again, Engine(torch_runner).execute(work, temperature=TEMPERATURE, policy="shared"))


@pytest.mark.parametrize("state_tokens", [4100, 4160])
def test_a_long_node_whose_last_chunk_is_short_keeps_its_end(torch_runner, state_tokens):
    """A 4,100-token state three questions share runs as chunks of 2,048, 2,048 and 4 tokens: the
    last piece is shorter than a grid, and its end (the branch point) was not kept, so nothing
    below it was either and a repeat recomputed every question (found by a review helper; 4,160,
    whose last piece is a grid long, was fine). Now a repeat hangs at every question's end."""
    rng = random.Random(7)
    toks = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    state, questions = toks(state_tokens), [toks(300) for _ in range(3)]
    work = [QuestionWork("choice", tuple(tuple(state + q + toks(5)) for _ in range(4))) for q in questions]
    engine = cached_engine(torch_runner)
    engine.execute(work, temperature=TEMPERATURE, policy="shared")
    again = engine.execute(work, temperature=TEMPERATURE, policy="shared")
    assert again.cache_hit_tokens == state_tokens + 3 * 300
    same_bits(again, Engine(torch_runner).execute(work, temperature=TEMPERATURE, policy="shared"))


def test_a_node_kept_without_a_score_gains_one(torch_runner):
    """A node first kept where no candidate read its score: the first request that reads one
    there deposits it again with the score, so later ones hang at the node's end (they fell back
    a grid on every repeat, 640 of 700, before)."""
    rng = random.Random(5)
    toks = lambda n: [rng.randrange(1000, 5000) for _ in range(n)]  # noqa: E731
    node = toks(700)
    unread = [QuestionWork("choice", (tuple(node + toks(3)), tuple(node + toks(3))))]
    read = [QuestionWork("choice", (tuple(node), tuple(node + toks(3))))]
    engine = cached_engine(torch_runner)
    engine.execute(unread, temperature=TEMPERATURE, policy="shared")
    hits = [engine.execute(read, temperature=TEMPERATURE, policy="shared") for _ in range(3)]
    assert [got.cache_hit_tokens for got in hits] == [640, 700, 700]
    want = Engine(torch_runner).execute(read, temperature=TEMPERATURE, policy="shared")
    for got in hits:
        same_bits(got, want)


def test_a_node_kept_under_one_tree_and_hung_from_by_another_stays_reachable(torch_runner):
    """The end at 192 is kept by a request whose tree branches at 128 (so it requires 128's) and
    hung from by one whose tree branches at 192 (whose deposits require 192's only); unrelated
    traffic then evicts 128. The deposits under 192 once stayed, requiring a state that was gone:
    the next lookup that reached one failed with KeyError, on every retry (a review, 2026-12-03)."""
    rng = random.Random(5)
    state = [rng.randrange(1000, 5000) for _ in range(600)]
    other = [random.Random(99).randrange(1000, 5000) for _ in range(300)]
    requests = [
        [QuestionWork("choice", (tuple(state[:300] + [7]), tuple(state[:300] + [8]), tuple(state[:128] + [9] * 3)))],
        [QuestionWork("choice", (tuple(state[:400] + [7]), tuple(state[:400] + [8]), tuple(state[:192] + [9] * 3)))],
        [QuestionWork("noul", (tuple(other),))],
        [QuestionWork("noul", (tuple(state[:350]),))],
    ]
    engine = cached_engine(torch_runner, budget=4_600_000)
    cache = engine.state_cache
    assert cache is not None
    for work in requests:
        got = engine.execute(work, temperature=TEMPERATURE, policy="shared")
        assert all(r in cache._entries for entry in cache._entries.values() for r in entry.requires)
        assert cache.nbytes == sum(entry.nbytes for entry in cache._entries.values()) <= cache.budget_bytes
    assert cache.num_evictions > 0
    same_bits(got, Engine(torch_runner).execute(requests[-1], temperature=TEMPERATURE, policy="shared"))


def test_tiny_budget_evicts_and_stays_exact(torch_runner, tokenizer, workload):
    """A budget of about two ~500-token states: every deposit evicts, bytes never exceed it,
    answers stay exact."""
    rng = random.Random(5)
    states = states_of(workload, 2000, 3000, 3)
    engine = cached_engine(torch_runner, budget=3_000_000)
    without = Engine(torch_runner)
    cache = engine.state_cache
    assert cache is not None
    peak = 0
    for _ in range(8):
        work = to_work(tokenizer, session_request(rng, workload, rng.choice(states)))
        same_bits(engine.execute(work, temperature=TEMPERATURE), without.execute(work, temperature=TEMPERATURE))
        peak = max(peak, cache.nbytes)
        assert cache.nbytes <= cache.budget_bytes
    assert cache.num_evictions > 0 and len(cache) >= 1 and peak > cache.budget_bytes // 2


def test_concurrent_requests_hit_one_node(torch_runner, tokenizer, workload):
    """After one request about a state, eight requests about it arrive at once (sharing passes)
    and all hang from the same cached node; each answer equals its answer with no cache."""
    state = states_of(workload, 6000, 9000, 1)[0]
    engine = cached_engine(torch_runner)
    engine.execute(to_work(tokenizer, session_request(random.Random(0), workload, state)), temperature=TEMPERATURE)
    works = [to_work(tokenizer, session_request(random.Random(100 + i), workload, state)) for i in range(8)]
    results: list[ExecutionResult | None] = [None] * len(works)
    barrier = threading.Barrier(len(works))

    def ask(i: int) -> None:
        barrier.wait()
        results[i] = engine.execute(works[i], temperature=TEMPERATURE)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    alone = Engine(torch_runner)
    for work, got in zip(works, results, strict=True):
        assert got is not None
        assert got.cache_hit_tokens > 1000
        same_bits(got, alone.execute(work, temperature=TEMPERATURE))
    assert sum(r.num_shared_passes for r in results if r) > 0  # they did run side by side


def test_policy_off_computes_everything(torch_runner, tokenizer, workload):
    """`off` is the reference path: with states of its very prompt in the cache it still runs its
    plan's segments (no hit, nothing deposited), while `auto` hangs from the same states."""
    state = states_of(workload, 2000, 3000, 1)[0]
    work = to_work(tokenizer, session_request(random.Random(4), workload, state))
    engine = cached_engine(torch_runner)
    cache = engine.state_cache
    assert cache is not None
    engine.execute(work, temperature=TEMPERATURE, policy="auto")  # deposits
    inserts, hits = cache.num_inserts, cache.num_hits
    assert inserts > 0
    off = engine.execute(work, temperature=TEMPERATURE, policy="off")
    plan = plan_request([q.candidates for q in work], "off")
    assert off.cache_hit_tokens == 0 and off.num_launches == plan.num_launches
    assert (cache.num_inserts, cache.num_hits) == (inserts, hits)
    same_bits(off, Engine(torch_runner).execute(work, temperature=TEMPERATURE, policy="off"))
    assert engine.execute(work, temperature=TEMPERATURE, policy="auto").cache_hit_tokens > 0


@pytest.mark.parametrize("budget", [0])
def test_off_switch(torch_runner, tokenizer, workload, budget):
    """Budget 0: nothing is cut, kept or looked up; the plan's segments run as planned."""
    state = states_of(workload, 6000, 9000, 1)[0]
    engine = cached_engine(torch_runner, budget=budget)
    cache = engine.state_cache
    assert cache is not None and not cache.enabled
    work = to_work(tokenizer, session_request(random.Random(1), workload, state))
    plan = plan_request([q.candidates for q in work], "shared")
    for _ in range(2):
        got = engine.execute(work, temperature=TEMPERATURE, policy="shared")
        assert got.cache_hit_tokens == 0 and got.num_launches == plan.num_launches
    assert len(cache) == 0 and cache.num_hits == 0 and cache.nbytes == 0
