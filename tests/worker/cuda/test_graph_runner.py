"""CudaRunner launches replayed from CUDA graphs against the same runner's eager launches (same
weights, same inputs), per segment: hidden head rows and every kept state. Both run the same
kernels; padded shapes may pick other cuBLAS kernels, hence a bf16 tolerance rather than
equality. Buckets and shapes are checked without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

TOL = 2e-2  # bf16 activations through 8 layers, other GEMM kernels for the padded row count


def _metric(name: str) -> float | None:
    try:
        from openjev import metrics
    except ImportError:
        return None
    return getattr(metrics, name)._value.get()


@pytest.fixture(scope="module", params=["serial", "chunked", "split"])
def eager(request):  # split: the chunked kernel from position 128, which the prompts here cross
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from openjev.worker.cuda.runner import CudaRunner

    return CudaRunner.synthetic(
        "small", seed=3, num_layers=8, graph_cache_size=0, gdn_kernel=request.param, gdn_split_at=128
    )


def twin(runner, size: int, capture_after: int = 1):
    """A runner on the same weights with a graph cache of `size`."""
    from openjev.worker.cuda.runner import CudaRunner

    return CudaRunner.on_weights_of(
        runner,
        graph_cache_size=size,
        graph_capture_after=capture_after,
    )


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(got, expected, what: str) -> None:
    """got, expected: final_hidden results (hidden [R, D], states)."""
    from openjev.worker.cuda import chunked_gdn as KC

    (hg, sg), (he, se) = got, expected
    assert hg.shape == he.shape, what
    for r in range(he.shape[0]):
        assert rel(hg[r], he[r]) < TOL, (what, "head row", r)
    for i, (a, b) in enumerate(zip(sg, se, strict=True)):
        assert (a is None) == (b is None), (what, i)
        if a is None:
            continue
        assert a.num_tokens == b.num_tokens and a.kv.num_rows == b.kv.num_rows
        for j in b.gdn:
            assert a.gdn[j][0].shape == b.gdn[j][0].shape and a.gdn[j][1].shape == b.gdn[j][1].shape
            assert rel(a.gdn[j][0], b.gdn[j][0]) < TOL, (what, i, j, "conv window")
            assert rel(a.gdn[j][1], b.gdn[j][1]) < TOL, (what, i, j, "recurrent state")
            if b.gdn[j][2] is None:  # the serial kernel keeps no tail
                assert a.gdn[j][2] is None
                continue
            assert a.gdn[j][2].shape == b.gdn[j][2].shape, (what, i, j, "tail shape")
            rows = b.num_tokens % 64  # rows past them are never read
            if rows:
                # v is kept as bf16 pairs in fp32 words: compared as the values they hold
                hv = b.gdn[j][1].shape[0]
                hk = (b.gdn[j][0].shape[-1] - hv * 128) // 256  # the conv window's columns: q, k, v
                ta, tb = (KC.unpack_tails(s.gdn[j][2][:rows], hk, hv) for s in (a, b))
                assert rel(ta, tb) < TOL, (what, i, j, "tail rows")
        for j in b.kv.kv:
            for t, u in zip(a.kv.kv[j], b.kv.kv[j], strict=True):
                assert t.shape == u.shape and rel(t, u) < TOL, (what, i, j, "keys/values")


def both(graph, eager, runs_of):
    """runs_of(runner) -> runs; the two runners' final_hidden results."""
    return graph.final_hidden(runs_of(graph)), eager.final_hidden(runs_of(eager))


def tokens(rng, vocab, n):
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.gpu
def test_replays_match_eager_with_changed_inputs(eager):
    from openjev.worker.runner_api import SegmentRun

    graph, rng, vocab = twin(eager, 4), random.Random(0), eager.config.vocab_size
    hits0, misses0 = _metric("graph_cache_hits"), _metric("graph_cache_misses")
    for rep in range(3):  # 60 tokens in 3 segments every time: one bucket, fresh tokens each time
        prompts = [tokens(rng, vocab, n) for n in (40 + rep, 3, 17 - rep)]
        runs = [SegmentRun(p, 0, None, keep_state=i == 0, read_head=True) for i, p in enumerate(prompts)]
        got, expected = graph.final_hidden(runs), eager.final_hidden(runs)
        assert_close(got, expected, f"rep {rep}")
    assert (graph.graphs.hits, graph.graphs.misses, graph.graphs.failures) == (2, 1, 0)
    if hits0 is not None:
        assert _metric("graph_cache_hits") - hits0 == 2 and _metric("graph_cache_misses") - misses0 == 1


