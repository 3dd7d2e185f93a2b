"""A bounded cache of CUDA graphs keyed by shape bucket.

A launch's many small kernels cost more in host launch overhead than on the GPU at short
lengths; replaying a captured graph costs one launch. Inputs are padded by the caller to a shape
bucket (`fine_bucket`), written into the graph's static input buffers, and the graph is
replayed; the least recently used graph is dropped once `capacity` graphs are held.

All graphs of one cache share one memory pool, so a graph costs its instantiated kernel list,
not its own copy of every intermediate buffer. That is safe because the cache's graphs replay
one at a time on one stream and each replay's outputs are copied out (`replay`'s contract) before
another graph replays and reuses their memory as its scratch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.cuda.graphs import _POOL_HANDLE  # the type graph_pool_handle() returns


def fine_bucket(n: int, smallest: int = 16, steps: int = 8) -> int:
    """n rounded up to a multiple of max(smallest, 2^floor(log2 n) / steps): `steps` sizes per
    octave, so at most 1/steps of a launch is padding (powers of two would pad 792 tokens to
    1,024 and make GEMM-bound launches slower than eager ones)."""
    if n <= smallest:
        return smallest
    step = max(smallest, (1 << (n.bit_length() - 1)) // steps)
    return -(-n // step) * step


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: Any


class GraphCache:
    """fn(**inputs) -> tensor or tuple of tensors, captured once per key."""

    def __init__(self, capacity: int = 8):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.num_captures = 0
        self.num_replays = 0
        self._side: torch.cuda.Stream | None = None
        # the shared memory pool, made by the first capture into an empty cache
        self._pool: _POOL_HANDLE | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> _Entry | None:
        """The entry for key (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def capture(
        self, key: Hashable, fn: Callable[..., Any], static: dict[str, torch.Tensor], warm: bool = True
    ) -> _Entry:
        """Capture fn(**static) under key; `static` become the graph's input buffers as they are
        (the caller writes later inputs into entry.inputs in place). Evicts the least recently
        used entry beyond capacity. Raises whatever the capture raised; nothing is cached then.
        warm: run fn once outside the capture first (False where a pass of the same products
        already ran: what the warm-up loads and sizes is then in place)."""
        if self._side is None:  # one side stream: blocks its warm-ups free stay reusable by the next
            self._side = torch.cuda.Stream()
        if not self._entries:
            # a pool lives while a graph uses it: once the last one is gone, its handle is dead
            # (capturing into it again trips an allocator assertion), so start a new one
            self._pool = torch.cuda.graph_pool_handle()
        if warm:
            side = self._side
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(**static)  # warm-up outside capture: module loads, cuBLAS workspaces, allocator
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (servers, metrics) must not invalidate it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(**static)
        self.num_captures += 1
        entry = _Entry(graph, static, outputs)
        self._entries[key] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def replay(self, entry: _Entry) -> Any:
        """Replay on the current stream; returns the static outputs (overwritten by the next
        replay of any entry, so copy what must outlive it)."""
        entry.graph.replay()
        self.num_replays += 1
        return entry.outputs

    def clear(self) -> None:
        self._entries.clear()
