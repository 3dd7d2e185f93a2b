"""Large blocks go back to the operating system when freed.

A request body of megabytes passes through several buffers of its size (gRPC's, the message's,
the decoded text, the copy sent to a parse child), each freed within milliseconds. glibc serves
such blocks from mmap only up to a threshold that it raises as blocks are freed, so after the
first few large bodies they came from the per-thread heaps, which keep what is freed: a soak's
frontend (4 MiB bodies among 12 clients, 65 threads) held 140-180 MiB more for tens of seconds
while Python's own objects stayed at 20-36 MiB. A fixed threshold keeps them on mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it turns off the moving threshold
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Blocks of `threshold` bytes and more mmap'd, each returned when freed. False where the C
    library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
