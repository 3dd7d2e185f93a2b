"""Products of few rows that stream the weight (cuda/gemm_stream.cu): x [M, K] @ w [N, K]^T -> bf16.

Every variant of the kernel sums each output in one fixed order (k ascending, 16 columns a
tensor-core step, one fp32 accumulator, no split of K), so a row's bits depend neither on M nor
on the variant: the variant is picked per weight shape and row count for speed alone (`choose`,
from measurements of benchmarks/gemm_stream.py). On the H200 that order gives every row the bits
cuBLAS gives it wherever cuBLAS does not split K (all six 27B product shapes, 2,048 rows), so
products may switch between the two by row count (gemm.linear's stream_rows, after
gemm.stream_matches; the runner takes gemm.stream_plan at start).
"""

from __future__ import annotations

import torch

from openjev.worker.cuda import kernels, traits
from openjev.worker.cuda.traits import GemmVariant

VARIANTS = {v.code: v for v in traits.GEMM_STREAM}
MODULE = "gemm_stream"


def variant(code: int) -> GemmVariant:
    if code not in VARIANTS:
        raise ValueError(f"no gemm_stream variant {code}; compiled: {sorted(VARIANTS)}")
    return VARIANTS[code]


def choose(m: int, n: int, k: int) -> GemmVariant:
    """A variant for M rows against an [N, K] weight, from the timings of every variant on the
    27B product shapes (docs/cuda-kernels.md): for few rows, narrow weight tiles where the weight
    has few rows (5,120: enough blocks for every multiprocessor) and long k-tiles; 32-row tiles to
    74 rows there; larger tiles above, where x is re-read by fewer blocks."""
    k256, k128 = k % 256 == 0, k % 128 == 0
    if m <= 16:
        if n <= 8192:
            return variant(1211404 if k256 else 1211208 if k128 else 1211112)
        if n <= 24576:
            return variant(1422204 if k128 else 1422105)
        return variant(1411403 if k256 else 1411206 if k128 else 1411108)
    if 32 < m <= 64 and n <= 8192 and k % 256 == 0:  # the down product: 76 against 89 us (docs/cuda-kernels.md)
        return variant(2114204)
    if m <= 32 or (m <= 80 and n <= 8192):
        return variant(1422204 if k128 else 1422105)
    if m <= 64:
        return variant(2424104)
    if m <= 80:
        return variant(1452105)
    if m <= 128:
        return variant(2424104)
    return variant(2444103)


# Rows up to which gemm_stream (chosen variant) was faster than the runner's cuBLAS call, per
# 27B weight shape (N, K), at the row counts measured (1, 8, 16, 32, 64, 74, 128, 256, and 80
# for down; H200, docs/cuda-kernels.md). Graph passes have 80 rows for 65-80 tokens. 0: cuBLAS
# at every row count. The down product gains most: cuBLAS splits its K below 352 rows, so the
# runner pads those products (gemm.py).
STREAM_ROWS = {
    (16480, 5120): 32,  # GDN in
    (5120, 6144): 0,  # GDN out, attention out
    (14336, 5120): 0,  # attention in: within noise of cuBLAS at 1-32 rows
    (34816, 5120): 16,  # MLP gate + up
    (5120, 17408): 80,  # MLP down (80: benchmarks/gemm_split.py, 91.8 against 98.2 us padded)
}


def stream_rows(n: int, k: int) -> int:
    """STREAM_ROWS for a weight [N, K]; 0 for shapes not measured."""
    return STREAM_ROWS.get((n, k), 0)


def check(x: torch.Tensor, w: torch.Tensor, v: GemmVariant | None = None) -> None:
    """The kernel's requirements, as a ValueError naming the first one broken."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"bf16 operands expected, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    n, k = w.shape
    if k % 64 or n % 8:
        raise ValueError(f"K must be a multiple of 64 and N of 8, got N={n}, K={k}")
    if v is not None and k % v.block_k:
        raise ValueError(f"variant {v.code} takes K in multiples of {v.block_k}, got K={k}")
    if not w.is_contiguous() or w.data_ptr() % 16:
        raise ValueError("w must be contiguous and 16-byte aligned")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("x rows must be contiguous and 16-byte aligned")


def linear(x: torch.Tensor, w: torch.Tensor, code: int | None = None, out: torch.Tensor | None = None):
    """x [M, K] @ w [N, K]^T as bf16 [M, N]; `code` forces a variant (traits.GEMM_STREAM)."""
    check(x, w)
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    v = choose(m, n, k) if code is None else variant(code)
    check(x, w, v)
    out = kernels._out(out, (m, n), torch.bfloat16, x.device)
    if m == 0:
        return out
    grid = ((m + v.block_m - 1) // v.block_m, (n + v.block_n - 1) // v.block_n)
    args = (x, kernels._i64(x.stride(0)), w, out, kernels._i64(n), m, n, k)
    kernels._launch(MODULE, v.name, grid, (v.threads,), args, dynamic_smem=v.smem_bytes)
    return out
