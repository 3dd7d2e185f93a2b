"""A pass's layout: validated on the host (`plan_launch` -> LaunchPlan), then as device
indices (`Launch`), and the per-segment state a kept segment leaves (CudaSegmentState).

A forest pass holds runs whose parents may be earlier runs of the same pass. The plan orders
runs by level (stable), so each level is a contiguous range; the GDN recurrence then runs the
whole forest in one launch (a child's work waits for its parent's). Where the chunked GDN kernel
takes positions from `chunked_from` on (`--gdn-kernel split`), a run crossing that position is
split there into an in-pass parent and child, and the runs from it on (the chunked kernel's)
follow the others, ordered by their own levels; the conv kernel reads each
run's window where it lies (an in-pass ancestor's rows or an external parent's window,
win_src), and attention reads in-pass ancestors' keys from the pass's own pool rows (kv_rows
just lists them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.runner_api import SegmentRun, pass_depths

# A segment's GDN state per GDN layer index: (conv window, recurrent state, tail or None); and its
# attention keys/values per attention layer index (see CudaSegmentState and KvNode).
GdnLayers = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
KvLayers = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KvNode:
    """One segment's own attention keys/values, linked to its parent's: the chain root-to-self
    is every position the segment's children attend to. kv: per attention layer index,
    (keys, values) [t, Hkv, 256] bf16; block: where a captured pass made them, the one tensor
    [La, 2, t, Hkv, 256] they are views of (attention layers in order), copied in one piece."""

    parent: KvNode | None
    num_rows: int
    kv: KvLayers
    block: torch.Tensor | None = None

    def lineage(self) -> list[KvNode]:
        """Root first, self last."""
        chain: list[KvNode] = []
        node: KvNode | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain[::-1]


@dataclass(frozen=True)
class CudaSegmentState:
    """num_tokens: the segment's end position; gdn: per GDN layer index, (conv_window [3, C] bf16,
    recurrent [Hv, 128, 128] fp32, tail): where the token recurrence made the state (the serial
    GDN kernel; the split one up to its first chunked position) the state at the end and tail
    None; where the chunked kernel did, the state at the last multiple of 64 positions and tail
    [64, width] fp32, the k, v, g, beta rows after it (chunked_gdn.gdn_chunked); kv: the attention chain
    (ancestors' GDN states are not kept alive by it); gdn_block: where a captured pass made the
    GDN tensors, the stacked (windows [L, 3, C], states [L, Hv, 128, 128], tails [L, 64, width] or
    None) they are views of (GDN layers in order), copied in one piece each."""

    num_tokens: int
    gdn: GdnLayers
    kv: KvNode
    gdn_block: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def gdn_tail(self, layer: int) -> torch.Tensor | None:
        """The GDN layer's tail: a state the chunked kernel left has one, the recurrence's none
        (a runner uses one kernel, or one split position, for all its passes)."""
        return self.gdn[layer][2]


@dataclass
class LaunchPlan:
    """A validated forest pass on the host, its runs ordered by level (stable), so each level is a
    contiguous range of rows and segments. All lists are in that internal order. With
    chunked_from (the chunked GDN kernel's first position; None: the recurrence everywhere, 0:
    the chunked kernel everywhere) a caller's run crossing it is two runs, the first a parent in
    the pass ending there; runs from it on (the chunked kernel's: runs [num_recurrent, N)) follow
    the recurrence's, and `level` counts levels within each kernel's runs.

    runs: internal order; order[i]: index in the caller's runs of internal run i (-1: the part
    before chunked_from of a split run; its other part has the caller's index).
    ids, positions: [T] ints; cu: [N+1] segment bounds; heads: rows the head reads (internal
    order); head_order: for the caller's reading runs in order, the index into heads (None: same).
    level: per run its level among its kernel's runs; num_levels: 1 + the deepest;
    num_recurrent: the recurrence's runs, internal 0 .. num_recurrent - 1.
    in_parent: per run the internal index of its in-pass parent, -1 none.
    parents: distinct external parent states, state slot s + 1 (slot 0: none); slot: per run the
    slot of its own external parent (0 none).
    gdn_init: per run where its recurrence starts (kernels.gdn_recurrent's init_idx: its slot, -1
    zeros, -2 - p the final state of in-pass parent p).
    win_src: [3N] per run and conv window row m (positions start-3+m): >= 0 the packed row of
    x, < 0 row -1 - v of the slots' windows flattened [(1 + P) * 3, C] (slot 0: zeros).
    tail_src: [64N] for the chunked GDN kernel (else empty), per run and tail row r (position
    start - start % 64 + r, r < start % 64): >= 0 the packed row of an in-pass ancestor, < 0 row
    -1 - v of the slots' tails flattened [(1 + P) * 64, width] (chunked_gdn.ChunkSources); 0 for
    the recurrence's runs.
    nodes: distinct ancestor KvNodes of kept states, `base` rows in all; ancestors[n]: (row
    among them, rows) of run n's ancestor nodes, root first; in_chain[n]: run n's in-pass
    ancestors (internal indices), root first.
    materialise: runs whose K/V rows become KvNodes (the kept ones and their in-pass ancestors).
    max_q: longest segment."""

    runs: list[SegmentRun]
    order: list[int]
    chunked_from: int | None
    ids: list[int]
    positions: list[int]
    cu: list[int]
    heads: list[int]
    head_order: list[int] | None
    level: list[int]
    num_levels: int
    num_recurrent: int
    in_parent: list[int]
    parents: list[CudaSegmentState]
    slot: list[int]
    gdn_init: list[int]
    win_src: list[int]
    tail_src: list[int]
    nodes: list[KvNode]
    base: int
    ancestors: list[list[tuple[int, int]]]
    in_chain: list[list[int]]
    materialise: list[int]
    max_q: int

    @property
    def num_kept(self) -> int:
        return sum(run.keep_state for run in self.runs)

    @property
    def callers(self) -> int:
        """The caller's runs (a split run's first part is not one)."""
        return sum(o >= 0 for o in self.order)

    @property
    def recurrent_levels(self) -> int:
        """Levels of the recurrence's runs (0: none)."""
        return 1 + max(self.level[: self.num_recurrent], default=-1)

    @property
    def chunked_levels(self) -> int:
        """Levels of the chunked kernel's runs (0: none)."""
        return 1 + max(self.level[self.num_recurrent :], default=-1)

    def level_off(self, levels: int, chunked_levels: int = 0) -> list[int]:
        """[levels + chunked_levels + 1]: the recurrence's runs of level d are off[d] .. off[d + 1]
        - 1, then the chunked kernel's of its level d off[levels + d] .. off[levels + d + 1] - 1
        (either count may exceed the pass's: the extra ranges are empty; off[levels] is
        num_recurrent when levels covers the recurrence's)."""
        r = self.num_recurrent
        rec = [sum(d < k for d in self.level[:r]) for k in range(levels + 1)]
        return rec + [r + sum(d < k for d in self.level[r:]) for k in range(1, chunked_levels + 1)]

    def keeps_tail(self, i: int) -> bool:
        """Whether internal run i's kept GDN state has a tail: the chunked kernel made it."""
        run = self.runs[i]
        return self.chunked_from is not None and run.start_position + len(run.token_ids) > self.chunked_from

    @property
    def num_kv_rows(self) -> int:
        """len(kv_rows(...)[0]) without building it (a graph key needs only the count)."""
        own = [self.cu[i + 1] - self.cu[i] for i in range(len(self.runs))]
        return sum(
            sum(n for _, n in anc) + sum(own[p] for p in chain) + own[i]
            for i, (anc, chain) in enumerate(zip(self.ancestors, self.in_chain, strict=True))
        )

    def kv_rows(self, anc_base: int):
        """(rows [sum S_n] int32: pool row of each segment's logical keys, cu_k [N+1]) for a pool
        holding this pass's own rows from row 0 and the ancestor nodes' rows from anc_base."""
        ranges = [
            [(anc_base + a, n) for a, n in anc]
            + [(self.cu[p], self.cu[p + 1] - self.cu[p]) for p in chain]
            + [(self.cu[i], self.cu[i + 1] - self.cu[i])]
            for i, (anc, chain) in enumerate(zip(self.ancestors, self.in_chain, strict=True))
        ]
        rows = np.concatenate([np.arange(a, a + n, dtype=np.int32) for r in ranges for a, n in r])
        return rows, np.cumsum([0] + [sum(n for _, n in r) for r in ranges])


@dataclass
class Launch:
    """A pass's device-side indices. ids: [T] int32; cu: [N+1] int32; pos: [T] int32 positions;
    head_idx: [R] int32 rows the head reads (None: no head rows); rope: (cos, sin) [T,
    rotary_dim/2] fp32; kv_rows: [sum S_n] int32 pool row of each segment's logical keys; cu_k:
    [N+1] int32; max_q: the longest segment (picks tree attention's form); gdn_init: [N] int32
    (LaunchPlan); level_off: [num_levels + chunked_levels + 1] int32 (LaunchPlan.level_off);
    num_levels: the recurrence's levels (0: no recurrence launch); chunked_levels: the chunked
    kernel's (0: no chunked launches); win_src: [3N] int32 (LaunchPlan.win_src, read by
    kernels.causal_conv1d against each GDN layer's x and parent-slot windows); tail_src: [64N]
    int32 (LaunchPlan.tail_src), None with the serial GDN kernel."""

    ids: torch.Tensor
    cu: torch.Tensor
    pos: torch.Tensor
    head_idx: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    kv_rows: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    gdn_init: torch.Tensor
    level_off: torch.Tensor
    num_levels: int
    win_src: torch.Tensor
    tail_src: torch.Tensor | None = None
    chunked_levels: int = 0


def split_at(runs: Sequence[SegmentRun], position: int) -> tuple[list[SegmentRun], list[int]]:
    """(runs, caller): each run crossing `position` as two, the first ending there, keeping and
    reading nothing, the in-pass parent of the second; caller[i]: the caller's index of run i, -1
    for such a first part. Children follow their parent's second part."""
    out: list[SegmentRun] = []
    caller: list[int] = []
    last: list[int] = []  # per caller's run, its last part's index
    for i, run in enumerate(runs):
        parent = None if run.parent_in_pass is None else last[run.parent_in_pass]
        cut = position - run.start_position
        if 0 < cut < len(run.token_ids):
            first = replace(run, token_ids=run.token_ids[:cut], keep_state=False, read_head=False)
            out.append(replace(first, parent_in_pass=parent))
            caller.append(-1)
            run = replace(run, token_ids=run.token_ids[cut:], start_position=position, parent_state=None)
            parent = len(out) - 1
        last.append(len(out))
        out.append(replace(run, parent_in_pass=parent))
        caller.append(i)
    return out, caller


def kernel_levels(runs: Sequence[SegmentRun], chunked: Sequence[bool]) -> list[int]:
    """Each run's level among its GDN kernel's runs (an in-pass parent of the other kernel: 0)."""
    levels: list[int] = []
    for run, ch in zip(runs, chunked, strict=True):
        p = run.parent_in_pass
        levels.append(0 if p is None or chunked[p] != ch else levels[p] + 1)
    return levels


def plan_launch(runs: Sequence[SegmentRun], vocab_size: int, chunked_from: int | None = None) -> LaunchPlan:
    """Validate a forest pass and lay it out on the host: runs split at chunked_from and ordered
    by kernel and level, token rows, segment bounds, head rows, state sources, conv window
    sources, the chunked GDN kernel's tail row sources (where chunked_from is not None) and the
    attention pool (each distinct ancestor node's rows once)."""
    if chunked_from is not None and (chunked_from < 0 or chunked_from % GDN_CHUNK_TOKENS):
        # a chunked run from a recurrence's state would read tail rows nobody wrote
        raise ValueError(f"chunked_from must be a multiple of {GDN_CHUNK_TOKENS}, not {chunked_from}")
    depths = pass_depths(runs)  # each run's level among its kernel's: one kernel, or no run split yet
    caller = list(range(len(runs)))
    chunked = [chunked_from is not None] * len(runs)
    if chunked_from:  # the kernels split at a position
        runs, caller = split_at(runs, chunked_from)
        chunked = [run.start_position >= chunked_from for run in runs]
        depths = kernel_levels(runs, chunked)
    for run in runs:
        parent = run.parent_state
        if len(run.token_ids) == 0:
            raise ValueError("SegmentRun.token_ids must not be empty")
        if parent is not None and not isinstance(parent, CudaSegmentState):
            raise TypeError(f"parent_state is a {type(parent).__name__}, not a CudaRunner state")
        if run.parent_in_pass is None and run.start_position != (0 if parent is None else parent.num_tokens):
            raise ValueError("start_position must equal the parent's end position")
    # stable: parents keep preceding children, the recurrence's runs the chunked kernel's
    order = sorted(range(len(runs)), key=lambda i: (chunked[i], depths[i]))
    internal = {orig: i for i, orig in enumerate(order)}
    plan_runs = [runs[o] for o in order]
    level = [depths[o] for o in order]
    in_parent = [-1 if r.parent_in_pass is None else internal[r.parent_in_pass] for r in plan_runs]
    ids: list[int] = []
    positions: list[int] = []
    cu: list[int] = [0]
    heads: list[int] = []
    for run in plan_runs:
        ids.extend(run.token_ids)
        positions.extend(range(run.start_position, run.start_position + len(run.token_ids)))
        cu.append(len(ids))
        if run.read_head:
            heads.append(len(ids) - 1)
    if max(ids) >= vocab_size or min(ids) < 0:
        raise ValueError("token id outside the vocabulary")
    head_pos: dict[int, int] = {}  # caller's index of a reading run -> its row among heads
    for i, run in enumerate(plan_runs):
        if run.read_head:
            head_pos[order[i]] = len(head_pos)
    head_order = [head_pos[o] for o in range(len(runs)) if runs[o].read_head]
    parents: list[CudaSegmentState] = []
    slots_of: dict[int, int] = {}  # id(state) -> its slot
    slot: list[int] = []
    for run in plan_runs:
        p = run.parent_state
        if p is not None and id(p) not in slots_of:
            parents.append(p)
            slots_of[id(p)] = len(parents)
        slot.append(0 if p is None else slots_of[id(p)])
    gdn_init = [(-2 - in_parent[i]) if in_parent[i] >= 0 else (slot[i] or -1) for i in range(len(plan_runs))]
    starts = [run.start_position for run in plan_runs]
    win_src = [_window_source(i, m - 3, in_parent, cu, slot, starts) for i in range(len(plan_runs)) for m in range(3)]
    num_recurrent = len(runs) - sum(chunked)
    tail_src: list[int] = []
    if chunked_from is not None:
        tail_src = [0] * (GDN_CHUNK_TOKENS * num_recurrent)
        for i in range(num_recurrent, len(runs)):
            tail_src += _tail_sources(i, in_parent, cu, slot, starts)
    nodes: list[KvNode] = []
    offsets: dict[int, int] = {}  # id(node) -> its first row in the pool
    base = 0
    ancestors: list[list[tuple[int, int]]] = []
    in_chain: list[list[int]] = []
    for i, run in enumerate(plan_runs):
        if in_parent[i] >= 0:  # parents precede children in internal order
            ancestors.append(ancestors[in_parent[i]])
            in_chain.append(in_chain[in_parent[i]] + [in_parent[i]])
            continue
        lineage: list[KvNode] = [] if run.parent_state is None else run.parent_state.kv.lineage()
        for node in lineage:
            if id(node) not in offsets:
                offsets[id(node)] = base
                nodes.append(node)
                base += node.num_rows
        ancestors.append([(offsets[id(nd)], nd.num_rows) for nd in lineage])
        in_chain.append([])
    materialise = sorted({a for i, run in enumerate(plan_runs) if run.keep_state for a in in_chain[i] + [i]})
    return LaunchPlan(
        runs=plan_runs,
        order=[caller[o] for o in order],
        chunked_from=chunked_from,
        ids=ids,
        positions=positions,
        cu=cu,
        heads=heads,
        head_order=None if head_order == list(range(len(heads))) else head_order,
        level=level,
        num_levels=1 + max(level),
        num_recurrent=num_recurrent,
        in_parent=in_parent,
        parents=parents,
        slot=slot,
        gdn_init=gdn_init,
        win_src=win_src,
        tail_src=tail_src,
        nodes=nodes,
        base=base,
        ancestors=ancestors,
        in_chain=in_chain,
        materialise=materialise,
        max_q=max(b - a for a, b in zip(cu[:-1], cu[1:], strict=False)),
    )


def _holder(n: int, position: int, in_parent: list[int], cu: list[int], starts: list[int]) -> tuple[int, int]:
    """Where `position` (before run n's start) lies: (the packed row of the in-pass ancestor
    holding it, -1), walking up the in-pass parents; else (-1, m), m the first run of n's chain in
    this pass (the position is its external parent's, or before the prompt)."""
    m = n
    while (q := in_parent[m]) >= 0:
        if position >= starts[q]:
            return cu[q] + position - starts[q], -1
        m = q
    return -1, m


def _window_source(n: int, rel: int, in_parent: list[int], cu: list[int], slot: list[int], starts: list[int]) -> int:
    """Where conv input `rel` (< 0, relative to run n's start) comes from (LaunchPlan.win_src): an
    in-pass ancestor's row, else the external parent's window (or slot 0's zeros: before the
    prompt)."""
    position = starts[n] + rel
    row, m = _holder(n, position, in_parent, cu, starts)
    return row if row >= 0 else -1 - (slot[m] * 3 + 3 + position - starts[m])


def _tail_sources(n: int, in_parent: list[int], cu: list[int], slot: list[int], starts: list[int]) -> list[int]:
    """LaunchPlan.tail_src of run n: its tail rows are positions from the 64-multiple at or
    below its start; each comes from the in-pass ancestor holding it, else from the external
    parent's tail (row position % 64: that tail starts at the same multiple of 64)."""
    chunk, start = GDN_CHUNK_TOKENS, starts[n]
    out = [0] * chunk
    for r in range(start % chunk):
        position = start - start % chunk + r
        row, m = _holder(n, position, in_parent, cu, starts)
        assert row >= 0 or slot[m] > 0, "a run from position 0 has no tail"
        out[r] = row if row >= 0 else -1 - (slot[m] * chunk + position % chunk)
    return out