@pytest.mark.gpu
def test_eviction_recaptures(eager):
    from openjev.worker.runner_api import SegmentRun

    graph, rng, vocab = twin(eager, 1), random.Random(1), eager.config.vocab_size
    for rep in range(4):  # two shapes alternating through a cache of one: every launch recaptures
        lengths = (30,) if rep % 2 == 0 else (100, 9)
        runs = [SegmentRun(tokens(rng, vocab, n), 0, None, False, True) for n in lengths]
        assert_close(graph.final_hidden(runs), eager.final_hidden(runs), f"rep {rep}")
        assert len(graph.graphs.cache) == 1
    assert graph.graphs.cache.num_captures == 4 and graph.graphs.misses == 4 and graph.graphs.failures == 0


@pytest.mark.gpu
def test_capture_on_second_sighting(eager):
    """Not warmed, capture_after=2: a key's first pass runs eagerly, its second is captured, its
    third replays; a larger key is captured beside it on the same static buffers."""
    from openjev.worker.runner_api import SegmentRun

    graph, rng, vocab = twin(eager, 8, capture_after=2), random.Random(4), eager.config.vocab_size

    def check(lengths, what):
        runs = [SegmentRun(tokens(rng, vocab, n), 0, None, i == 0, True) for i, n in enumerate(lengths)]
        assert_close(graph.final_hidden(runs), eager.final_hidden(runs), what)

    L = graph.graphs
    for rep in range(3):
        check((40, 5), f"small {rep}")
        assert (L.cache.num_captures, L.hits) == ((0, 0), (1, 0), (1, 1))[rep]
    kv = L.statics.buffers["kv"].data_ptr()
    for rep in range(2):
        check((300, 200, 100), f"large {rep}")
    assert L.statics.buffers["kv"].data_ptr() == kv and len(L.cache) == 2  # fixed buffers, shared
    for rep in range(2):
        check((40, 5), f"small again {rep}")
    assert L.cache.num_captures == 2 and L.hits == 1 + 2 and L.failures == 0


def tree_pass(graph, eager, rng, vocab, rep):
    """One root -> children -> grandchildren pass through both runners, compared launch by launch."""
    from openjev.worker.runner_api import SegmentRun

    root, tails = tokens(rng, vocab, 70), [tokens(rng, vocab, n) for n in (12, 1, 33)]
    grand, fresh = [tokens(rng, vocab, n) for n in (5, 2, 8)], tokens(rng, vocab, 21)
    g0, e0 = both(graph, eager, lambda r: [SegmentRun(root, 0, None, True, False)])
    assert_close(g0, e0, f"root {rep}")
    snapshot = [t.clone() for pair in g0[1][0].gdn.values() for t in pair if t is not None]
    states = {id(graph): g0[1][0], id(eager): e0[1][0]}
    g1, e1 = both(
        graph,
        eager,
        lambda r: [SegmentRun(t, 70, states[id(r)], keep_state=i != 1, read_head=True) for i, t in enumerate(tails)],
    )
    assert_close(g1, e1, f"children {rep}")
    after = [t for pair in g0[1][0].gdn.values() for t in pair if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after, strict=True)), "a launch wrote its parent's state"
    kids = {id(graph): g1[1], id(eager): e1[1]}
    g2, e2 = both(
        graph,
        eager,
        lambda r: [
            SegmentRun(grand[0], 82, kids[id(r)][0], True, True),
            SegmentRun(grand[1], 103, kids[id(r)][2], False, True),
            SegmentRun(fresh, 0, None, False, True),
            SegmentRun(grand[2], 82, kids[id(r)][0], False, True),
        ],
    )
    assert_close(g2, e2, f"grandchildren {rep}")
    # a graph launch from an eager launch's state, and the other way round
    t = tokens(rng, vocab, 4)
    cross = graph.final_hidden([SegmentRun(t, 70, e0[1][0], False, True)])
    assert_close(cross, eager.final_hidden([SegmentRun(t, 70, g0[1][0], False, True)]), "cross")


