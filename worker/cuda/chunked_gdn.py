"""Launch wrappers for the chunked (WY-form) Gated DeltaNet kernels of `cuda/gdn_chunked.cu`
(`--gdn-kernel chunked`; docs/cuda-kernels.md, "Chunked GDN"): the chunk list, the solve, the
state pass per level and the output pass, and where their segments start (ChunkSources). The
shared launch machinery is `kernels`."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from openjev.worker.cuda import traits
from openjev.worker.cuda.kernels import GDN_CHUNK, GDN_DIM, _i64, _launch, _out, gdn_schedule


def _tail_words(num_k_heads: int, num_v_heads: int) -> tuple[int, int]:
    """The words of a tail row's k and of its v (bf16 pairs); g and beta follow them."""
    return num_k_heads * GDN_DIM, num_v_heads * GDN_DIM // 2


def gdn_tail_width(num_k_heads: int, num_v_heads: int) -> int:
    """4-byte words a row of a GDN tail buffer: k (Hk*128 fp32) | v (H*128 bf16, two a word: v is
    a bf16 input, kept exactly in 37% less room on the 27B shape) | g (H fp32) | beta (H fp32),
    padded to 4 words. The buffers are fp32 tensors; pack_tails / unpack_tails convert."""
    return -(-(sum(_tail_words(num_k_heads, num_v_heads)) + 2 * num_v_heads) // 4) * 4


def pack_tails(k, v, g, beta) -> torch.Tensor:
    """Tail rows [..., gdn_tail_width] fp32 words from k [..., Hk*128] fp32, v [..., H*128]
    (bf16-exact), g, beta [..., H] (tests: the rows the kernels write and read)."""
    Hk, H = k.shape[-1] // GDN_DIM, g.shape[-1]
    kd, vd = _tail_words(Hk, H)
    out = k.new_zeros(*k.shape[:-1], gdn_tail_width(Hk, H), dtype=torch.float32)
    out[..., :kd] = k
    out[..., kd : kd + vd] = v.to(torch.bfloat16).contiguous().view(torch.float32)
    out[..., kd + vd : kd + vd + H] = g
    out[..., kd + vd + H : kd + vd + 2 * H] = beta
    return out


def unpack_tails(t, num_k_heads: int, num_v_heads: int) -> torch.Tensor:
    """The rows [..., (Hk + H)*128 + 2H] fp32 (k | v | g | beta: reference.gdn_chunked_packed's
    layout) of tail words t [..., gdn_tail_width]."""
    (kd, vd), H = _tail_words(num_k_heads, num_v_heads), num_v_heads
    v = t[..., kd : kd + vd].contiguous().view(torch.bfloat16).float()
    return torch.cat([t[..., :kd], v, t[..., kd + vd : kd + vd + 2 * H]], dim=-1)


def scratch_chunks(tokens: int, segments: int) -> int:
    """Scratch chunks a launch of `tokens` rows fills at most when at most `segments` of its
    segments are listed: a segment's ceil((tail + own) / 64) chunks are at most (own + 126) / 64
    (up to 63 tail rows, a partial last chunk), and only segments with rows have any (at most
    `tokens` of them)."""
    return (tokens + 2 * (GDN_CHUNK - 1) * min(segments, tokens)) // GDN_CHUNK + 1


@dataclass(frozen=True)
class ChunkScratch:
    """The chunked kernels' scratch, fp32, a slot a chunk: W, U [chunks, H, 64, 128], gcum
    [chunks, H, 64], the state pass's K [chunks, Hk, 64, 128], the chunk states [chunks, H, 128,
    128]. A graph runner holds one of its budget's size that every pass and layer reuses (they
    run one at a time on one stream): allocated in each captured pass instead, each larger pass
    took a new block of the graphs' shared pool and the pool kept them all (docs/cuda-kernels.md,
    "The GDN kernels split by position, built")."""

    w: torch.Tensor
    u: torch.Tensor
    gcum: torch.Tensor
    kt: torch.Tensor
    states: torch.Tensor

    @staticmethod
    def shapes(chunks: int, H: int, Hk: int) -> dict[str, tuple[int, ...]]:
        D = GDN_DIM
        return {
            "w": (chunks, H, GDN_CHUNK, D),
            "u": (chunks, H, GDN_CHUNK, D),
            "gcum": (chunks, H, GDN_CHUNK),
            "kt": (chunks, Hk, GDN_CHUNK, D),
            "states": (chunks, H, D, D),
        }

    @staticmethod
    def empty(chunks: int, H: int, Hk: int, device) -> ChunkScratch:
        shapes = ChunkScratch.shapes(chunks, H, Hk)
        return ChunkScratch(**{n: torch.empty(s, dtype=torch.float32, device=device) for n, s in shapes.items()})

    def first(self, chunks: int) -> ChunkScratch:
        """The first `chunks` slots."""
        assert chunks <= self.w.shape[0], f"{chunks} scratch chunks > {self.w.shape[0]} held"
        return ChunkScratch(**{f.name: getattr(self, f.name)[:chunks] for f in fields(self)})

    @staticmethod
    def of(buffers: dict[str, torch.Tensor], prefix: str) -> ChunkScratch:
        """The scratch held among `buffers` under prefix + each of shapes()' names."""
        return ChunkScratch(**{f.name: buffers[prefix + f.name] for f in fields(ChunkScratch)})


# gdn_chunk_state variants: warps a block (value columns split in two halves either way); both
# give the same bits; w8 is the faster again since the state stays in registers (3-4% from 4,096
# tokens; docs/cuda-kernels.md, "The solve's serial steps, the state pass's state in registers")
GDN_STATE_VARIANTS = ("w8", "w16")
GDN_STATE_DEFAULT = "w8"


@dataclass(frozen=True)
class ChunkSources:
    """Where gdn_chunked's segments start (cuda/gdn_chunked.cu): init_slots [1 + S, H, 128, 128]
    fp32 states (slot 0 unused); init_idx [N] int32 (> 0 a slot, -1 zeros, -2 - p in-pass
    parent p's final state); tails [(1 + S') * 64, width] fp32, kept states' tail rows
    flattened; tail_src [N * 64] int32, per segment and tail row a packed row (>= 0) or -1 - e,
    row e of tails; level_off [levels + 1] int32, the segments of each level (parents first);
    num_levels: state-pass launches."""

    init_slots: torch.Tensor
    init_idx: torch.Tensor
    tails: torch.Tensor
    tail_src: torch.Tensor
    level_off: torch.Tensor
    num_levels: int

    @staticmethod
    def per_segment(N, H, width, device, init_state=None, tail_in=None) -> ChunkSources:
        """One level, segment n starting from init_state[n] (or zeros) and its tail rows from
        tail_in[n] [N, 64, width] (tests and benchmarks; the runner passes its slots instead)."""
        zero_state = torch.zeros(1, H, GDN_DIM, GDN_DIM, dtype=torch.float32, device=device)
        slots = zero_state if init_state is None else torch.cat([zero_state, init_state.float()])
        idx = [n + 1 if init_state is not None else -1 for n in range(N)]
        zero_tail = torch.zeros(GDN_CHUNK, width, dtype=torch.float32, device=device)
        tails = zero_tail if tail_in is None else torch.cat([zero_tail, tail_in.reshape(-1, width).float()])
        src = [-1 - ((n + 1) * GDN_CHUNK + r) if tail_in is not None else 0 for n in range(N) for r in range(GDN_CHUNK)]
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        return ChunkSources(slots, i32(idx), tails, i32(src), i32([0, N]), 1)


def gdn_chunked(
    qn,
    kn,
    v,
    g,
    beta,
    cu_seqlens,
    positions,
    max_q,
    init_state=None,
    tail_in=None,
    out=None,
    final=None,
    tail_out=None,
    state_variant=GDN_STATE_DEFAULT,
    sources: ChunkSources | None = None,
    scratch: ChunkScratch | None = None,
    listed: int | None = None,
):
    """Gated delta rule over packed segments in GDN_CHUNK (64) token chunks at absolute positions
    (cuda/gdn_chunked.cu says why and how).

    qn, kn: [T, Hk, 128] fp32; v: [T, H, 128] bf16 view (token stride free, inner contiguous);
    g, beta: [T, H] fp32; cu_seqlens: [N+1] int32; positions: [T] int32 (segment n starts at
    positions[cu[n]]); max_q: no segment is longer. Where segments start: `sources`
    (ChunkSources: parents in the pass, kept states in slots), or one level with init_state [N,
    H, 128, 128] fp32 (None: zeros) and tail_in [N, 64, gdn_tail_width] fp32, segment n's first
    positions[cu[n]] % 64 rows (its parent's unfinished chunk; None when no segment has one).
    Returns (o [T, H, 128] bf16, final [N, H, 128, 128] fp32 = the state at each segment's last
    chunk boundary, tail_out [N, 64, width] fp32 = the rows after it). scratch: held slots to use
    (None: allocated here); listed: at most this many segments are in sources' levels (None: N).
    """
    T, H = g.shape
    Hk = qn.shape[1]
    N = cu_seqlens.numel() - 1
    assert v.stride(2) == 1 and v.stride(1) == GDN_DIM and H % Hk == 0 and qn.is_contiguous() and kn.is_contiguous()
    assert state_variant in GDN_STATE_VARIANTS
    dev, width = g.device, gdn_tail_width(Hk, H)
    if sources is None:
        sources = ChunkSources.per_segment(N, H, width, dev, init_state, tail_in)
    out = _out(out, (T, H, GDN_DIM), torch.bfloat16, dev)
    final = _out(final, (N, H, GDN_DIM, GDN_DIM), torch.float32, dev)
    tail_out = _out(tail_out, (N, GDN_CHUNK, width), torch.float32, dev)
    max_chunks = (max_q + 2 * GDN_CHUNK - 2) // GDN_CHUNK  # a segment's rows: up to 63 tail rows + max_q
    chunks = scratch_chunks(T, N if listed is None else min(N, listed))
    # U holds U~ from the solve, overwritten with U by the state pass; kt: the state pass's K
    sc = ChunkScratch.empty(chunks, H, Hk, dev) if scratch is None else scratch.first(chunks)
    chunk_list = gdn_chunk_plan(cu_seqlens, positions, max_chunks, chunks, sources)
    geo = (N, H, Hk, max_chunks, width)
    gdn_chunk_solve(geo, kn, v, g, beta, sources, tail_out, sc.w, sc.u, sc.gcum, sc.kt, chunk_list)
    for level in range(sources.num_levels):  # parents' final states before their children start
        gdn_chunk_state(
            geo,
            sc.kt,
            sc.w,
            sc.u,
            sc.gcum,
            cu_seqlens,
            positions,
            sources,
            level,
            sc.states,
            final,
            chunk_list,
            state_variant,
        )
    gdn_chunk_out(geo, qn, sc.kt, sc.u, sc.states, sc.gcum, out, chunk_list)
    return out, final, tail_out


def gdn_chunk_plan(cu_seqlens, positions, max_chunks: int, slots: int, src: ChunkSources) -> torch.Tensor:
    """[plan_words(slots)] int32: the launch's chunk count, each segment's first scratch slot,
    then per chunk a descriptor (its segment and index, the segment's first row, rows and tail),
    in scratch-slot order, for the segments of src's levels (cuda/gdn_chunked.cu); made on the
    device, so capturable."""
    N = cu_seqlens.numel() - 1
    assert N <= traits.GDN_CHUNKED.plan_threads, f"{N} segments in one chunked GDN launch"
    threads = traits.GDN_CHUNKED.plan_threads
    words = traits.GDN_CHUNKED.plan_words(slots)
    chunk_list = torch.empty(words, dtype=torch.int32, device=cu_seqlens.device)
    _launch(
        "gdn_chunked",
        "gdn_chunk_plan",
        (1,),
        (threads,),
        (cu_seqlens, positions, max_chunks, src.level_off, src.num_levels, chunk_list),
    )
    return chunk_list


# The launches of gdn_chunked, separately callable so that the benchmark can time each.
# geo = (N, H, Hk, max_chunks, tail width); buffers as gdn_chunked allocates them.


def gdn_chunk_solve(geo, kn, v, g, beta, src: ChunkSources, tail_out, w, u, gcum, kt, chunk_list) -> None:
    """The solve over every listed chunk; kt: [chunks, Hk, 64, 128] fp32, each chunk's k rows
    rounded to tf32 (the state pass's K)."""
    N, H, Hk, max_chunks, width = geo
    counters, sms = gdn_schedule(kn.device)
    _launch(
        "gdn_chunked",
        "gdn_chunk_solve",
        (2 * sms,),  # two blocks an SM take the (chunk, head) items
        (traits.GDN_CHUNKED.threads,),
        (
            kn,
            v,
            _i64(v.stride(0)),
            g,
            beta,
            H,
            Hk,
            src.tail_src,
            src.tails,
            tail_out,
            _i64(width),
            w,
            u,
            gcum,
            kt,
            chunk_list,
            counters,
        ),
        dynamic_smem=traits.GDN_CHUNKED.solve_smem_bytes,
    )


def gdn_chunk_state(
    geo,
    kt,
    w,
    u,
    gcum,
    cu_seqlens,
    positions,
    src: ChunkSources,
    level,
    chunk_states,
    final,
    chunk_list,
    variant=GDN_STATE_DEFAULT,
) -> None:
    """The state pass over the segments of one level (src.level_off); kt: the solve's K tiles;
    chunk_list: gdn_chunk_plan's (each segment's first scratch slot)."""
    N, H, Hk, max_chunks, width = geo
    geom = traits.GDN_CHUNKED
    counters, sms = gdn_schedule(kt.device)
    _launch(
        "gdn_chunked",
        f"gdn_chunk_state_{variant}",
        (sms,),  # a block an SM takes the level's (columns, head, segment) items
        (32 * int(variant[1:]),),
        (
            kt,
            w,
            u,
            gcum,
            cu_seqlens,
            positions,
            H,
            Hk,
            max_chunks,
            src.init_slots,
            src.init_idx,
            src.level_off,
            level,
            chunk_states,
            final,
            chunk_list,
            counters,
        ),
        dynamic_smem=geom.state_smem_bytes,
    )


def gdn_chunk_out(geo, qn, kt, u, chunk_states, gcum, out, chunk_list) -> None:
    """The output pass over every listed chunk; kt: the solve's K tiles."""
    N, H, Hk, max_chunks, width = geo
    counters, sms = gdn_schedule(kt.device)
    _launch(
        "gdn_chunked",
        "gdn_chunk_out",
        (sms,),  # a block an SM takes the (chunk, head) items
        (traits.GDN_CHUNKED.out_threads,),
        (qn, kt, u, chunk_states, gcum, H, Hk, out, chunk_list, counters),
        dynamic_smem=traits.GDN_CHUNKED.out_smem_bytes,
    )
