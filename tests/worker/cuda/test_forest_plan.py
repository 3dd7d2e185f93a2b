"""The host side of a forest pass, on the CPU (no CUDA needed): for random forests of random
trees (segments of 1-6 tokens, so conv windows reach past short parents; some roots continue
kept states of earlier passes), the plan's indices, applied the way the kernels apply them, give
each run exactly what running its whole prompt alone gives:
- conv windows read through win_src (reference.conv_windows, as the conv kernel reads them) =
  the 3 inputs before the run in its prompt;
- the recurrence run level by level from plan.gdn_init (kernels.gdn_recurrent's semantics) =
  the token recurrence over the whole prompt, bit for bit;
- the keys kv_rows lists = the prompt's positions 0..end-1 in order;
and results come back in the caller's order, kept chains pass through in-pass ancestors. With
the chunked GDN kernel from a position (`--gdn-kernel split`), runs crossing it are split there,
the recurrence's runs come first, and a chunked run starts from the state its parent (of either
kind) leaves."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from openjev.worker.cuda.launch import CudaSegmentState, KvNode, Launch, plan_launch
from openjev.worker.cuda.reference import conv_windows
from openjev.worker.runner_api import SegmentRun

C, DK, DV = 8, 4, 4
GDN_LAYER, ATTN_LAYER = 0, 1


@dataclass
class Seg:
    """A segment of a tree: its own rows' features, and what came before it."""

    feats: dict  # x [n, C] bf16, k [n, DK], q, v [n, DV], g [n], beta [n] fp64, marker [n] (position ids)
    parent: Seg | None = None
    ext: CudaSegmentState | None = None  # a kept state of an earlier pass (for roots)
    prefix: dict | None = None  # the features of the rows that state covers
    children: list = field(default_factory=list)


def feats(rng: torch.Generator, n: int, start: int, prompt: int) -> dict:
    return {
        "x": torch.randn(n, C, generator=rng).bfloat16(),
        "k": torch.nn.functional.normalize(torch.randn(n, DK, generator=rng, dtype=torch.float64), dim=-1),
        "v": torch.randn(n, DV, generator=rng, dtype=torch.float64),
        "g": -torch.rand(n, generator=rng, dtype=torch.float64),
        "beta": torch.rand(n, generator=rng, dtype=torch.float64),
        "marker": torch.arange(start, start + n) + 100_000 * prompt,
    }


def cat(parts: list[dict]) -> dict:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def recurrence(f: dict, state: torch.Tensor) -> torch.Tensor:
    """The delta rule token by token (the serial kernel's order): the final state [DK, DV]."""
    for t in range(f["k"].shape[0]):
        eg, k = torch.exp(f["g"][t]), f["k"][t]
        delta = f["beta"][t] * (f["v"][t] - eg * (state.T @ k))
        state = eg * state + torch.outer(k, delta)
    return state


def window_of(x: torch.Tensor) -> torch.Tensor:
    """The last 3 rows of x [n, C], zero rows before the prompt's start."""
    return torch.cat([torch.zeros(3, C, dtype=x.dtype), x])[-3:]


def prompt_of(seg: Seg) -> list[dict]:
    chain = []
    while seg is not None:
        chain.append(seg.feats)
        if seg.prefix is not None:
            chain.append(seg.prefix)
        seg = seg.parent
    return chain[::-1]


def kept_state(rng: torch.Generator, prompt: int, n: int) -> tuple[CudaSegmentState, dict]:
    """A fake kept state covering n rows (two KvNodes), and those rows' features."""
    f = feats(rng, n, 0, prompt)
    cut = n // 2
    root = KvNode(None, cut, {ATTN_LAYER: (f["marker"][:cut], f["marker"][:cut])})
    node = KvNode(root, n - cut, {ATTN_LAYER: (f["marker"][cut:], f["marker"][cut:])})
    gdn = {GDN_LAYER: (window_of(f["x"]), recurrence(f, torch.zeros(DK, DV, dtype=torch.float64)), None)}
    return CudaSegmentState(n, gdn, node), f


