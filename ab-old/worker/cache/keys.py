"""Exact keys of cached states, and where a segment may be cut without changing a single bit.

A state at position p (the end of a segment) is a function of the tokens before p and of how
the runner cut that prefix into segments, where a cut changes rounding:

- The CUDA runner is exact under any cut (token-serial GDN or chunks at absolute positions with
  a tail; attention tiles aligned to the sequence start; every policy is bit-identical to `off`):
  a state is a function of its tokens alone.
- The PyTorch reference runs the GDN chunks and the attention query blocks (64 rows each) from
  each segment's start. A cut at a multiple of 64 tokens from the start of the run it falls in
  keeps every chunk and block where it was, so it is exact; a segment that starts elsewhere (a
  branch point off that grid) starts a new grid, its *anchor*. A state is then a function of
  its tokens and of the anchors below it.

So a key is (model fingerprint, anchors, position, sha256 of the tokens before it); the store
also keeps the tokens themselves and compares them on every hit, so a hash collision can never
hand out a wrong state.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openjev.worker.geometry import GDN_CHUNK_TOKENS

GRID_TOKENS = GDN_CHUNK_TOKENS
Hasher = Any  # a hashlib sha256 object (hashlib's own type is private)


@dataclass(frozen=True)
class CutRule:
    """anywhere: every cut is exact (CUDA runner); else cuts are exact at multiples of `grid`
    tokens from the last anchor (PyTorch reference). Lookups and deposits use the grid on both."""

    anywhere: bool
    grid: int = GRID_TOKENS

    def neutral(self, position: int, anchor: int) -> bool:
        """Whether a segment boundary at `position` leaves the computation of the run that began
        at `anchor` unchanged."""
        return self.anywhere or (position - anchor) % self.grid == 0

    def grid_points(self, lo: int, hi: int, anchor: int) -> list[int]:
        """Positions strictly inside (lo, hi) where a cut is exact and lookups happen."""
        base = 0 if self.anywhere else anchor
        first = base + ((lo - base) // self.grid + 1) * self.grid
        return list(range(first, hi, self.grid))

    def floor(self, position: int, anchor: int) -> int:
        """The last grid point at or before `position`."""
        base = 0 if self.anywhere else anchor
        return base + (position - base) // self.grid * self.grid


@dataclass(frozen=True)
class NodeKey:
    fingerprint: str
    anchors: tuple[int, ...]
    position: int
    digest: bytes


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 (what the digest and the exact comparison read)."""
    return array("i", tokens).tobytes()


def advance(
    hasher: Hasher, start: int, tokens: Sequence[int], positions: Sequence[int]
) -> tuple[dict[int, bytes], Hasher]:
    """sha256 digests of the prefix up to each position (ascending, in (start, start + len]) and
    the hasher at the segment's end, continuing from `hasher` (the tokens before `start`; not
    modified)."""
    hasher = hasher.copy()
    out: dict[int, bytes] = {}
    at = start
    for position in positions:
        hasher.update(token_bytes(tokens[at - start : position - start]))
        at = position
        out[position] = hasher.copy().digest()
    hasher.update(token_bytes(tokens[at - start :]))
    return out, hasher
