"""Tile geometry of the CUDA kernels in `cuda/*.cu`, defined once on the host.

Every size here reaches the kernels as a compile definition (`-DGDN_CHUNK=64`, ...): the `.cu`
files have no defaults and stop with `#error` without them. The launch wrappers compute grids and
dynamic shared memory from the same numbers, and each kernel checks with a `static_assert` that
its shared-memory layout is the size the host launches it with. No torch, no CuPy.

Compile a kernel by hand with the definitions NVRTC gets:
    nvcc -arch=sm_90 -std=c++17 -cubin -Xptxas -v -Icuda \
        $(python -m openjev.worker.cuda.traits) cuda/gdn_chunked.cu
"""

from __future__ import annotations

from dataclasses import dataclass

from openjev.worker.geometry import ATTN_HEAD_DIM, CONV_KERNEL_SIZE, GDN_CHUNK_TOKENS, GDN_HEAD_DIM

FLOAT_BYTES = 4
BF16_BYTES = 2
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y and z dimensions
# gated_delta.cu's per-SM worker counters of the recurrence's schedule: above any %smid
GDN_SCHED_SMS = 1024


@dataclass(frozen=True)
class GdnChunkTraits:
    """gdn_chunked.cu: the chunked delta rule on TF32 tensor cores, fp32 tiles in shared memory."""

    chunk: int = GDN_CHUNK_TOKENS
    head_dim: int = GDN_HEAD_DIM  # key and value head dims
    threads: int = 256  # a block of the solve kernel (8 warps)
    out_threads: int = 256  # a block of the output kernel: a warp a 16-column strip of all 128
    plan_threads: int = 1024  # gdn_chunk_plan: a segment a thread, so a launch holds at most this many
    state_columns: int = 64  # value columns a gdn_chunk_state block owns (= chunk)
    # Floats added to shared-memory rows so that fragment loads hit 32 different banks: an A
    # fragment reads 8 rows x 4 columns (free of conflicts at a stride of 4 mod 8: row_pad), a B
    # fragment 4 rows x 8 columns (8 mod 16: b_pad, the state pass's tiles).
    row_pad: int = 4
    b_pad: int = 8

    @property
    def plan_desc(self) -> int:
        """Offset (int32 words, a multiple of 4) of the chunk descriptors in gdn_chunk_plan's list,
        after its count and the segments' first slots."""
        return (1 + self.plan_threads + 3) // 4 * 4

    def plan_words(self, slots: int) -> int:
        """gdn_chunk_plan's list: count, first slots, then an int4 descriptor a scratch slot."""
        return self.plan_desc + 4 * slots

    @property
    def max_segments(self) -> int:
        """The most segments of a pass budget: a launch has one more (buckets.PassKey's padding)."""
        return self.plan_threads - 1

    @property
    def k_stride(self) -> int:
        """Row stride (floats) of [chunk][head_dim] tiles: k, q, W, O."""
        return self.head_dim + self.row_pad

    @property
    def chunk_stride(self) -> int:
        """Row stride (floats) of [*][chunk] tiles: A, T, U, P and the state columns."""
        return self.chunk + self.row_pad

    @property
    def kv_stride(self) -> int:
        """Row stride (floats) of the solve's [chunk][2 * head_dim] right-hand side [k | v]."""
        return 2 * self.head_dim + self.row_pad

    @property
    def block_stride(self) -> int:
        """Row stride (floats) of the solve's 16 x 16 block products."""
        return 16 + self.row_pad

    @property
    def state_stride(self) -> int:
        """Row stride (floats) of gdn_chunk_state's U~ rows (its state columns are n-major at
        k_stride, the decayed U n-major at chunk_stride: both read by ldmatrix)."""
        return self.state_columns + self.b_pad

    @property
    def state_k_stride(self) -> int:
        """Row stride (floats) of gdn_chunk_state's k rows (read as K^T: B-fragment pattern)."""
        return self.head_dim + self.b_pad

    @property
    def solve_smem_bytes(self) -> int:
        """gdn_chunk_solve: [k | v], A, T, 3 block products, g, beta (two blocks an SM)."""
        c = self.chunk
        floats = c * self.kv_stride + 2 * c * self.chunk_stride + 3 * 16 * self.block_stride + 2 * c
        return FLOAT_BYTES * floats

    @property
    def state_smem_bytes(self) -> int:
        """gdn_chunk_state: state columns (n-major), then two buffers of a chunk's W, k, U and G."""
        c = self.chunk
        per_chunk = c * self.k_stride + c * self.state_k_stride + c * self.state_stride + c
        return FLOAT_BYTES * (self.state_columns * self.k_stride + 2 * per_chunk)

    @property
    def out_smem_bytes(self) -> int:
        """gdn_chunk_out: two q buffers, k, P, two G buffers, then the next item's S_c and U (read as
        B fragments)."""
        c, d = self.chunk, self.head_dim
        return FLOAT_BYTES * (3 * c * self.k_stride + c * self.chunk_stride + 2 * c + (d + c) * self.state_k_stride)

    def definitions(self) -> dict[str, int]:
        return {
            "GDN_CHUNK": self.chunk,
            "GDN_DIM": self.head_dim,
            "GDN_CHUNK_THREADS": self.threads,
            "GDN_OUT_THREADS": self.out_threads,
            "GDN_PLAN_THREADS": self.plan_threads,
            "GDN_PLAN_DESC": self.plan_desc,
            "GDN_STATE_COLS": self.state_columns,
            "GDN_LK": self.k_stride,
            "GDN_LC": self.chunk_stride,
            "GDN_LB": self.kv_stride,
            "GDN_LX": self.block_stride,
            "GDN_LS": self.state_stride,
            "GDN_LKS": self.state_k_stride,
            "GDN_SOLVE_SMEM": self.solve_smem_bytes,
            "GDN_STATE_SMEM": self.state_smem_bytes,
            "GDN_OUT_SMEM": self.out_smem_bytes,
        }


