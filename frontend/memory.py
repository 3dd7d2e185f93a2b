"""Freed memory goes back to the operating system.

A request body of megabytes passes through several buffers of its size (gRPC's, the message's,
the decoded text, the copy sent to a parse child), each freed within milliseconds. glibc serves
such blocks from mmap only up to a threshold that it raises as blocks are freed, so after the
first few large bodies they came from the per-thread heaps, which keep what is freed: a soak's
frontend (4 MiB bodies among 12 clients, 65 threads) held 140-180 MiB more for tens of seconds
while Python's own objects stayed at 20-36 MiB. A fixed threshold keeps them on mmap.

Building the tokenizer (`tokenizers` parses Qwen's 13 MiB tokenizer.json into a document it
then frees, in small blocks) left ~90 MiB free in the heap, which glibc kept (~200 MiB while the
demo's file wrote its merges as [left, right] pairs): a process that built it sat at ~226 MiB,
~139 after the trim, and a started frontend is at ~145 before its first request. `trim_heap`
hands such pages back once, after start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it turns off the moving threshold
LARGE_BLOCK_BYTES = 1 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (find_library runs ldconfig in a subprocess)."""
    library = ctypes.util.find_library("c")
    try:
        return None if library is None else ctypes.CDLL(library)
    except OSError:
        return None


def _libc_function(name: str):
    """glibc's `name`, or None where the C library has none (musl and others)."""
    return getattr(_libc(), name, None)


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Blocks of `threshold` bytes and more mmap'd, each returned when freed. False where the C
    library is not glibc (nothing changed)."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))


def trim_heap() -> bool:
    """Every arena's free pages returned to the system (glibc's malloc_trim). False where the C
    library has none, or nothing was returned."""
    malloc_trim = _libc_function("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))
