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


@dataclass(frozen=True)
class GdnChunkTraits:
    """gdn_chunked.cu: the chunked delta rule on TF32 tensor cores, fp32 tiles in shared memory."""

    chunk: int = GDN_CHUNK_TOKENS
    head_dim: int = GDN_HEAD_DIM  # key and value head dims
    threads: int = 256  # a block of the solve and output kernels (8 warps)
    state_columns: int = 64  # value columns a gdn_chunk_state or gdn_chunk_out block owns (= chunk)
    # Floats added to every shared-memory row: rows start in different banks and WMMA tiles stay
    # 32-byte aligned.
    row_pad: int = 4

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
    def solve_smem_bytes(self) -> int:
        """gdn_chunk_solve: [k | v], A, T, 3 block products, g, beta (two blocks an SM)."""
        c = self.chunk
        floats = c * self.kv_stride + 2 * c * self.chunk_stride + 3 * 16 * self.block_stride + 2 * c
        return FLOAT_BYTES * floats

    @property
    def state_smem_bytes(self) -> int:
        """gdn_chunk_state: state columns, then two buffers of a chunk's W, k, U and G."""
        c = self.chunk
        per_chunk = 2 * c * self.k_stride + c * self.chunk_stride + c
        return FLOAT_BYTES * (self.head_dim * self.chunk_stride + 2 * per_chunk)

    @property
    def out_smem_bytes(self) -> int:
        """gdn_chunk_out: q (then e^G q, then O), k (then P), G."""
        return FLOAT_BYTES * (2 * self.chunk * self.k_stride + self.chunk)

    def definitions(self) -> dict[str, int]:
        return {
            "GDN_CHUNK": self.chunk,
            "GDN_DIM": self.head_dim,
            "GDN_CHUNK_THREADS": self.threads,
            "GDN_STATE_COLS": self.state_columns,
            "GDN_LK": self.k_stride,
            "GDN_LC": self.chunk_stride,
            "GDN_LB": self.kv_stride,
            "GDN_LX": self.block_stride,
            "GDN_SOLVE_SMEM": self.solve_smem_bytes,
            "GDN_STATE_SMEM": self.state_smem_bytes,
            "GDN_OUT_SMEM": self.out_smem_bytes,
        }


@dataclass(frozen=True)
class AttentionTraits:
    """tree_attention.cu: bf16 Q, K and V tiles in XOR-swizzled shared memory."""

    head_dim: int = ATTN_HEAD_DIM
    block_q: int = 64  # query rows a block (4 warps x 16)
    block_k: int = 64  # keys a step
    threads: int = 128

    @property
    def smem_bytes(self) -> int:
        """One Q tile and one K and one V tile."""
        return BF16_BYTES * self.head_dim * (self.block_q + 2 * self.block_k)

    def definitions(self) -> dict[str, int]:
        return {
            "ATTN_HEAD_DIM": self.head_dim,
            "ATTN_BLOCK_Q": self.block_q,
            "ATTN_BLOCK_K": self.block_k,
            "ATTN_THREADS": self.threads,
            "ATTN_SMEM": self.smem_bytes,
        }


@dataclass(frozen=True)
class ConvTraits:
    """conv1d.cu: a thread computes 8 channels of rows_per_thread consecutive output rows."""

    kernel_size: int = CONV_KERNEL_SIZE
    rows_per_thread: int = 4
    threads: int = 128

    def definitions(self) -> dict[str, int]:
        return {"CONV_K": self.kernel_size, "CONV_ROWS": self.rows_per_thread}


GDN_CHUNKED = GdnChunkTraits()
ATTENTION = AttentionTraits()
CONV = ConvTraits()


def compile_definitions() -> tuple[str, ...]:
    """`-DNAME=value` for every kernel size; every `.cu` module is compiled with all of them."""
    merged = {**GDN_CHUNKED.definitions(), **ATTENTION.definitions(), **CONV.definitions()}
    return tuple(f"-D{name}={value}" for name, value in sorted(merged.items()))


if __name__ == "__main__":
    print(" ".join(compile_definitions()))
