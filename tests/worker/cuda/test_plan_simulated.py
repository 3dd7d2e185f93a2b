"""The forest plan's indices, eager and as a captured graph's buffers hold them, against each
run's prompt, on the CPU (no CUDA needed). Tokens are unique ids, so every read names its source:
a GDN state is the tuple of ids it has taken in, a conv window the 3 ids before a run, a kept
tail the ids from the state's last multiple of 64. The kernels are simulated from the indices
alone (the recurrence in one launch, a child after its parent; the chunked kernel a level at a
time, from the state at the 64-multiple below the start plus tail rows) and every run must read:
- the conv window, starting state and tail rows its prompt gives;
- attention keys = the prompt's tokens 0..end-1 in order;
and leave the final state, kept tail and K/V chain its prompt gives, with head rows in the
caller's order. Passes run several in a row, so kept states (tails included) become parents of
later ones; the chunked kernel from chunked_from None (nowhere), 0 (everywhere) or a position
the runs cross. Beyond test_forest_plan: the graph fill's indices, whole chains of passes and
the chunked kernel's states on the 64-token grid."""

from __future__ import annotations

import functools
import itertools
import random
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from openjev.worker.cuda import chunked_gdn as KC
from openjev.worker.cuda.buckets import PassBudget
from openjev.worker.cuda.launch import plan_launch
from openjev.worker.geometry import GDN_CHUNK_TOKENS as CH
from openjev.worker.runner_api import SegmentRun

GDN, ATTN = 0, 1
BUDGET = PassBudget(tokens=512, segments=24, depth=4, context=2048, tile_from=256)
DEEP = PassBudget(tokens=1024, segments=64, depth=8, context=4096, tile_from=512)


@functools.cache
def launcher(split: int | None, level_launches: bool, budget: PassBudget):
    """A GraphLauncher of the small shape on the CPU, its static buffers allocated."""
    from openjev.worker.cuda.fused_weights import shape_config
    from openjev.worker.cuda.graph_launch import GraphLauncher

    model = SimpleNamespace(
        config=shape_config("small", 2),
        device=torch.device("cpu"),
        gdn_layers=[GDN],
        attn_layers=[ATTN],
        chunked_from=split,
        level_launches=level_launches,
    )
    graphs = GraphLauncher(model, 8, budget=budget)
    graphs.statics.ensure()
    return graphs


def eager_indices(plan) -> dict:
    """The indices CudaRunner._eager launches with."""
    rows, cu_k = plan.kv_rows(len(plan.ids))
    levels, chunked_levels = plan.recurrent_levels, plan.chunked_levels
    names = ("ids", "cu", "heads", "gdn_init", "win_src", "tail_src")
    v = {name: list(getattr(plan, name)) for name in names}
    v.update(pos=plan.positions, cu_k=list(cu_k), kv_rows=list(rows), level_off=plan.level_off(levels, chunked_levels))
    scratch = KC.scratch_chunks(len(plan.ids), len(plan.runs))  # as gdn_chunked sizes it eagerly
    return v | {"levels": levels, "chunked_levels": chunked_levels, "anc_base": len(plan.ids), "scratch": scratch}


def graph_indices(plan, graphs) -> dict | None:
    """The indices GraphLauncher._fill writes, read back from its static buffers (None: no key)."""
    key, _ = graphs.key_of(plan)
    if key is None:
        return None
    assert key in set(graphs.bucketing.keys()), f"{key} is not warmed"
    with mock.patch.object(torch, "_foreach_copy_", lambda *a, **k: None):  # parents hold ids, not tensors
        graphs._fill(plan, key)
    s = graphs.statics.buffers
    idx = s["idx"][: key.index_size].tolist()
    v = {name: idx[at : at + n] for name, (at, n) in key.layout().items()}
    v["kv_rows"] = s["kv_rows"][: v["cu_k"][-1]].tolist()
    # the scratch slots gdn_chunked takes in a captured pass, from what the pass's io hands it
    held, listed = graphs.io(key, None).gdn_scratch()
    scratch = KC.scratch_chunks(key.tokens, key.segments if listed is None else min(key.segments, listed))
    assert held is None or scratch <= held.w.shape[0], f"{key}: {scratch} scratch chunks, {held.w.shape[0]} held"
    return v | {"levels": key.levels, "chunked_levels": key.chunked_levels, "anc_base": key.tokens, "scratch": scratch}


