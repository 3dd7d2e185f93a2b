"""A launch's layout: validated on the host (`plan_launch` -> LaunchPlan), then as device
indices (`Launch`), and the per-segment state a kept segment leaves (CudaSegmentState)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from openjev.worker.runner_api import SegmentRun


@dataclass(frozen=True)
class KvNode:
    """One segment's own attention keys/values, linked to its parent's: the chain root-to-self
    is every position the segment's children attend to. kv: per attention layer index,
    (keys, values) [t, Hkv, 256] bf16."""

    parent: KvNode | None
    num_rows: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]

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
    recurrent [Hv, 128, 128] fp32, tail): with the serial GDN kernel the state at the end and tail
    None; with the chunked one the state at the last multiple of 64 positions and tail [64, width]
    fp32, the k, v, g, beta rows after it (kernels.gdn_chunked); kv: the attention chain
    (ancestors' GDN states are not kept alive by it)."""

    num_tokens: int
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    kv: KvNode


@dataclass
class LaunchPlan:
    """A validated launch on the host. ids, positions: [T] ints; cu: [N+1] segment bounds; heads:
    rows the head reads; nodes: distinct ancestor KvNodes in pool order, `base` rows in all;
    ancestors[n]: (pool row, rows) of segment n's ancestor nodes, root first; max_q: longest
    segment."""

    runs: list[SegmentRun]
    ids: list[int]
    positions: list[int]
    cu: list[int]
    heads: list[int]
    nodes: list[KvNode]
    base: int
    ancestors: list[list[tuple[int, int]]]
    max_q: int

    def kv_rows(self, own_base: int):
        """(rows [sum S_n] int32: pool row of each segment's logical keys, cu_k [N+1]) with this
        launch's own rows placed from pool row own_base."""
        ranges = [anc + [(own_base + self.cu[i], self.cu[i + 1] - self.cu[i])] for i, anc in enumerate(self.ancestors)]
        rows = np.concatenate([np.arange(a, a + n, dtype=np.int32) for r in ranges for a, n in r])
        return rows, np.cumsum([0] + [sum(n for _, n in r) for r in ranges])


@dataclass
class Launch:
    """A launch's device-side indices. ids: [T] int32; cu: [N+1] int32; pos: [T] int32 positions;
    head_idx: [R] int32 rows the head reads (None: no head rows); rope: (cos, sin) [T,
    rotary_dim/2] fp32; kv_rows: [sum S_n] int32 pool row of each segment's logical keys; cu_k:
    [N+1] int32; max_q: the attention grid's longest segment."""

    ids: torch.Tensor
    cu: torch.Tensor
    pos: torch.Tensor
    head_idx: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    kv_rows: torch.Tensor
    cu_k: torch.Tensor
    max_q: int


def plan_launch(runs: Sequence[SegmentRun], vocab_size: int) -> LaunchPlan:
    """Validate a launch and lay it out on the host: token rows, segment bounds, head rows,
    and the attention pool (each distinct ancestor node's rows once, then the launch's own)."""
    ids: list[int] = []
    positions: list[int] = []
    cu, heads = [0], []
    for run in runs:
        parent = run.parent_state
        if len(run.token_ids) == 0:
            raise ValueError("SegmentRun.token_ids must not be empty")
        if parent is not None and not isinstance(parent, CudaSegmentState):
            raise TypeError(f"parent_state is a {type(parent).__name__}, not a CudaRunner state")
        if run.start_position != (0 if parent is None else parent.num_tokens):
            raise ValueError("start_position must equal the parent's end position")
        ids.extend(run.token_ids)
        positions.extend(range(run.start_position, run.start_position + len(run.token_ids)))
        cu.append(len(ids))
        if run.read_head:
            heads.append(len(ids) - 1)
    if max(ids) >= vocab_size or min(ids) < 0:
        raise ValueError("token id outside the vocabulary")
    nodes, offsets, base = [], {}, 0
    ancestors = []
    for run in runs:
        lineage = [] if run.parent_state is None else run.parent_state.kv.lineage()
        for node in lineage:
            if id(node) not in offsets:
                offsets[id(node)] = base
                nodes.append(node)
                base += node.num_rows
        ancestors.append([(offsets[id(nd)], nd.num_rows) for nd in lineage])
    return LaunchPlan(
        list(runs), ids, positions, cu, heads, nodes, base, ancestors, max(b - a for a, b in pairwise(cu))
    )
