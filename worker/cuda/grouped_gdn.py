"""Launch wrapper for the grouped Gated DeltaNet kernel of `cuda/gdn_grouped.cu` (`--gdn-kernel
grouped`; docs/cuda-kernels.md, "Grouped GDN"): the exact delta rule in groups of a few tokens
at absolute positions, fp32, one launch per level. Its segments start as the chunked kernel's do
(chunked_gdn.ChunkSources), with tails of a group's rows instead of a chunk's."""

from __future__ import annotations

import torch

from openjev.worker.cuda.chunked_gdn import ChunkSources, gdn_tail_width
from openjev.worker.cuda.kernels import GDN_DIM, _i64, _launch, _out, gdn_schedule

# variant -> tokens a group; g4 and g8 give different bits (a group's sums are ordered by it)
GDN_GROUPS = {"g4": 4, "g8": 8}
GDN_GROUP_DEFAULT = "g4"


def gdn_grouped(
    qn,
    kn,
    v,
    g,
    beta,
    cu_seqlens,
    positions,
    init_state=None,
    tail_in=None,
    out=None,
    final=None,
    tail_out=None,
    variant: str = GDN_GROUP_DEFAULT,
    sources: ChunkSources | None = None,
):
    """Gated delta rule over packed segments in groups of GDN_GROUPS[variant] tokens at absolute
    positions (cuda/gdn_grouped.cu says why and how).

    qn, kn: [T, Hk, 128] fp32; v: [T, H, 128] bf16 view (16-byte aligned rows, inner contiguous);
    g, beta: [T, H] fp32; cu_seqlens: [N+1] int32; positions: [T] int32. Where segments start:
    `sources` (tails of `rows` rows), or one level with init_state [N, H, 128, 128] fp32 (None:
    zeros) and tail_in [N, rows, gdn_tail_width] fp32, segment n's first positions[cu[n]] % rows
    rows. Returns (o [T, H, 128] bf16, final [N, H, 128, 128] fp32 = the state at each segment's
    last group boundary, tail_out [N, rows, width] fp32 = the rows after it).
    """
    T, H = g.shape
    Hk = qn.shape[1]
    N = cu_seqlens.numel() - 1
    rows = GDN_GROUPS[variant]
    assert v.stride(2) == 1 and v.stride(1) == GDN_DIM and H % Hk == 0 and qn.is_contiguous() and kn.is_contiguous()
    assert v.data_ptr() % 16 == 0 and v.stride(0) % 8 == 0, "v rows must be 16-byte aligned (cp.async)"
    dev, width = g.device, gdn_tail_width(Hk, H)
    if sources is None:
        sources = ChunkSources.per_segment(N, H, width, dev, init_state, tail_in, rows=rows)
    out = _out(out, (T, H, GDN_DIM), torch.bfloat16, dev)
    final = _out(final, (N, H, GDN_DIM, GDN_DIM), torch.float32, dev)
    tail_out = _out(tail_out, (N, rows, width), torch.float32, dev)
    slots = sources.init_slots
    assert slots.shape[1:] == (H, GDN_DIM, GDN_DIM) and slots[0].is_contiguous()
    sched, sms = gdn_schedule(dev)
    for level in range(sources.num_levels):  # parents' final states before their children start
        _launch(
            "gdn_grouped",
            f"gdn_grouped_{variant}",
            (4 * sms,),  # every resident slot; workers take the items (gdn_sched.cuh)
            (128,),
            (qn, kn, v, _i64(v.stride(0)), g, beta, cu_seqlens, positions, H, Hk, slots, _i64(slots.stride(0)))
            + (sources.init_idx, sources.tail_src, sources.tails, _i64(width), sources.level_off, level, sched, sms)
            + (out, final, tail_out),
        )
    return out, final, tail_out