def simulate(v: dict, slots: list, pool: list) -> list[dict]:
    """Per segment what the kernels read and write, from the indices v alone. slots: per state
    slot (window, state, tail or None); pool: the attention pool's ids."""
    ids, cu = v["ids"], v["cu"]
    windows = [w for s in slots for w in s[0]]
    tails = [t for s in slots for t in (s[2] or ("stale",) * CH)]  # a slot without a tail: rows nobody wrote
    segs = []
    for n in range(len(cu) - 1):
        window = tuple(ids[r] if r >= 0 else windows[-1 - r] for r in v["win_src"][3 * n : 3 * n + 3])
        keys = tuple(pool[r] for r in v["kv_rows"][v["cu_k"][n] : v["cu_k"][n + 1]])
        segs.append({"own": tuple(ids[cu[n] : cu[n + 1]]), "window": window, "keys": keys, "kernel": None})
    final: list = [None] * len(segs)

    def init(n: int, written: list) -> tuple:
        src = v["gdn_init"][n]
        if src < -1:
            assert written[-2 - src] is not None, f"segment {n} starts from parent {-2 - src}, not written yet"
            return written[-2 - src]
        return () if src == -1 else slots[src][1]

    off, levels = v["level_off"], v["levels"]
    for n in range(off[0], off[levels]):  # the recurrence: one launch
        if cu[n + 1] > cu[n]:
            seg = segs[n]
            seg.update(kernel="recurrence", init=init(n, final))
            final[n] = seg["init"] + seg["own"]
    chunks = 0  # scratch slots: every listed segment's chunks, tail rows included (gdn_chunk_plan)
    for d in range(v["chunked_levels"]):  # the chunked kernel: a launch a level
        written = list(final)
        for n in range(off[levels + d], off[levels + d + 1]):
            if cu[n + 1] == cu[n]:
                continue
            seg, start = segs[n], v["pos"][cu[n]]
            end = start + len(seg["own"])
            rows = v["tail_src"][CH * n : CH * n + start % CH]
            tail = tuple(ids[r] if r >= 0 else tails[-1 - r] for r in rows)
            seg.update(kernel="chunked", init=init(n, written), tail=tail)
            chunks += -(-(len(tail) + len(seg["own"])) // CH)
            whole = seg["init"] + tail + seg["own"]
            final[n] = whole[: end - end % CH]
            seg["tail_out"] = whole[end - end % CH :] + (None,) * (CH - end % CH)
    assert chunks <= v["scratch"], f"{chunks} chunks in {v['scratch']} scratch slots"
    for seg, f in zip(segs, final, strict=True):
        seg["final"] = f
    return segs


def run_pass(runs: list, prompts: list, split: int | None, graphs=None) -> list | None:
    """Plan a pass, simulate it from its eager (graphs None) or graph indices and check every
    run against its prompt (prompts[o]: caller run o's tokens to its end). Returns the caller's
    kept states; None where no graph key fits the pass."""
    from openjev.worker.cuda.runner import CudaRunner

    plan = plan_launch(runs, vocab_size=2**31 - 1, chunked_from=split)
    v = eager_indices(plan) if graphs is None else graph_indices(plan, graphs)
    if v is None:
        return None
    slots = [((0, 0, 0), (), None)] + [p.gdn[GDN] for p in plan.parents]
    pool = v["ids"][: v["anc_base"]] + [t for nd in plan.nodes for t in nd.kv[ATTN][0]]
    segs = simulate(v, slots, pool)
    N, mode = len(plan.runs), "eager" if graphs is None else "graph"
    ends = [run.start_position + len(run.token_ids) for run in plan.runs]
    # a split run's first part: a prefix of the prompt of its other part (its one in-pass child)
    whole = [
        prompts[o] if o >= 0 else prompts[plan.order[plan.in_parent.index(i)]][: ends[i]]
        for i, o in enumerate(plan.order)
    ]
    gdn: list = [None] * N
    for i, (run, seg, prompt, end) in enumerate(zip(plan.runs, segs, whole, ends, strict=False)):
        start = run.start_position
        at = f"{mode} run {i} (caller {plan.order[i]}, positions {start}..{end})"
        assert len(prompt) == end and seg["own"] == prompt[start:end], f"{at}: own rows"
        window = ((0, 0, 0) + prompt[:start])[-3:]
        assert seg["window"] == window, f"{at}: conv window {seg['window']}, its prompt's {window}"
        assert seg["keys"] == prompt, f"{at}: attention keys"
        want = "chunked" if split is not None and start >= split else "recurrence"
        assert seg["kernel"] == want, f"{at}: run by the {seg['kernel']} kernel"
        chunk = start - start % CH if want == "chunked" else start
        assert seg["init"] == prompt[:chunk], f"{at}: starting state of {len(seg['init'])} tokens, not {chunk}"
        if want == "chunked":
            tail = prompt[chunk:start]
            assert seg["tail"] == tail, f"{at}: tail rows {seg['tail'][:4]}..., its prompt's {tail[:4]}..."
        assert seg["final"] == prompt[: end - end % CH if want == "chunked" else end], f"{at}: final state"
        if run.keep_state:  # as the runner collects kept states
            tail = plan.keeps_tail(i)
            assert tail == (want == "chunked"), f"{at}: keeps_tail {tail} for a run of the {want} kernel"
            window = (seg["window"] + seg["own"])[-3:]
            gdn[i] = {GDN: (window, seg["final"], seg["tail_out"] if tail else None)}
    heads = [v["heads"][h] for h in (plan.head_order or range(len(plan.heads)))]
    readers = [o for o, run in enumerate(runs) if run.read_head]
    assert [v["ids"][h] for h in heads] == [prompts[o][-1] for o in readers], f"{mode}: head rows"
    if graphs is not None:
        kept = [i for i, run in enumerate(plan.runs) if run.keep_state]
        assert v["keep"][: len(kept)] == kept, f"{mode}: kept runs {v['keep']}, not {kept}"
    kv = [None] * N
    for i in plan.materialise:
        kv[i] = {ATTN: (segs[i]["own"], segs[i]["own"])}
    states = CudaRunner.states_of(None, plan, gdn, kv)
    for o, (run, state) in enumerate(zip(runs, states, strict=True)):
        if run.keep_state:
            chain = tuple(t for nd in state.kv.lineage() for t in nd.kv[ATTN][0])
            assert chain == prompts[o] and state.num_tokens == len(prompts[o]), f"{mode}: kept chain of caller run {o}"
    return states


def length(rnd: random.Random, start: int, split: int | None) -> int:
    """A segment's length; often ending next to a multiple of 64 or the split, where sources change."""
    near = [m * CH + d for m in range(start // CH, start // CH + 4) for d in (-1, 0, 1)]
    near = [t - start for t in near + ([split - 1, split, split + 1] if split else []) if t > start]
    r = rnd.random()
    return rnd.choice(near) if r < 0.45 else rnd.randint(1, 6) if r < 0.75 else rnd.randint(1, 90)


def random_pass(rnd, tokens, kept: list, split, depth: int, roots: int, children: tuple, most: int):
    """A pass of random trees (a segment's children: a choice of `children`, up to `depth`)
    within `most` tokens, parents before children, trees interleaved: (runs, prompts). A root
    continues a kept (state, prompt) of an earlier pass half the time."""
    while True:
        nodes = []  # (parent node or None, kept state, start, prompt)
        frontier = []
        for _ in range(rnd.randint(1, roots)):
            state, prompt = rnd.choice(kept) if kept and rnd.random() < 0.5 else (None, ())
            frontier.append((None, state, prompt, 1))
        while frontier:
            parent, state, prompt, d = frontier.pop(rnd.randrange(len(frontier)))
            start = len(prompt)
            prompt += tuple(next(tokens) for _ in range(length(rnd, start, split)))
            nodes.append((parent, state, start, prompt))
            for _ in range(rnd.choice(children) if d < depth else 0):
                frontier.append((len(nodes) - 1, None, prompt, d + 1))
        if sum(len(prompt) - start for _, _, start, prompt in nodes) <= most:
            break
    order, index = [], {}
    while len(order) < len(nodes):
        i = rnd.choice([i for i, nd in enumerate(nodes) if i not in index and (nd[0] is None or nd[0] in index)])
        index[i] = len(order)
        order.append(i)
    runs, prompts = [], []
    for i in order:
        parent, state, start, prompt = nodes[i]
        in_pass = None if parent is None else index[parent]
        runs.append(SegmentRun(list(prompt[start:]), start, state, rnd.random() < 0.4, rnd.random() < 0.7, in_pass))
        prompts.append(prompt)
    return runs, prompts


def passes_in_a_row(seed: int, split, budget, passes: int, depth: tuple, roots: int, children: tuple) -> int:
    """Random passes in a row, each checked eager and through both kinds of graph keys; kept
    states of each pass become parents of later ones. Returns the graph fills a key fitted."""
    rnd, tokens, kept, fitted = random.Random(seed), itertools.count(1), [], 0
    for _ in range(passes):
        runs, prompts = random_pass(rnd, tokens, kept, split, rnd.randint(*depth), roots, children, budget.tokens)
        states = run_pass(runs, prompts, split)
        kept += [(state, prompts[o]) for o, state in enumerate(states) if state is not None]
        for level_launches in (False, True):
            fitted += run_pass(runs, prompts, split, launcher(split, level_launches, budget)) is not None
    return fitted


@pytest.mark.parametrize("split", [None, 0, 64, 128])
@pytest.mark.parametrize("seed", range(32))
def test_passes_in_a_row(seed, split):
    """Five passes of up to 4 trees, 4 levels and 512 tokens, segments ending around the chunk
    grid and the split."""
    fitted = passes_in_a_row(seed, split, BUDGET, passes=5, depth=(1, 4), roots=4, children=(0, 0, 1, 1, 2, 3))
    assert fitted >= 8, f"only {fitted} of 10 graph fills fitted a key"


@pytest.mark.parametrize("split", [None, 0, 64, 192])
@pytest.mark.parametrize("seed", range(8))
def test_deep_trees(seed, split):
    """Six passes of up to 3 trees of 3-8 levels (a depth-8 budget), split at 192 as well."""
    fitted = passes_in_a_row(100 + seed, split, DEEP, passes=6, depth=(3, 8), roots=3, children=(0, 1, 1, 1, 2))
    assert fitted >= 10, f"only {fitted} of 12 graph fills fitted a key"


@pytest.mark.parametrize("split", [64, 128])
@pytest.mark.parametrize("seed", range(8))
def test_many_runs_crossing_the_split(seed, split):
    """A pass at the budget's edges: 22-24 runs, most from 8 kept states ending short of the
    split and crossing it, some with in-pass children, up to 8 kept: 40-45 segments once split,
    past the budget's 24, which a split key's doubled segments must still fit."""
    rnd, tokens = random.Random(seed), itertools.count(1)
    prompts = [tuple(next(tokens) for _ in range(split - rnd.randint(1, 15))) for _ in range(8)]
    runs = [SegmentRun(list(p), 0, None, True, rnd.random() < 0.5) for p in prompts]
    kept = list(zip(run_pass(runs, prompts, split), prompts, strict=True))
    runs, prompts = [], []
    for k in range(rnd.randint(22, 24)):
        if k and rnd.random() < 0.15 and runs[-1].parent_in_pass is None:  # a child of the run before
            start, state, prompt, parent = len(prompts[-1]), None, prompts[-1], k - 1
            n = rnd.randint(1, 3)
        else:
            roots = sum(run.parent_in_pass is None for run in runs)
            (state, prompt), parent = kept[roots] if roots < 8 else rnd.choice(kept), None  # each parent once first
            start = state.num_tokens
            n = split - start + rnd.randint(1, 6)
        prompts.append(prompt + tuple(next(tokens) for _ in range(n)))
        keep = sum(run.keep_state for run in runs) < 8 and rnd.random() < 0.3
        runs.append(SegmentRun(list(prompts[-1][start:]), start, state, keep, rnd.random() < 0.7, parent))
    plan = plan_launch(runs, vocab_size=2**31 - 1, chunked_from=split)
    assert len(plan.runs) > BUDGET.segments and len(plan.parents) == 8, "not at the budget's edges"
    run_pass(runs, prompts, split)
    for level_launches in (False, True):
        assert run_pass(runs, prompts, split, launcher(split, level_launches, BUDGET)) is not None


@pytest.mark.parametrize("split", [0, 128])
def test_more_callers_than_the_budget_never_fit_the_held_scratch(split):
    """Runs of 2 tokens after a kept state ending at 63 mod 64 (63 tail rows): 2 scratch chunks
    a run. Up to the budget's sequences a graph key holds them; one more, none may (a split
    pass plans up to twice the budget's segments, but the held scratch counts its sequences)."""
    tokens = itertools.count(1)
    prompt = tuple(next(tokens) for _ in range(191))
    (state,) = run_pass([SegmentRun(list(prompt), 0, None, True, False)], [prompt], split)
    for callers in (BUDGET.segments, BUDGET.segments + 1, 2 * BUDGET.segments):
        prompts = [prompt + (next(tokens), next(tokens)) for _ in range(callers)]
        runs = [SegmentRun(list(p[191:]), 191, state, False, True) for p in prompts]
        fitted = run_pass(runs, prompts, split, launcher(split, False, BUDGET)) is not None
        assert fitted == (callers <= BUDGET.segments), (callers, fitted)
