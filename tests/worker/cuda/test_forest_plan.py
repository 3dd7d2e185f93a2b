"""The host side of a forest pass, on the CPU (no CUDA needed): for random forests of random
trees (segments of 1-6 tokens, so conv windows reach past short parents; some roots continue
kept states of earlier passes), the plan's indices, applied the way the kernels apply them, give
each run exactly what running its whole prompt alone gives:
- conv windows read through win_src (reference.conv_windows, as the conv kernel reads them) =
  the 3 inputs before the run in its prompt;
- the recurrence run level by level from plan.gdn_init (kernels.gdn_recurrent's semantics) =
  the token recurrence over the whole prompt, bit for bit;
- the keys kv_rows lists = the prompt's positions 0..end-1 in order;
and results come back in the caller's order, kept chains pass through in-pass ancestors."""

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


def random_forest(seed: int, requests: int, depth: int):
    """Runs of one pass (parents before children, requests interleaved) and their segments."""
    rnd, rng = random.Random(seed), torch.Generator().manual_seed(seed)
    segs: list[Seg] = []
    for prompt in range(requests):
        ext, prefix = (None, None)
        if rnd.random() < 0.4:
            ext, prefix = kept_state(rng, prompt, rnd.randint(1, 9))
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


@pytest.mark.parametrize("seed", range(12))
def test_forest_indices_give_each_run_its_whole_prompt(seed):
    runs, segs = random_forest(seed, requests=1 + seed % 4, depth=1 + seed % 5)
    plan = plan_launch(runs, vocab_size=2, tail_sources=True)
    inner = [segs[o] for o in plan.order]
    # levels: sorted, each run one below its in-pass parent
    assert plan.level == sorted(plan.level)
    for i, p in enumerate(plan.in_parent):
        assert plan.level[i] == (0 if p < 0 else plan.level[p] + 1)
        assert (p < 0) == (inner[i].parent is None) and (p < 0 or inner[p] is inner[i].parent)
    rows = cat([s.feats for s in inner])
    launch = device_launch(plan)
    slot_windows = torch.stack([torch.zeros(3, C).bfloat16()] + [p.gdn[GDN_LAYER][0] for p in plan.parents])
    windows = conv_windows(rows["x"], slot_windows, launch.win_src)
    slot_states = [torch.zeros(DK, DV, dtype=torch.float64)] + [p.gdn[GDN_LAYER][1] for p in plan.parents]
    final: list = [None] * len(inner)
    off = plan.level_off(plan.num_levels + 1)
    assert off[-1] == off[-2] == len(inner)
    for level in range(plan.num_levels):  # kernels.gdn_recurrent, one launch per level
        for i in range(off[level], off[level + 1]):
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
        prefix = next(s.prefix for s in inner if s.ext is p)["marker"]
        first = p.num_tokens - p.num_tokens % 64
        ext_tails[slot * 64 : slot * 64 + p.num_tokens - first] = prefix[first:]
    for i, seg in enumerate(inner):
        whole = cat(prompt_of(seg))
        before = whole["x"][: whole["x"].shape[0] - seg.feats["x"].shape[0]]
        assert torch.equal(windows[i], window_of(before)), (seed, i, "conv window")
        assert torch.equal(final[i], recurrence(whole, torch.zeros(DK, DV, dtype=torch.float64))), (seed, i)
        keys = pool[torch.as_tensor(kv_rows[cu_k[i] : cu_k[i + 1]], dtype=torch.long)]
        assert torch.equal(keys, whole["marker"]), (seed, i, "attention keys")
        # the chunked kernel's tail rows: positions from the 64-multiple below the start
        start = runs[plan.order[i]].start_position
        for r in range(start % 64):
            src = plan.tail_src[64 * i + r]
            got = rows["marker"][src] if src >= 0 else ext_tails[-1 - src]
            assert got == whole["marker"][start - start % 64 + r], (seed, i, r, "tail row")


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