def random_forest(seed: int, requests: int, depth: int, kept_rows: tuple[int, int] = (1, 9)):
    """Runs of one pass (parents before children, requests interleaved) and their segments;
    kept_rows: the range of a kept state's rows, where a root continues one."""
    rnd, rng = random.Random(seed), torch.Generator().manual_seed(seed)
    segs: list[Seg] = []
    for prompt in range(requests):
        ext, prefix = (None, None)
        if rnd.random() < 0.4:
            ext, prefix = kept_state(rng, prompt, rnd.randint(*kept_rows))
        start = 0 if ext is None else ext.num_tokens
        root = Seg(feats(rng, rnd.randint(1, 6), start, prompt), None, ext, prefix)
        frontier, tree = [(root, start, 1)], [root]
        while frontier:
            seg, at, d = frontier.pop(rnd.randrange(len(frontier)))
            end = at + seg.feats["k"].shape[0]
            for _ in range(rnd.randint(0, 3) if d < depth else 0):
                child = Seg(feats(rng, rnd.randint(1, 6), end, prompt), seg)
                seg.children.append(child)
                tree.append(child)
                frontier.append((child, end, d + 1))
        segs.append(tree)
    order: list[Seg] = []
    pending = [list(t) for t in segs]  # each tree's segments in parent-first order
    while any(pending):
        tree = rnd.choice([t for t in pending if t])
        order.append(tree.pop(0))
    index = {id(s): i for i, s in enumerate(order)}
    runs = []
    for s in order:
        start = s.feats["marker"][0].item() % 100_000
        runs.append(
            SegmentRun(
                token_ids=[1] * s.feats["k"].shape[0],
                start_position=start,
                parent_state=s.ext,
                keep_state=rnd.random() < 0.3,
                read_head=rnd.random() < 0.7,
                parent_in_pass=None if s.parent is None else index[id(s.parent)],
            )
        )
    return runs, order


def device_launch(plan, T_pad_rows: int = 0) -> Launch:
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return Launch(
        ids=i32(plan.ids),
        cu=i32(plan.cu),
        pos=i32(plan.positions),
        head_idx=None,
        rope=(None, None),
        kv_rows=None,
        cu_k=None,
        max_q=plan.max_q,
        gdn_init=i32(plan.gdn_init),
        level_off=i32(plan.level_off(plan.num_levels)),
        num_levels=plan.num_levels,
        win_src=i32(plan.win_src),
    )


def internal_prompts(plan, runs, segs) -> list[dict]:
    """Per internal run the features of its prompt up to its end (rows = positions)."""
    whole: list = [None] * len(plan.runs)
    for i in reversed(range(len(plan.runs))):  # a split run's first part takes its second's prompt
        o = plan.order[i]
        if o >= 0:
            whole[i] = cat(prompt_of(segs[o]))
        else:
            child = next(j for j in range(i + 1, len(plan.runs)) if plan.in_parent[j] == i and plan.order[j] >= 0)
            whole[i] = whole[child]
    ends = [run.start_position + len(run.token_ids) for run in plan.runs]
    return [{name: t[:end] for name, t in w.items()} for w, end in zip(whole, ends, strict=True)]