@dataclass(frozen=True)
class AttentionTraits:
    """tree_attention.cu: bf16 Q, K and V tiles in wgmma's swizzled shared-memory layout."""

    head_dim: int = ATTN_HEAD_DIM
    block_q: int = 64  # query rows a block (4 warps x 16)
    block_k: int = 64  # keys a step
    threads: int = 128
    wgmma_align: int = 1024  # both forms round their tiles up to wgmma's 1,024-byte swizzle atoms
    plan_threads: int = 1024  # attention_tile_plan: a segment a thread a round

    @property
    def smem_bytes(self) -> int:
        """One Q tile and one K and one V tile."""
        return BF16_BYTES * self.head_dim * (self.block_q + 2 * self.block_k)

    @property
    def pipelined_smem_bytes(self) -> int:
        """tree_attention_fwd_pipelined: one Q tile, two K and two V tiles."""
        return self.smem_bytes + 2 * BF16_BYTES * self.head_dim * self.block_k

    def launch_bytes(self, pipelined: bool) -> int:
        """The dynamic shared memory a form is launched with: its tiles and the bytes that align them."""
        return (self.pipelined_smem_bytes if pipelined else self.smem_bytes) + self.wgmma_align

    def definitions(self) -> dict[str, int]:
        return {
            "ATTN_HEAD_DIM": self.head_dim,
            "ATTN_BLOCK_Q": self.block_q,
            "ATTN_BLOCK_K": self.block_k,
            "ATTN_THREADS": self.threads,
            "ATTN_SMEM": self.smem_bytes,
            "ATTN_PLAN_THREADS": self.plan_threads,
        }


