"""Weights pulled into L2 ahead of the product that reads them (`cuda/prefetch.cu`): issued on a
side stream while the main stream runs kernels that leave memory idle, so the product reads part
of its weight from L2. A hint: no value changes, so bits and batch invariance are untouched."""

from __future__ import annotations

import torch

from openjev.worker.cuda import kernels as K

CHUNK = 16 * 1024  # bytes a bulk prefetch


def l2_prefetch(t: torch.Tensor, nbytes: int, evict_last: bool = False, blocks: int = 132) -> None:
    """Prefetch the first `nbytes` of contiguous tensor `t` into L2, on the current stream."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: a contiguous tensor")
    n = min(int(nbytes), t.numel() * t.element_size()) // 16 * 16
    if n <= 0:
        return
    name = "l2_prefetch_last" if evict_last else "l2_prefetch"
    K._launch("prefetch", name, (blocks,), (32,), [t, K._i64(n), CHUNK])
