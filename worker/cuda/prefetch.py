"""Weights pulled into L2 ahead of the product that reads them (`cuda/prefetch.cu`): issued on a
side stream while the main stream runs kernels that leave memory idle, so the product reads part
of its weight from L2. A hint: no value changes, so bits and batch invariance are untouched."""

from __future__ import annotations

import torch

from openjev.worker.cuda import kernels as K

CHUNK = 16 * 1024  # bytes a bulk prefetch


def l2_prefetch(t: torch.Tensor, nbytes: int, how: str = "bulk", blocks: int = 132) -> None:
    """Prefetch the first `nbytes` of contiguous tensor `t` into L2, on the current stream:
    how = "bulk" (bulk prefetches), "bulk_last" (the same, evict_last) or "loads" (plain loads)."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: a contiguous tensor")
    n = min(int(nbytes), t.numel() * t.element_size()) // 16 * 16
    if n <= 0:
        return
    if how == "loads":
        K._launch("prefetch", "l2_touch", (blocks,), (256,), [t, K._i64(n // 16), _sink(t.device)])
        return
    name = {"bulk": "l2_prefetch", "bulk_last": "l2_prefetch_last"}[how]
    K._launch("prefetch", name, (blocks,), (32,), [t, K._i64(n), CHUNK])


_sinks: dict = {}


def _sink(device) -> torch.Tensor:
    if device not in _sinks:
        _sinks[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _sinks[device]