@pytest.mark.gpu
def test_tree_launches_through_graphs(eager):
    """root -> 3 children (2 kept) -> grandchildren from 2 parents + a fresh prompt, three times
    (the last pass replays); the parents' states are never written by a launch."""
    graph, rng, vocab = twin(eager, 8), random.Random(2), eager.config.vocab_size
    hits = {}
    for rep in range(3):
        hits[rep] = graph.graphs.hits
        tree_pass(graph, eager, rng, vocab, rep)
    # every pass after the first replays all four launches, though the first grew the buffers
    assert graph.graphs.hits - hits[1] == 8 and graph.graphs.failures == 0, (hits, graph.graphs.hits)


@pytest.mark.gpu
def test_scores_and_capture_failure_fallback(eager, monkeypatch):
    from openjev.worker.runner_api import SegmentRun

    graph, rng, vocab = twin(eager, 2), random.Random(3), eager.config.vocab_size
    runs = [SegmentRun(tokens(rng, vocab, n), 0, None, False, True) for n in (50, 7)]
    for a, b in zip(graph.run_launch(runs), eager.run_launch(runs), strict=True):
        assert abs(a.head_score - b.head_score) <= TOL * max(1.0, abs(b.head_score))

    def broken(*args, **kwargs):
        raise RuntimeError("planted capture failure")

    monkeypatch.setattr(graph.graphs.cache, "capture", broken)
    failures0 = graph.graphs.failures
    for _ in range(2):  # the second launch of the failed shape is not captured again
        runs = [SegmentRun(tokens(rng, vocab, 200), 0, None, True, True)]
        assert_close(graph.final_hidden(runs), eager.final_hidden(runs), "fallback")
    assert graph.graphs.failures == failures0 + 1


