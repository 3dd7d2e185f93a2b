"""The state cache on the CUDA runner: answers with hits are bit for bit those of the same
requests with no cache (serial and chunked GDN kernels, eager and graph-replayed passes), a
hit may sit at any 64-token grid point (every cut is exact here), a tiny budget evicts and
holds, and concurrent requests hang from one node. Synthetic weights of the small shape, 8
layers; requests of JevBench shape: a shared state, 1-2 questions, 2-8 short candidates."""

from __future__ import annotations

import random
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu
TEMPERATURE = 2.0
POLICIES = ("off", "default", "shared", "fixed", "auto")


@pytest.fixture(scope="module", params=["serial-eager", "chunked-eager", "serial-graphs", "split-graphs"])
def runner(request):
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from openjev.worker.cuda.runner import CudaRunner

    kernel, mode = request.param.split("-")
    graphs = dict(graph_cache_size=32, graph_capture_after=1) if mode == "graphs" else dict(graph_cache_size=0)
    # split: the chunked kernel from position 128, which the sessions here cross
    return CudaRunner.synthetic("small", seed=9, num_layers=8, gdn_kernel=kernel, gdn_split_at=128, **graphs)


def engines(runner, budget: int = 2 << 30):
    from openjev.worker.cache.sizing import build_state_cache
    from openjev.worker.engine import Engine

    cache = build_state_cache(runner, budget, "synthetic-small")
    assert cache is not None and cache.rule.anywhere
    return Engine(runner, state_cache=cache), Engine(runner)


def session(rng: random.Random, vocab: int, state: list[int]):
    """One agent call about `state`: 1-2 questions, each a stem and 2-8 candidates."""
    from openjev.worker.engine import QuestionWork

    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    questions = []
    for _ in range(rng.choice((1, 1, 2))):
        stem = state + toks(rng.randint(3, 40))
        kind = rng.choice(("choice", "score"))
        questions.append(
            QuestionWork(kind, tuple(tuple(stem + toks(rng.randint(1, 12))) for _ in range(rng.randint(2, 8))))
        )
    return questions


def same_bits(a, b) -> None:
    assert a.head_scores == b.head_scores
    assert a.probabilities == b.probabilities
    assert (a.num_saved_tokens, a.num_computed_tokens) == (b.num_saved_tokens, b.num_computed_tokens)


def test_cut_anywhere_is_exact(runner):
    """The premise of `state_cut_anywhere`: a prompt cut at any positions (each piece from the
    kept state of the one before) ends with the bits of the prompt run whole."""
    from openjev.worker.runner_api import SegmentRun

    rng = random.Random(1)
    prompt = [rng.randrange(runner.config.vocab_size) for _ in range(300)]

    def run_cut(cuts):
        bounds, parent = [0, *cuts, len(prompt)], None
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            last = hi == len(prompt)
            (result,) = runner.run_launch([SegmentRun(prompt[lo:hi], lo, parent, keep_state=not last, read_head=last)])
            parent = result.state
        return result.head_score

    whole = run_cut([])
    for cuts in ([1], [37], [100, 129], [64, 128, 192, 256], [299]):
        assert run_cut(cuts) == whole, cuts


def test_random_sessions_match_no_cache(runner):
    rng = random.Random(4)
    vocab = runner.config.vocab_size
    states = [[rng.randrange(vocab) for _ in range(n)] for n in (40, 250, 700)]
    with_cache, without = engines(runner)
    hits = others = 0
    for _ in range(16):
        work = session(rng, vocab, rng.choice(states))
        policy = rng.choice(POLICIES)
        a = with_cache.execute(work, temperature=TEMPERATURE, policy=policy)
        same_bits(a, without.execute(work, temperature=TEMPERATURE, policy=policy))
        assert policy != "off" or a.cache_hit_tokens == 0  # the reference path skips nothing
        others += policy != "off"
        hits += a.cache_hit_tokens > 0
    # the 40-token state never reaches a grid point; first sightings miss
    assert hits >= others * 3 // 8, f"{hits} of the {others} requests not under `off` hit the cache"


def test_second_question_hangs_within_a_grid(runner):
    rng = random.Random(6)
    vocab = runner.config.vocab_size
    state = [rng.randrange(vocab) for _ in range(500)]
    with_cache, without = engines(runner)
    first, second = session(rng, vocab, state), session(rng, vocab, state)
    with_cache.execute(first, temperature=TEMPERATURE, policy="shared")
    got = with_cache.execute(second, temperature=TEMPERATURE, policy="shared")
    same_bits(got, without.execute(second, temperature=TEMPERATURE, policy="shared"))
    assert len(state) - 64 < got.cache_hit_tokens <= len(state)


def test_tiny_budget_evicts_and_stays_exact(runner):
    rng = random.Random(8)
    vocab = runner.config.vocab_size
    states = [[rng.randrange(vocab) for _ in range(300)] for _ in range(3)]
    with_cache, without = engines(runner, budget=1)  # measured below, then set
    cache = with_cache.state_cache
    assert cache is not None
    cache.budget_bytes = 1 << 40
    with_cache.execute(session(rng, vocab, states[0]), temperature=TEMPERATURE, policy="shared")
    one = max(1, cache.nbytes // max(1, len(cache)))
    cache.clear()
    cache.budget_bytes = 2 * one
    for _ in range(8):
        work = session(rng, vocab, rng.choice(states))
        same_bits(
            with_cache.execute(work, temperature=TEMPERATURE, policy="shared"),
            without.execute(work, temperature=TEMPERATURE, policy="shared"),
        )
        assert cache.nbytes <= cache.budget_bytes
    assert cache.num_evictions > 0


def test_concurrent_requests_hit_one_node(runner):
    rng = random.Random(10)
    vocab = runner.config.vocab_size
    state = [rng.randrange(vocab) for _ in range(400)]
    with_cache, without = engines(runner)
    with_cache.execute(session(rng, vocab, state), temperature=TEMPERATURE)
    works = [session(rng, vocab, state) for _ in range(6)]
    results = [None] * len(works)
    barrier = threading.Barrier(len(works))

    def ask(i):
        barrier.wait()
        results[i] = with_cache.execute(works[i], temperature=TEMPERATURE)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(works))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for work, got in zip(works, results, strict=True):
        assert got is not None and got.cache_hit_tokens > 300
        same_bits(got, without.execute(work, temperature=TEMPERATURE))


def test_deposits_keep_passes_within_the_graph_slots(runner):
    """6 questions over their own 300-token contexts deposit more states than a captured pass
    has slots for (8): the pass keeps within them (graph-replayed, not eager), same bits."""
    if runner.graphs is None:
        pytest.skip("eager runner: no slots")
    from openjev.worker.engine import QuestionWork

    rng = random.Random(5)
    toks = lambda n: [rng.randrange(runner.config.vocab_size) for _ in range(n)]  # noqa: E731
    work = [QuestionWork("choice", tuple(tuple(c + toks(4)) for _ in range(3))) for c in (toks(300) for _ in range(6))]
    cached, alone = engines(runner)
    before = runner.graphs.fallbacks
    got = cached.execute(work, temperature=TEMPERATURE, policy="default")
    assert runner.graphs.fallbacks == before
    same_bits(got, alone.execute(work, temperature=TEMPERATURE, policy="default"))
