"""The Gated DeltaNet conv and delta rule over many segments at once (the CPU pass's mixer).

Run one segment at a time, a pass of many short segments costs mostly Python and per-op
overhead. Here the segments of one tree level go through each op together, and the bits of a
segment do not depend on which others share the op (batch invariance):
- conv: each segment's window and rows are laid back to back and every tap is one elementwise
  product over the whole buffer, in a fixed order; rows never mix, and every op's size is a
  multiple of the conv width, so no segment's elements fall into a vectorised loop's scalar tail;
- delta rule: chunk r of every segment long enough is one batch entry [H, 64, D], short chunks
  padded with zero rows (k = v = q = 0, g = 0, beta = 0: their u is 0, they add nothing to the
  state and do not decay it), so every batch entry has the same shape and a contiguous block
  of its own. Chunks count from the segment start, as in ops.gated_delta_rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.model.ops import _delta_rule_chunk


def causal_conv1d_segments(
    x: Tensor, spans: Sequence[tuple[int, int]], weight: Tensor, windows: Sequence[Tensor | None]
) -> tuple[Tensor, list[Tensor]]:
    """Depthwise causal conv + SiLU of each segment, continuing from its window.
    x: [R, C] rows; spans: each segment's rows of x; weight: [C, K] (tap K-1 multiplies the current
    input); windows: each segment's K-1 previous inputs [K-1, C] (None: zeros).
    Returns (outputs [sum of span lengths, C] in span order, each segment's new window)."""
    taps = weight.shape[1]
    blocks = []
    for (start, end), window in zip(spans, windows, strict=True):
        blocks.append(x.new_zeros(taps - 1, x.shape[1]) if window is None else window.to(x.dtype))
        blocks.append(x[start:end])
    padded = torch.cat(blocks)  # per segment: K-1 window rows, then its own rows
    rows = padded.shape[0] - (taps - 1)
    acc = padded[:rows] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + padded[j : j + rows] * weight[:, j]
    out = torch.nn.functional.silu(acc)
    # Output row t of a segment whose block starts at b is acc[b + t]; rows spanning two blocks
    # mix segments and are dropped.
    keep, new_windows, at = [], [], 0
    for start, end in spans:
        length = end - start
        keep.append(out[at : at + length])
        new_windows.append(padded[at + length : at + length + taps - 1].clone())
        at += length + taps - 1
    return torch.cat(keep), new_windows


def gated_delta_rule_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    lengths: Sequence[int],
    states: Sequence[Tensor | None],
    chunk_size: int = GDN_CHUNK_TOKENS,
) -> tuple[Tensor, list[Tensor]]:
    """The gated delta rule of several segments, rows back to back in `lengths` order.
    q, k: [R, H, Dk] (as ops.gated_delta_rule); v: [R, H, Dv]; g, beta: [R, H]; states: each
    segment's starting state [H, Dk, Dv] fp32 or None. Returns (o [R, H, Dv] in v.dtype, each
    segment's final state)."""
    num_rows, num_heads, key_dim = k.shape
    value_dim = v.shape[-1]
    # Head-major fp32 with one zero row at the end: the source of every pad row.
    qh, kh, vh = (torch.cat([t.float(), t.new_zeros(1, *t.shape[1:]).float()]).transpose(0, 1) for t in (q, k, v))
    gh, bh = (torch.cat([t.float(), t.new_zeros(1, num_heads).float()]).T for t in (g, beta))
    pad_row = num_rows
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    s = torch.stack([q.new_zeros(num_heads, key_dim, value_dim).float() if st is None else st.float() for st in states])
    out = torch.zeros(num_heads, num_rows + 1, value_dim)
    for first in range(0, max(lengths, default=0), chunk_size):
        active = [i for i, n in enumerate(lengths) if n > first]
        index = torch.tensor(
            [starts[i] + t if t < lengths[i] else pad_row for i in active for t in range(first, first + chunk_size)]
        )

        qc, kc, vc, gc, bc = (_chunks(t, index, len(active), chunk_size) for t in (qh, kh, vh, gh, bh))
        o, s_end = _delta_rule_chunk(qc, kc, vc, gc, bc, s[active])
        s[active] = s_end
        real = index != pad_row
        out[:, index[real]] = o.transpose(0, 1).flatten(1, 2)[:, real]
    return out[:, :num_rows].transpose(0, 1).to(v.dtype), list(s.unbind(0))


def _chunks(t: Tensor, index: Tensor, num: int, chunk_size: int) -> Tensor:
    """Head-major rows [H, R, ...] at index -> [num, H, chunk_size, ...], each segment's block
    contiguous (the same memory layout whatever num is)."""
    return t[:, index].unflatten(1, (num, chunk_size)).transpose(0, 1).contiguous()