@pytest.mark.parametrize("chunked_from", [0, 64])
@pytest.mark.parametrize("seed", range(12))
def test_forest_indices_give_each_run_its_whole_prompt(seed, chunked_from):
    kept_rows = (1, 9) if chunked_from == 0 else (50, 70)  # split: runs cross 64
    runs, segs = random_forest(seed, requests=1 + seed % 4, depth=1 + seed % 5, kept_rows=kept_rows)
    plan = plan_launch(runs, vocab_size=2, chunked_from=chunked_from)
    prompts = internal_prompts(plan, runs, segs)
    starts = [run.start_position for run in plan.runs]
    # each kernel's runs: the recurrence's wholly before chunked_from, first; each split at it
    for i, run in enumerate(plan.runs):
        assert (i >= plan.num_recurrent) == (starts[i] >= chunked_from)
        assert i >= plan.num_recurrent or starts[i] + len(run.token_ids) <= chunked_from
        if plan.order[i] < 0:  # a split run's first part
            assert not run.keep_state and not run.read_head and starts[i] < chunked_from
    assert sorted(o for o in plan.order if o >= 0) == list(range(len(runs))) and plan.callers == len(runs)
    # levels: sorted within each kernel's runs, each run one below an in-pass parent of its kernel
    r = plan.num_recurrent
    assert plan.level[:r] == sorted(plan.level[:r]) and plan.level[r:] == sorted(plan.level[r:])
    for i, p in enumerate(plan.in_parent):
        same = p >= 0 and (p >= r) == (i >= r)
        assert plan.level[i] == (plan.level[p] + 1 if same else 0)
        assert p < 0 or starts[p] + len(plan.runs[p].token_ids) == starts[i]
    rows = cat([{name: t[s:] for name, t in w.items()} for w, s in zip(prompts, starts, strict=True)])
    launch = device_launch(plan)
    slot_windows = torch.stack([torch.zeros(3, C).bfloat16()] + [p.gdn[GDN_LAYER][0] for p in plan.parents])
    windows = conv_windows(rows["x"], slot_windows, launch.win_src)
    slot_states = [torch.zeros(DK, DV, dtype=torch.float64)] + [p.gdn[GDN_LAYER][1] for p in plan.parents]
    final: list = [None] * len(plan.runs)
    levels, chunked_levels = plan.recurrent_levels, plan.chunked_levels
    off = plan.level_off(levels + 1, chunked_levels + 1)
    assert off[levels] == off[levels + 1] == r and off[-1] == off[-2] == len(plan.runs)
    # the recurrence's levels, then the chunked kernel's: one launch a level here
    ranges = [(off[d], off[d + 1], d) for d in range(levels)]
    ranges += [(off[levels + 1 + d], off[levels + 2 + d], d) for d in range(chunked_levels)]
    for a, b, level in ranges:
        for i in range(a, b):
            assert plan.level[i] == level
            src = plan.gdn_init[i]
            init = slot_states[src] if src >= 0 else final[-2 - src] if src < -1 else torch.zeros(DK, DV).double()
            own = {k: v[plan.cu[i] : plan.cu[i + 1]] for k, v in rows.items()}
            final[i] = recurrence(own, init)
    kv_rows, cu_k = plan.kv_rows(len(plan.ids))
    assert plan.num_kv_rows == len(kv_rows)  # what a graph key counts without building them
    pool = torch.cat([rows["marker"]] + [nd.kv[ATTN_LAYER][0] for nd in plan.nodes])
    # each kept state's tail rows (its positions from its last 64-multiple), slot-major, 64 a slot
    ext_tails = torch.full(((1 + len(plan.parents)) * 64,), -1, dtype=torch.long)
    for slot, p in enumerate(plan.parents, start=1):
        prefix = next(s.prefix for s in segs if s.ext is p)["marker"]
        first = p.num_tokens - p.num_tokens % 64
        ext_tails[slot * 64 : slot * 64 + p.num_tokens - first] = prefix[first:]
    for i, whole in enumerate(prompts):
        before = whole["x"][: starts[i]]
        assert torch.equal(windows[i], window_of(before)), (seed, i, "conv window")
        assert torch.equal(final[i], recurrence(whole, torch.zeros(DK, DV, dtype=torch.float64))), (seed, i)
        keys = pool[torch.as_tensor(kv_rows[cu_k[i] : cu_k[i + 1]], dtype=torch.long)]
        assert torch.equal(keys, whole["marker"]), (seed, i, "attention keys")
        # the chunked kernel's tail rows: positions from the 64-multiple below the start
        start = starts[i]
        for t in range(start % 64 if i >= r else 0):
            src = plan.tail_src[64 * i + t]
            got = rows["marker"][src] if src >= 0 else ext_tails[-1 - src]
            assert got == whole["marker"][start - start % 64 + t], (seed, i, t, "tail row")


@pytest.mark.parametrize("seed", range(6))
def test_results_in_callers_order_and_kept_chains(seed):
    from openjev.worker.cuda.runner import CudaRunner

    runs, segs = random_forest(100 + seed, requests=3, depth=4)
    plan = plan_launch(runs, vocab_size=2)
    # heads: the caller's reading runs in order, each its own last row
    internal = {o: i for i, o in enumerate(plan.order)}
    order = plan.head_order or list(range(len(plan.heads)))
    readers = [o for o in range(len(runs)) if runs[o].read_head]
    for r, o in zip(order, readers, strict=True):
        assert plan.heads[r] == plan.cu[internal[o] + 1] - 1
    # kept states: per internal run fake tensors; chains through unkept in-pass ancestors
    gdn = [{GDN_LAYER: (i,)} if run.keep_state else None for i, run in enumerate(plan.runs)]
    rows = torch.cat([segs[o].feats["marker"] for o in plan.order])  # pool rows hold their positions
    kv = [None] * len(plan.runs)
    for i in plan.materialise:
        kv[i] = {ATTN_LAYER: (rows[plan.cu[i] : plan.cu[i + 1]],) * 2}
    states = CudaRunner.states_of(None, plan, gdn, kv)
    nodes = {}
    for o, (run, state) in enumerate(zip(runs, states, strict=True)):
        assert (state is None) == (not run.keep_state)
        if state is None:
            continue
        seg = segs[o]
        assert state.num_tokens == run.start_position + len(run.token_ids)
        assert state.gdn[GDN_LAYER] == (internal[o],)
        # the chain's rows are the prompt's positions; in-pass nodes are shared between runs
        whole = cat(prompt_of(seg))["marker"]
        chain = state.kv.lineage()
        assert torch.equal(torch.cat([nd.kv[ATTN_LAYER][0] for nd in chain]), whole)
        assert sum(nd.num_rows for nd in chain) == state.num_tokens
        for nd in chain:
            assert nodes.setdefault(id(nd), nd) is nd
    # a run's in-pass ancestors are materialised once, whatever number of kept descendants
    assert len(set(plan.materialise)) == len(plan.materialise)


