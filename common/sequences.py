"""How far two sequences (token ids, strings) agree from their start."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences. A binary search on C-speed slice
    comparisons, each element compared about twice: long shared contexts (thousands of tokens,
    a state of megabytes) would make a Python step per element the caller's dominant cost."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo], and the shared start is at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
