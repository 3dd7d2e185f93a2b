"""A bounded cache of CUDA graphs keyed by shape bucket.

A launch's many small kernels cost more in host launch overhead than on the GPU at short
lengths; replaying a captured graph costs one launch. Inputs are padded by the caller to a shape
bucket (`bucket`), copied into the graph's static input buffers, and the graph is replayed; the
least recently used graph is dropped once `capacity` graphs are held (each pins its memory pool).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch


def bucket(n: int, smallest: int = 16) -> int:
    """The smallest power-of-two multiple of `smallest` that holds n."""
    size = smallest
    while size < n:
        size *= 2
    return size


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

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def _capture(self, fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> _Entry:
        static = {name: t.clone() for name, t in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(**static)  # warm-up outside capture: module loads, cuBLAS workspaces, allocator
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(**static)
        self.num_captures += 1
        return _Entry(graph, static, outputs)

    def run(self, key: Hashable, fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Any:
        """Replay the graph for key (capturing it first if needed) on these inputs, which must
        match the shapes/dtypes it was captured with. Returns the graph's static outputs: they are
        overwritten by the next replay of the same key, so copy what must outlive it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._capture(fn, inputs)
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
            for name, t in inputs.items():
                entry.inputs[name].copy_(t)
        entry.graph.replay()
        self.num_replays += 1
        return entry.outputs

    def clear(self) -> None:
        self._entries.clear()
