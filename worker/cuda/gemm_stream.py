"""Products of few rows that stream the weight (cuda/gemm_stream.cu): x [M, K] @ w [N, K]^T -> bf16.

Every variant of the kernel sums each output in one fixed order (k ascending, 16 columns a
tensor-core step, one fp32 accumulator, no split of K), so a row's bits depend neither on M nor
on the variant: the variant is picked per weight shape and row count for speed alone (`choose`,
from measurements of benchmarks/gemm_stream.py). Not wired into the runner: whether its rows also
match cuBLAS's bits at the row counts where cuBLAS takes over is measured by that benchmark, and
the runner may mix the two only if they do (worker/cuda/gemm.py says why).
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
    """A variant for M rows against an [N, K] weight: small tiles of N where the weight has few
    rows (enough blocks for every multiprocessor), wide ones where x is re-read by many blocks;
    long k-tiles where they divide K."""
    wide = k % 128 == 0
    if m <= 16:
        if n <= 8192:
            return variant(1211208 if wide else 1211112)
        return variant(1812104)
    if m <= 32:
        return variant(1422105 if n <= 8192 else 1822104)
    if m <= 64:
        return variant(2422104 if n <= 8192 else 2424104)
    if m <= 80:
        return variant(1452105)
    return variant(2444103)


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