def test_plan_rejects_malformed_passes():
    state, _ = kept_state(torch.Generator().manual_seed(0), 0, 5)
    with pytest.raises(ValueError):  # a child before its parent
        plan_launch(
            [SegmentRun([1], 2, None, False, True, parent_in_pass=1), SegmentRun([1, 1], 0, None, False, True)], 2
        )
    with pytest.raises(ValueError):  # wrong start position under an in-pass parent
        plan_launch([SegmentRun([1, 1], 0, None, False, True), SegmentRun([1], 3, None, False, True, 0)], 2)
    with pytest.raises(ValueError):  # wrong start position under a kept state
        plan_launch([SegmentRun([1], 4, state, False, True)], 2)
    plan = plan_launch([SegmentRun([1], 5, state, True, True), SegmentRun([1], 6, None, True, True, 0)], 2)
    assert plan.num_levels == 2 and plan.gdn_init == [1, -2] and plan.materialise == [0, 1]


def test_a_run_crossing_the_split_is_two_runs():
    """A prompt crossing chunked_from: a first part ending there (the recurrence's, keeping and
    reading nothing) and the caller's run from there (the chunked kernel's), which keeps, reads
    and parents the caller's children; a run from a kept state past it is the chunked kernel's."""
    from openjev.worker.cuda.runner import CudaRunner

    state, _ = kept_state(torch.Generator().manual_seed(0), 0, 70)
    runs = [
        SegmentRun([1] * 100, 0, None, True, True),
        SegmentRun([1] * 5, 100, None, False, True, parent_in_pass=0),
        SegmentRun([1] * 3, 70, state, False, True),
        SegmentRun([1] * 30, 0, None, False, True),
    ]
    plan = plan_launch(runs, vocab_size=2, chunked_from=64)
    assert plan.num_recurrent == 2 and plan.order == [-1, 3, 0, 2, 1] and plan.callers == 4
    assert [(r.start_position, len(r.token_ids)) for r in plan.runs] == [(0, 64), (0, 30), (64, 36), (70, 3), (100, 5)]
    assert plan.in_parent == [-1, -1, 0, -1, 2] and plan.gdn_init == [-1, -1, -2, 1, -4]
    assert plan.level == [0, 0, 0, 0, 1] and (plan.recurrent_levels, plan.chunked_levels) == (1, 2)
    assert plan.level_off(1, 2) == [0, 2, 4, 5] and plan.materialise == [0, 2]
    assert not plan.runs[0].keep_state and not plan.runs[0].read_head and plan.runs[2].keep_state
    assert plan.heads == [93, 129, 132, 137] and plan.head_order == [1, 3, 2, 0]
    assert [plan.keeps_tail(i) for i in range(5)] == [False, False, True, True, True]
    assert plan.tail_src[: 3 * 64] == [0] * (3 * 64)  # the recurrence's runs, and one from position 64
    assert plan.tail_src[3 * 64 : 3 * 64 + 6] == [-1 - (64 + r) for r in range(6)]  # the kept state's tail
    assert plan.tail_src[4 * 64 : 4 * 64 + 36] == list(range(94, 130))  # its in-pass parent's rows 64..99
    gdn = [None, None, {GDN_LAYER: ()}, None, None]
    states = CudaRunner.states_of(None, plan, gdn, [{ATTN_LAYER: ()}, None, {ATTN_LAYER: ()}, None, None])
    assert len(states) == 4 and states[0] is not None and states[0].num_tokens == 100
    assert [nd.num_rows for nd in states[0].kv.lineage()] == [64, 36]  # through the first part
    assert -1 not in plan_launch(runs, vocab_size=2).order  # no split position: no split
    for bad in (32, -64):  # off the chunk grid, a chunked run would start from a state with no tail
        with pytest.raises(ValueError, match="multiple of 64"):
            plan_launch(runs, vocab_size=2, chunked_from=bad)