def test_buckets_and_keys():
    """One key type; a pass's key from its tokens, depth and kept states; the warm-up set holds
    every key a pass within budget maps to."""
    from openjev.worker.cuda.buckets import MAX_STATE_SLOTS, Bucketing, PassBudget
    from openjev.worker.cuda.graphs import fine_bucket

    assert [fine_bucket(n) for n in (1, 16, 17, 100, 512, 513, 792, 2048, 2049)] == [
        16,
        16,
        32,
        112,
        512,
        576,
        832,
        2048,
        2304,
    ]
    # untiled: 4 token steps an octave everywhere, every key 4 levels x kept or not
    b = Bucketing(PassBudget(tokens=4096, segments=64, depth=8, context=16384, tile_from=0))
    keys = b.keys()
    assert len(keys) == len(set(keys)) == len(b.token_steps()) * 4 * 2
    assert b.token_steps()[:5] == [16, 32, 48, 64, 80] and b.token_steps()[-1] == 4096
    assert b.level_steps() == [1, 2, 4, 8]
    key, why = b.key(tokens=166, segments=34, levels=3, parents=0, kept=0, base=0, kv_rows=500)
    assert why == "" and (key.tokens, key.levels, key.kept, key.segments, key.max_q) == (192, 4, False, 65, 192)
    assert key in keys
    key, _ = b.key(tokens=10, segments=10, levels=1, parents=2, kept=1, base=100, kv_rows=200)
    assert (key.tokens, key.segments, key.kept) == (16, 17, True) and key in keys
    for args in (
        dict(tokens=4097, segments=1, levels=1, parents=0, kept=0, base=0, kv_rows=1),
        dict(tokens=100, segments=65, levels=1, parents=0, kept=0, base=0, kv_rows=1),
        dict(tokens=100, segments=9, levels=9, parents=0, kept=0, base=0, kv_rows=1),
        dict(tokens=100, segments=9, levels=1, parents=MAX_STATE_SLOTS + 1, kept=0, base=0, kv_rows=1),
        dict(tokens=100, segments=9, levels=1, parents=0, kept=MAX_STATE_SLOTS + 1, base=0, kv_rows=1),
        dict(tokens=100, segments=9, levels=1, parents=1, kept=0, base=16385, kv_rows=1),
    ):
        key, why = b.key(**args)
        assert key is None and why, args
    # split: a pass plans up to twice the budget's segments, but holds at most its sequences (the
    # chunked kernel's held scratch is sized by them: graph_launch._Statics)
    split = Bucketing(PassBudget(tokens=4096, segments=64, depth=8, context=16384), chunked_from=128)
    pass_of = dict(tokens=2000, segments=100, levels=1, parents=0, kept=0, base=0, kv_rows=2000, chunked_levels=1)
    assert split.key(**pass_of, callers=64)[0] is not None
    assert split.key(**pass_of, callers=65) == (None, "65 sequences > budget 64")
    # the default: above 1,024 tokens, multiples of 128 rows, keys of levels 2 or 8 that keep
    tiled = Bucketing(PassBudget(tokens=4096, segments=64, depth=8, context=16384))
    steps = tiled.token_steps()
    assert steps[: steps.index(1024) + 1] == b.token_steps()[: b.token_steps().index(1024) + 1]
    assert steps[steps.index(1024) + 1 :] == list(range(1152, 4097, 128))
    assert len(tiled.keys()) == len(set(tiled.keys())) == 20 * 4 * 2 + 24 * 2 < len(keys)
    long_key, _ = tiled.key(3090, 2, 1, 0, 0, 0, 3090)
    assert (long_key.tokens, long_key.levels, long_key.kept) == (3200, 2, True)
    assert b.key(3090, 2, 1, 0, 0, 0, 3090)[0].tokens == 3584
    assert tiled.key(1025, 9, 3, 0, 1, 0, 1025)[0].levels == 8 and tiled.key(1024, 2, 1, 0, 0, 0, 1024)[0].levels == 1
    # every pass within budget lands on a warm key
    import random

    rng = random.Random(0)
    for bucketing in (b, tiled):
        warm = set(bucketing.keys())
        for _ in range(2000):
            t = rng.randint(1, 4096)
            segments, levels = rng.randint(1, min(t, 64)), rng.randint(1, 8)
            key, why = bucketing.key(t, segments, levels, rng.randint(0, 8), rng.randint(0, 8), 0, t)
            assert key in warm and key.segments >= 1 + min(t, 64) and key.max_q >= t and key.tokens >= t
            assert key.levels >= levels and key.tokens < (
                t + 128 if t > 1024 and bucketing is tiled else t * 5 // 4 + 16
            )
    # a small budget: every key's index layout fits the largest
    small = Bucketing(PassBudget(tokens=256, segments=8, depth=2, context=512))
    assert len(small.keys()) == 12 * 2 * 2
    assert all(k.index_size <= max(x.index_size for x in small.keys()) for k in small.keys())


def test_every_token_count_lands_on_a_warmed_key_whatever_the_tile_start():
    """A tile_from between fine bucket sizes makes buckets non-monotone (1,100 tokens pad to
    1,280 and 1,101 to 1,152); every count's bucket is still among the warm-up's keys."""
    from openjev.worker.cuda.buckets import Bucketing, PassBudget

    for tile_from in (0, 1024, 1100, 1500, 3965):
        budget = PassBudget(tokens=4096, segments=64, depth=8, context=16384, tile_from=tile_from)
        steps = set(Bucketing(budget).token_steps())
        missing = [n for n in range(1, 4097) if budget.bucket(n) not in steps]
        assert not missing, (tile_from, missing[:3])


def _pass_model(level_launches: bool, chunked_from: int | None = None):
    """A PassModel of the small shape on the CPU: what the launcher's keys and warm-up read."""
    from types import SimpleNamespace

    from openjev.worker.cuda.fused_weights import shape_config

    return SimpleNamespace(
        config=shape_config("small", 4),
        device=torch.device("cpu"),
        gdn_layers=[0],
        attn_layers=[3],
        chunked_from=chunked_from,
        level_launches=level_launches,
    )


