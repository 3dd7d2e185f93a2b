"""Forest passes on the GPU, with each GDN kernel: one pass over parents and children gives bit for bit what one pass
per tree level gives and what each whole prompt run alone (policy `off`) gives; a request's
results do not depend on what shares its pass; graph replays equal eager passes bit for bit;
warm_up captures every key of the budget and nothing is captured after it.

Trees are built by the planner (worker/planner) from JevBench-shaped requests: a shared state
of tens to hundreds of tokens, one or two questions, 2-33 candidates of 1-12 tokens."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
BUDGET = dict(max_pass_tokens=512, max_pass_segments=48, max_pass_depth=4, max_pass_context=1024)


def _runner(**options):
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from openjev.worker.cuda.runner import CudaRunner

    return CudaRunner.synthetic("small", seed=5, num_layers=8, **BUDGET, **options)


@pytest.fixture(scope="module", params=["serial", "chunked", "split"])
def eager(request):  # split: the chunked kernel from position 128, so the prompts here cross it
    return _runner(graph_cache_size=0, gdn_kernel=request.param, gdn_split_at=128)


@pytest.fixture(scope="module")
def warmed(eager):
    from openjev.worker.cuda.runner import CudaRunner

    runner = CudaRunner.on_weights_of(
        eager,
        graph_cache_size=1,
        graph_capture_after=1,
        gemm_min_rows=1,
        **BUDGET,
    )  # capacity 1: warm_up must raise it to its key count
    runner.gemm_rows = dict(eager.gemm_rows)  # the same product padding as the eager runner
    runner.stats = runner.warm_up()
    return runner


@pytest.fixture(params=["eager", "graphs"])
def runner(request, eager, warmed):
    return eager if request.param == "eager" else warmed


def request_tree(rng: random.Random, vocab: int, policy: str = "shared"):
    """Planner TreeNodes of one JevBench-shaped request."""
    from openjev.worker.planner.policy import build_tree

    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    state = toks(rng.randint(20, 200))
    questions = []
    for _ in range(rng.choice((1, 1, 2))):
        q = state + toks(rng.randint(3, 30))
        common = toks(rng.randint(0, 3))
        questions.append([q + common + toks(rng.randint(1, 12)) for _ in range(rng.randint(2, 12))])
    return build_tree(questions, policy)


def forest_runs(trees, keep=lambda index: False):
    """One pass holding every node of every tree (parent_in_pass links), keep(node index) says
    which keep their state; per (tree, reader) its run."""
    from openjev.worker.runner_api import SegmentRun

    runs, readers = [], {}
    for t, nodes in enumerate(trees):
        offset = len(runs)
        for node in nodes:
            parent = None if node.parent is None else node.parent + offset
            runs.append(
                SegmentRun(
                    list(node.token_ids),
                    node.start_position,
                    None,
                    keep(len(runs) - offset),
                    bool(node.readers),
                    parent,
                )
            )
            for reader in node.readers:
                readers[(t, reader)] = len(runs) - 1
    return runs, readers


def scores(results, readers):
    return {key: results[i].head_score for key, i in readers.items()}


def level_passes(runner, nodes):
    """The tree one level per pass (parents' states kept): per reader its score, per node its state."""
    from openjev.worker.runner_api import SegmentRun

    depth = {}
    for i, n in enumerate(nodes):
        depth[i] = 0 if n.parent is None else depth[n.parent] + 1
    has_child = {n.parent for n in nodes}
    states, out = {}, {}
    for d in range(max(depth.values()) + 1):
        ids = [i for i in depth if depth[i] == d]
        runs = [
            SegmentRun(
                list(nodes[i].token_ids),
                nodes[i].start_position,
                None if nodes[i].parent is None else states[nodes[i].parent],
                i in has_child,
                bool(nodes[i].readers),
            )
            for i in ids
        ]
        for i, r in zip(ids, runner.run_launch(runs), strict=True):
            states[i] = r.state
            for reader in nodes[i].readers:
                out[(0, reader)] = r.head_score
    return out, states


def alone(runner, nodes):
    """Policy off: every reader's whole prompt alone in its own pass."""
    from openjev.worker.runner_api import SegmentRun

    out = {}
    for i, node in enumerate(nodes):
        prompt, j = [], i
        while j is not None:
            prompt = list(nodes[j].token_ids) + prompt
            j = nodes[j].parent
        for reader in node.readers:
            out[(0, reader)] = runner.run_launch([SegmentRun(prompt, 0, None, False, True)])[0].head_score
    return out


def assert_same_state(a, b, what):
    assert a.num_tokens == b.num_tokens, what
    for j in b.gdn:
        (wa, sa, ta), (wb, sb, tb) = a.gdn[j], b.gdn[j]
        assert torch.equal(wa, wb) and torch.equal(sa, sb), (what, j)
        # the chunked kernel's tail: only rows up to the end's position in its chunk are written
        # (nothing reads the rest)
        rows = a.num_tokens % 64
        assert (ta is None and tb is None) or torch.equal(ta[:rows], tb[:rows]), (what, j, "tail")
    la, lb = a.kv.lineage(), b.kv.lineage()
    for j in lb[-1].kv:
        for kv in (0, 1):
            x = torch.cat([nd.kv[j][kv] for nd in la])
            y = torch.cat([nd.kv[j][kv] for nd in lb])
            assert torch.equal(x, y), (what, j, kv)


def test_forest_pass_equals_level_passes_and_off(runner):
    rng = random.Random(0)
    for rep in range(3):
        nodes = request_tree(rng, runner.config.vocab_size)
        has_child = {n.parent for n in nodes}
        runs, readers = forest_runs([nodes], keep=lambda i, hc=has_child: i in hc)
        got = runner.run_launch(runs)
        by_level, states = level_passes(runner, nodes)
        assert scores(got, readers) == by_level, rep
        assert by_level == alone(runner, nodes), rep
        for i in has_child:  # kept states: the same bits as the level passes keep
            if i is not None:
                assert_same_state(got[i].state, states[i], (rep, i))


def test_batch_invariance_random_mixes(runner):
    """Random mixes of requests' whole trees, interleaved in random orders, plus a request
    continuing a kept state: each request's scores equal its pass alone."""
    from openjev.worker.runner_api import SegmentRun

    rng = random.Random(1)
    vocab = runner.config.vocab_size
    pool = [request_tree(rng, vocab, rng.choice(("shared", "default"))) for _ in range(8)]
    solo = []
    for tree in pool:
        runs, readers = forest_runs([tree])
        solo.append(scores(runner.run_launch(runs), readers))
    prefix = [rng.randrange(vocab) for _ in range(90)]
    kept = runner.run_launch([SegmentRun(prefix, 0, None, True, False)])[0].state
    cont = [rng.randrange(vocab) for _ in range(7)]
    cont_alone = runner.run_launch([SegmentRun(cont, 90, kept, False, True)])[0].head_score
    for mix in range(6):
        chosen = rng.sample(range(len(pool)), rng.randint(2, 4))
        runs, readers = forest_runs([pool[c] for c in chosen])
        if sum(len(r.token_ids) for r in runs) > 480 or len(runs) > 46:
            continue
        # interleave: a random topological order of the pass's runs
        perm, placed, remaining = [], set(), list(range(len(runs)))
        while remaining:
            ready = [i for i in remaining if runs[i].parent_in_pass is None or runs[i].parent_in_pass in placed]
            i = rng.choice(ready)
            perm.append(i)
            placed.add(i)
            remaining.remove(i)
        where = {old: new for new, old in enumerate(perm)}
        mixed = [
            SegmentRun(
                r.token_ids,
                r.start_position,
                None,
                False,
                r.read_head,
                None if r.parent_in_pass is None else where[r.parent_in_pass],
            )
            for r in (runs[i] for i in perm)
        ] + [SegmentRun(cont, 90, kept, False, True)]
        results = runner.run_launch(mixed)
        for (t, reader), i in readers.items():
            assert results[where[i]].head_score == solo[chosen[t]][(0, reader)], (mix, t, reader)
        assert results[-1].head_score == cont_alone, mix


def test_graph_replay_equals_eager_bitwise(eager, warmed):
    rng = random.Random(2)
    for rep in range(4):
        nodes = request_tree(rng, eager.config.vocab_size)
        keep = {rng.randrange(len(nodes))}
        runs, _ = forest_runs([nodes], keep=lambda i, k=keep: i in k)
        (hg, sg), (he, se) = warmed.final_hidden(runs), eager.final_hidden(runs)
        assert torch.equal(hg, he), rep
        for a, b in zip(sg, se, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert_same_state(a, b, rep)


def test_warm_up_captures_every_key_and_nothing_after(eager, warmed):
    from openjev.worker.runner_api import SegmentRun

    L = warmed.graphs
    keys = set(L.bucketing.keys())
    assert warmed.stats["failures"] == 0, warmed.stats.get("first_failure")
    assert warmed.stats["graphs"] == len(keys) == L.cache.num_captures
    assert set(L.cache._entries) == keys
    captures, hits, fallbacks = L.cache.num_captures, L.hits, L.fallbacks
    rng = random.Random(3)
    passes = 0
    for _ in range(10):
        runs, _ = forest_runs([request_tree(rng, eager.config.vocab_size) for _ in range(rng.randint(1, 2))])
        if sum(len(r.token_ids) for r in runs) > 512 or len(runs) > 48:
            continue
        warmed.run_launch(runs)
        passes += 1
    assert L.cache.num_captures == captures and L.hits - hits == passes and L.fallbacks == fallbacks
    # outside the budget: eager, counted, same answer
    big = [SegmentRun([rng.randrange(eager.config.vocab_size) for _ in range(600)], 0, None, False, True)]
    assert warmed.run_launch(big)[0].head_score == eager.run_launch(big)[0].head_score
    assert L.fallbacks == fallbacks + 1 and L.cache.num_captures == captures


# A pass whose conv windows come from everywhere (tokens, in-pass parent, kept prefix): in-pass
# ancestors' rows, through parents of 1 and 2 tokens (2, 3, 7, 12); kept states of earlier passes
# (5, 6, 7, 8, 9; prefix 1 has 2 tokens, so its window holds a zero row); zeros at a prompt's
# start, then rows (10, 11, 12); 4 levels. Kept: 2, 6, 9, 12.
SOURCES_PASS = [
    (30, None, None),  # 0
    (1, 0, None),  # 1
    (2, 1, None),  # 2
    (5, 2, None),  # 3
    (1, 0, None),  # 4
    (1, None, 0),  # 5
    (1, 5, None),  # 6
    (4, 6, None),  # 7
    (2, None, 1),  # 8
    (1, 8, None),  # 9
    (1, None, None),  # 10
    (1, 10, None),  # 11
    (3, 11, None),  # 12
]
SOURCES_KEPT = {2, 6, 9, 12}


def window_sources_pass(runner, seed: int):
    """(runs of SOURCES_PASS, each run's whole prompt): the kept prefixes run first, in their own
    passes."""
    from openjev.worker.runner_api import SegmentRun

    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(runner.config.vocab_size) for _ in range(n)]  # noqa: E731
    prefixes = [toks(40), toks(2)]
    kept = [runner.run_launch([SegmentRun(p, 0, None, True, False)])[0].state for p in prefixes]
    runs, prompts = [], []
    for i, (n, parent, ext) in enumerate(SOURCES_PASS):
        own = toks(n)
        before = prompts[parent] if parent is not None else [] if ext is None else prefixes[ext]
        runs.append(SegmentRun(own, len(before), None if ext is None else kept[ext], i in SOURCES_KEPT, True, parent))
        prompts.append(before + own)
    return runs, prompts


def test_forest_pass_window_sources_equal_alone(runner):
    """Every run of a pass whose conv windows come from in-pass ancestors (short ones included),
    kept states of earlier passes and zeros: its score and kept state are bit for bit those of its
    whole prompt alone."""
    from openjev.worker.runner_api import SegmentRun

    runs, prompts = window_sources_pass(runner, seed=4)
    results = runner.run_launch(runs)
    for i, (run, prompt) in enumerate(zip(runs, prompts, strict=True)):
        alone = runner.run_launch([SegmentRun(prompt, 0, None, run.keep_state, True)])[0]
        assert results[i].head_score == alone.head_score, i
        if run.keep_state:
            assert_same_state(results[i].state, alone.state, i)


def test_window_sources_equal_gathered_windows(eager, monkeypatch):
    """The runner's conv reading each window at its source gives bit for bit what it gave when
    every GDN layer first gathered the windows into [N, 3, C] (two index_selects and a where,
    Launch.windows until 2026-12-01) and the kernel read those: head rows and kept states."""
    from openjev.worker.cuda import kernels

    direct, calls = kernels.causal_conv1d, []

    def gathered(x, weight, windows, win_src, cu_seqlens, out=None, new_window=None):
        calls.append(1)
        src = win_src.long()
        picked = torch.where(
            (src >= 0)[:, None],
            x.index_select(0, src.clamp(min=0)),
            windows.flatten(0, 1).index_select(0, (-1 - src).clamp(min=0)),
        ).view(-1, 3, x.shape[1])
        own = kernels.own_windows(picked.shape[0], x.device)
        return direct(x, weight, picked, own, cu_seqlens, out=out, new_window=new_window)

    runs, _ = window_sources_pass(eager, seed=5)
    hidden, states = eager.final_hidden(runs)
    monkeypatch.setattr(kernels, "causal_conv1d", gathered)
    old_hidden, old_states = eager.final_hidden(runs)
    assert len(calls) == len(eager.gdn_layers), "the gathered path did not run"
    assert torch.equal(hidden, old_hidden)
    for i, (a, b) in enumerate(zip(states, old_states, strict=True)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert_same_state(a, b, i)
