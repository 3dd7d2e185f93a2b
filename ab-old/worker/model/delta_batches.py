"""The gated delta rule of every segment of a pass, chunks of different segments batched.

A chunk's ops are tiny (a few [H, C, C] products, one triangular solve, a few exponentials), so on
CPU their number, not their arithmetic, is most of the cost: one call per op for a batch of
chunks instead of one per segment's chunk. The pass advances in steps: at each step every
segment whose parent has finished runs its next chunk (chunks count from the segment's start, as
ops.gated_delta_rule's do), and the ready chunks of the same padded length and kind (with or
without a state to start from) run as one batch. The schedule depends only on the pass's
segments, so it is planned once for all GDN layers (delta_plan).

Batch invariance: a chunk's bits must not depend on its company. The batched products and the
triangular solve work member by member; the elementwise ops are exact, except the exponentials,
whose vectorised body and scalar tail may round differently. So each chunk is padded with zero
rows to a multiple of `chunk_rows_quantum(H)`, which makes every member's [H, C] and [H, C, C]
blocks whole multiples of 32 floats: each member then starts on the same vector boundary and no
member's exponentials fall in a tail, alone or in a batch. Zero rows change nothing for the real
rows: a pad row has k = v = beta = 0 and g = 0, so it writes u = 0 into the state, and the causal
structure keeps it out of every real row's output; the chunk's end decay G_C is unchanged.
Every member is also laid out the same in memory whatever the batch's size (the contiguous copy in delta_rule_segments).
Padding to a small multiple, not to the full 64-row chunk, is what makes batching pay: padded to
64, a child's few-token chunk costs what a full one does (tried 2026-11-30: no gain).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.model import ops
from openjev.worker.model.state import GdnState

# floats in two AVX-512 vectors: the step of ATen's unrolled vectorised elementwise loops
_ALIGN_FLOATS = 32


def chunk_rows_quantum(num_heads: int) -> int:
    """The row multiple a chunk is padded to: H * quantum is a multiple of _ALIGN_FLOATS (and so
    is H * C * C for any padded C), and at least 8."""
    return max(8, _ALIGN_FLOATS // math.gcd(num_heads, _ALIGN_FLOATS))


@dataclass(frozen=True)
class ChunkBatch:
    """Chunks run as one batch: gather: [B * padded] int64, the rows each member's padded chunk
    reads (its pad rows read the zero row after the pass's rows); members: the segments, one
    chunk each; with_state: the chunks continue from a state (else they start a prompt)."""

    gather: Tensor
    members: tuple[int, ...]
    padded: int
    with_state: bool


def delta_plan(
    spans: Sequence[tuple[int, int]], sources: Sequence[object], num_heads: int, num_rows: int
) -> tuple[ChunkBatch, ...]:
    """The batches of a pass, in an order that runs every parent's chunks before its children's.
    sources: per segment None (start of prompt), the index of an in-pass parent, or a state from
    an earlier pass (anything else); num_rows: the pass's rows (row num_rows is the zero row)."""
    quantum = chunk_rows_quantum(num_heads)
    position = [start for start, _ in spans]  # each segment's next chunk starts here
    done = [False] * len(spans)
    planned: list[tuple[list[int], tuple[int, ...], int, bool]] = []
    while not all(done):
        step: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}
        for index, ((start, end), source) in enumerate(zip(spans, sources, strict=True)):
            if done[index] or (isinstance(source, int) and not done[source]):
                continue  # finished, or the parent's chunks are still running
            first, last = position[index], min(position[index] + GDN_CHUNK_TOKENS, end)
            padded = -(-(last - first) // quantum) * quantum
            with_state = first > start or source is not None
            step.setdefault((padded, with_state), []).append((index, first, last))
        for (padded, with_state), chunks in step.items():
            rows: list[int] = []
            for _, first, last in chunks:
                rows += [*range(first, last), *[num_rows] * (padded - (last - first))]
            planned.append((rows, tuple(index for index, _, _ in chunks), padded, with_state))
            for index, _, last in chunks:
                position[index], done[index] = last, last == spans[index][1]
    return tuple(
        ChunkBatch(torch.tensor(rows, dtype=torch.int64), members, padded, with_state)
        for rows, members, padded, with_state in planned
    )


def delta_rule_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: Sequence[ChunkBatch],
    sources: Sequence[GdnState | int | None],
) -> tuple[Tensor, list[Tensor]]:
    """q, k: [T, H, Dk] fp32 (L2-normalized, q scaled, key heads repeated); v: [T, H, Dv] fp32;
    g, beta: [T, H] fp32; all rows of a pass, token-major. plan: delta_plan of the pass's
    segments; sources: each segment's parent (None: start of prompt; an int: an earlier segment
    of this pass; else a GdnState from an earlier pass).
    Returns (o [T, H, Dv] fp32, zero on rows in no segment; each segment's final state
    [H, Dk, Dv] fp32)."""
    num_rows, num_heads = g.shape
    # One [T + 1, H, 2 Dk + Dv + 2] table, so that a batch gathers its rows in one copy; its last
    # row is zero: the pad rows of every chunk read it.
    table = torch.cat([q, k, v, g[..., None], beta[..., None]], dim=-1)
    table = torch.cat([table, table.new_zeros(1, *table.shape[1:])])
    widths = [q.shape[-1], k.shape[-1], v.shape[-1], 1, 1]
    out = v.new_zeros(num_rows + 1, *v.shape[1:])  # its last row takes the pad rows' outputs, then is dropped
    state: list[Tensor | None] = [None] * len(sources)  # each segment's state after its chunks so far
    for batch in plan:
        starts = []
        for index in batch.members:
            source = sources[index]
            if state[index] is None and source is not None:  # the segment's first chunk
                state[index] = state[source] if isinstance(source, int) else source.recurrent.float()
            starts.append(state[index])
        gather = batch.gather
        size, padded = len(batch.members), batch.padded
        # [B * C, H, W] rows -> [B * H, C, W] laid out the same whatever B (contiguous: for one
        # member reshape alone would return a strided view, and products of another layout may
        # round differently); then q, k, v, g, beta as views of it
        picked = table.index_select(0, gather).view(size, padded, num_heads, -1).transpose(1, 2)
        qb, kb, vb, gb, bb = picked.reshape(size * num_heads, padded, -1).contiguous().split(widths, dim=-1)
        s = torch.cat(starts) if batch.with_state else None  # type: ignore[arg-type]
        o, s_end = ops.delta_rule_chunk(qb, kb, vb, gb.squeeze(-1), bb.squeeze(-1), s)
        # back to token-major rows; the pad rows all land on the zero row (dropped below)
        out.index_copy_(
            0, gather, o.view(size, num_heads, padded, -1).transpose(1, 2).reshape(size * padded, num_heads, -1)
        )
        for member, index in enumerate(batch.members):
            state[index] = s_end[member * num_heads : (member + 1) * num_heads]
    finals = [s for s in state if s is not None]
    assert len(finals) == len(state), "a segment ran no chunk"
    return out[:num_rows], finals