def test_launches_that_ignore_levels_take_one_key_a_token_bucket():
    """The default recurrence runs a forest in one launch whatever its depth, so its keys do not
    split by levels: 64 graphs at the default budget instead of 208, each of the budget's depth,
    and every pass within budget still lands on one of them."""
    import random

    from openjev.worker.cuda.buckets import Bucketing, PassBudget
    from openjev.worker.cuda.graph_launch import GraphLauncher

    budget = PassBudget()
    by_levels, one = Bucketing(budget), Bucketing(budget, level_keys=False)
    assert len(by_levels.keys()) == 208 and len(one.keys()) == 20 * 2 + 24 == 64
    assert {k.levels for k in one.keys()} == {budget.depth}
    assert {(k.tokens, k.kept) for k in one.keys()} == {(k.tokens, k.kept) for k in by_levels.keys()}
    rng, warm = random.Random(1), set(one.keys())
    for _ in range(2000):
        t = rng.randint(1, budget.tokens)
        segments, levels = rng.randint(1, min(t, 64)), rng.randint(1, budget.depth)
        key, why = one.key(t, segments, levels, rng.randint(0, 8), rng.randint(0, 8), 0, t)
        assert key in warm and key.levels == budget.depth, why
    for level_launches, count in ((False, 64), (True, 208)):
        assert len(GraphLauncher(_pass_model(level_launches), 8).bucketing.keys()) == count


def test_keys_of_each_gdn_kernel():
    """The chunked kernel everywhere: no recurrence launch, its levels as the recurrence's were
    (208 keys); split at a position: the recurrence's one launch, and the chunked kernel's levels
    0 (no run past the split: none of its launches), 2 or the depth (192 keys). Every pass within
    budget lands on a warm key, a split pass with up to twice the budget's segments."""
    import random

    from openjev.worker.cuda.buckets import PassBudget
    from openjev.worker.cuda.graph_launch import GraphLauncher

    budget = PassBudget()
    chunked = GraphLauncher(_pass_model(False, chunked_from=0), 8).bucketing
    split = GraphLauncher(_pass_model(False, chunked_from=512), 8).bucketing
    assert len(chunked.keys()) == 208 and {k.levels for k in chunked.keys()} == {0}
    assert {k.chunked_levels for k in chunked.keys()} == {1, 2, 4, 8}
    assert len(split.keys()) == 3 * 64 and {k.levels for k in split.keys()} == {budget.depth}
    assert {k.chunked_levels for k in split.keys()} == {0, 2, 8} and split.max_segments == 128
    assert chunked.key(100, 9, 1, 0, 0, 0, 100)[0] is None  # a recurrence run: not this runner's
    rng = random.Random(2)
    for bucketing, most in ((chunked, 64), (split, 128)):
        warm = set(bucketing.keys())
        for _ in range(2000):
            t = rng.randint(1, budget.tokens)
            segments, chunked_levels = rng.randint(1, min(t, most)), rng.randint(1, budget.depth)
            levels = 0 if bucketing is chunked else rng.randint(0, budget.depth)
            args = (t, segments, levels, rng.randint(0, 8), rng.randint(0, 8), 0, t, chunked_levels)
            key, why = bucketing.key(*args)
            assert key in warm and key.chunked_levels >= chunked_levels and key.segments > segments, why


def test_a_failed_capture_at_start_stops_the_worker(monkeypatch):
    """warm_up reports a capture that failed (key and error), and the worker's start ends there
    rather than serving those shapes eagerly for good."""
    from types import SimpleNamespace

    from openjev.worker import main as worker_main
    from openjev.worker.cuda.buckets import PassBudget
    from openjev.worker.cuda.graph_launch import GraphLauncher

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)  # no GPU: accounting only
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    launcher = GraphLauncher(_pass_model(False), 8, budget=PassBudget(tokens=64, segments=8, depth=2, context=128))

    def broken(*args, **kwargs):
        raise RuntimeError("planted capture failure")

    monkeypatch.setattr(launcher.cache, "capture", broken)
    stats = launcher.warm_up()
    assert stats["graphs"] == 0 and stats["failures"] == len(launcher.bucketing.keys()) > 0
    assert "planted capture failure" in stats["first_failure"]
    with pytest.raises(SystemExit, match="CUDA graph captures failed at start.*planted capture failure"):
        worker_main.warm_up(None, SimpleNamespace(warm_up=launcher.warm_up), 1.0, "shared")