@dataclass(frozen=True)
class ConvTraits:
    """conv1d.cu: a thread computes 8 channels of `rows(T)` consecutive output rows."""

    kernel_size: int = CONV_KERNEL_SIZE
    threads: int = 128

    def definitions(self) -> dict[str, int]:
        return {"CONV_K": self.kernel_size}

    @staticmethod
    def rows(tokens: int) -> int:
        """Output rows a thread: 4 up to 512 tokens (more grid), 16 above (fewer window
        reloads); measured on an H200, 2026-12-01 (docs/cuda-kernels.md)."""
        return 4 if tokens <= 512 else 16

    def grid_rows(self, tokens: int, segments: int, rows: int | None = None) -> int:
        """The launch's grid y: a block of row groups, then one for each new window row."""
        rows = rows or self.rows(tokens)
        return -(-tokens // rows) + segments * (self.kernel_size - 1)


@dataclass(frozen=True)
class GemmVariant:
    """gemm_stream.cu: wm x wn warps, each owning mi m16 row tiles x ni n8 column tiles, fed by a
    cp.async pipeline `stages` k-tiles of block_k columns deep."""

    wm: int
    wn: int
    mi: int
    ni: int
    block_k: int
    stages: int

    @property
    def code(self) -> int:
        """Decimal digits wm, wn, mi, ni, block_k / 64, then two of stages: the kernel's name
        and its entry in the compile definition."""
        digits = (self.wm, self.wn, self.mi, self.ni, self.block_k // 64)
        assert all(0 < d < 10 for d in digits) and self.block_k % 64 == 0 and 1 < self.stages < 100
        code = 0
        for d in digits:
            code = code * 10 + d
        return code * 100 + self.stages

    @property
    def name(self) -> str:
        return f"gemm_stream_{self.code}"

    @property
    def block_m(self) -> int:
        return 16 * self.wm * self.mi

    @property
    def block_n(self) -> int:
        return 8 * self.wn * self.ni

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def smem_bytes(self) -> int:
        """`stages` tiles of block_m x rows and block_n w rows, block_k bf16 columns each."""
        return self.stages * (self.block_m + self.block_n) * self.block_k * BF16_BYTES


# The menu the host chooses from per product shape and row count (gemm_stream.py); every
# variant gives a row the same bits (the kernel's header says why). (wm, wn, mi, ni, block_k,
# stages); block rows x weight rows in the comments.
GEMM_STREAM = tuple(
    GemmVariant(*v)
    for v in (
        (1, 1, 1, 1, 128, 6),  # 16 x 8: one warp a block, 640 blocks for N = 5,120
        (1, 2, 1, 1, 64, 12),  # 16 x 16: 320 blocks for N = 5,120
        (1, 2, 1, 1, 128, 8),
        (1, 2, 1, 1, 256, 4),
        (1, 4, 1, 1, 64, 8),  # 16 x 32
        (1, 4, 1, 1, 128, 6),
        (1, 4, 1, 1, 256, 3),
        (1, 4, 1, 2, 64, 6),  # 16 x 64
        (1, 4, 1, 2, 128, 4),
        (1, 8, 1, 2, 64, 4),  # 16 x 128
        (1, 8, 1, 2, 128, 3),
        (1, 2, 2, 1, 128, 6),  # 32 x 16
        (1, 4, 2, 2, 64, 5),  # 32 x 64
        (1, 4, 2, 2, 128, 4),
        (1, 8, 2, 2, 64, 4),  # 32 x 128
        (2, 4, 2, 2, 64, 4),  # 64 x 64
        (2, 4, 2, 4, 64, 4),  # 64 x 128
        (1, 4, 5, 2, 64, 5),  # 80 x 64: 65-80 rows in one tile
        (2, 4, 4, 4, 64, 3),  # 128 x 128
        (2, 1, 1, 4, 128, 4),  # 32 x 32, warps stacked along rows: the down product at 33-64 rows
    )
)


def gemm_definitions() -> dict[str, int | str]:
    # no spaces or commas: the definition survives a shell's word splitting (the nvcc line above)
    # and nvcc's splitting of option values at commas
    return {"GS_VARIANTS": "".join(f"GS({v.code})" for v in GEMM_STREAM)}


GDN_CHUNKED = GdnChunkTraits()
ATTENTION = AttentionTraits()
CONV = ConvTraits()


def compile_definitions() -> tuple[str, ...]:
    """`-DNAME=value` for every kernel size; every `.cu` module is compiled with all of them."""
    merged = {
        **GDN_CHUNKED.definitions(),
        **ATTENTION.definitions(),
        **CONV.definitions(),
        **gemm_definitions(),
        "GDN_SCHED_SMS": GDN_SCHED_SMS,
    }
    return tuple(f"-D{name}={value}" for name, value in sorted(merged.items()))


if __name__ == "__main__":
    print(" ".join(compile_definitions()))
