"""Cutting a token tree into segments.

A node longer than the chunk length becomes a chain of pieces, each the child of the previous
one: that is how a long prompt runs in chunks that carry their state from pass to pass. Pieces
are chunk_tokens long from the node's start (a multiple of 64 under the default limits, so
`fixed` stays aligned). Which segments share a pass is passes.py's business.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from openjev.worker.planner.plan import Segment
from openjev.worker.planner.tree import TreeNode


def split_into_segments(nodes: Sequence[TreeNode], chunk_tokens: int) -> list[Segment]:
    """Segments in tree order (parents first); only a node's last piece keeps its readers."""
    parents: list[int | None] = []
    pieces: list[tuple[array, int, tuple]] = []  # (tokens, start_position, readers)
    last_piece_of_node: list[int] = []
    for node in nodes:
        if not node.token_ids:
            raise ValueError("tree nodes must not be empty")
        parent = None if node.parent is None else last_piece_of_node[node.parent]
        for offset in range(0, len(node.token_ids), chunk_tokens):
            # a node that fits one chunk is its segment's tokens as they are, not a copy
            whole = offset == 0 and len(node.token_ids) <= chunk_tokens
            tokens = node.token_ids if whole else node.token_ids[offset : offset + chunk_tokens]
            is_last = offset + chunk_tokens >= len(node.token_ids)
            pieces.append((tokens, node.start_position + offset, node.readers if is_last else ()))
            parents.append(parent)
            parent = len(pieces) - 1
        last_piece_of_node.append(len(pieces) - 1)
    has_child = [False] * len(pieces)
    for parent in parents:
        if parent is not None:
            has_child[parent] = True
    # array('I') (the tree's slices): a planned request holds its segments until it ends, and as
    # tuples of Python ints (36 bytes an id) the 4,194,304 ids the worker admits took 145 MiB
    # under `off`, not 16 MiB
    return [
        Segment(i, parents[i], tokens, start, readers, has_child[i])
        for i, (tokens, start, readers) in enumerate(pieces)
    ]