@pytest.mark.parametrize("level_launches,chunked_from", [(True, None), (False, None), (False, 0), (False, 512)])
def test_a_dummy_pass_fits_every_key_of_a_deep_budget(level_launches, chunked_from):
    """Keys whose levels exceed their tokens (a depth-32 budget's 16-token keys) get a dummy
    pass to capture with: it fits the key (before: a chain of negative length, and warm_up raised)."""

    from openjev.worker.cuda.buckets import PassBudget
    from openjev.worker.cuda.graph_launch import GraphLauncher

    launcher = GraphLauncher(
        _pass_model(level_launches, chunked_from), 8, budget=PassBudget(tokens=256, segments=64, depth=32, context=512)
    )
    keys = launcher.bucketing.keys()
    assert any(max(k.levels, k.chunked_levels) > k.tokens for k in keys)
    for key in keys:
        plan = launcher._dummy_plan(key)
        got, why = launcher.key_of(plan)
        assert got is not None, why
        assert (got.tokens, got.kept) == (key.tokens, key.kept) and got.levels <= key.levels
        assert got.chunked_levels <= key.chunked_levels and (got.chunked_levels > 0) == (key.chunked_levels > 0)


def test_static_buffers_are_fixed_at_the_budget():
    """The graphs' shared static buffers (no GPU needed: they are plain tensors), layer-major,
    sized once from the budget; slot 0 stays zero."""
    from types import SimpleNamespace

    from openjev.worker.cuda.buckets import MAX_STATE_SLOTS, Bucketing, PassBudget
    from openjev.worker.cuda.fused_weights import shape_config
    from openjev.worker.cuda.graph_launch import _Statics

    config = shape_config("small", 4)
    model = SimpleNamespace(
        config=config, device=torch.device("cpu"), gdn_layers=[0, 1, 2], attn_layers=[3], chunked_from=0
    )
    budget = PassBudget(tokens=300, segments=8, depth=2, context=100)
    statics = _Statics(model, Bucketing(budget))
    s = statics.ensure()
    assert statics.ensure() is s and s["kv"].shape[2] == 320 + 100  # top token bucket + context
    assert s["kv_rows"].numel() == Bucketing(budget).kv_rows == 9 * (100 + 320)
    assert s["st_in"].shape[:2] == (3, MAX_STATE_SLOTS + 1) and s["st_out"].shape[:2] == (3, MAX_STATE_SLOTS)
    assert s["win_in"][1].is_contiguous() and s["st_in"][2].is_contiguous()
    assert not s["st_in"][:, 0].any() and not s["win_in"][:, 0].any() and not s["tail_in"][:, 0].any()
    # a tail row: k fp32, v bf16 (two a word), g and beta fp32, in 4-byte words
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    assert s["tail_in"].shape[2:] == (64, -(-(hk * 128 + hv * 64 + 2 * hv) // 4) * 4)
    # the chunked kernel's scratch: 320 rows and 8 segments' tails and partial chunks
    chunks = (320 + 2 * 63 * 8) // 64 + 1
    assert s["chunk_w"].shape == s["chunk_u"].shape == (chunks, hv, 64, 128)
    assert s["chunk_gcum"].shape == (chunks, hv, 64) and s["chunk_kt"].shape == (chunks, hk, 64, 128)
    assert s["chunk_states"].shape == (chunks, hv, 128, 128)
    kv_rows = s["kv"][0, 0]
    assert kv_rows.is_contiguous() and kv_rows.shape[1:] == (config.num_key_value_heads, config.head_dim)
