"""Packing: cut a token tree into segments that fit a launch, and group them into launches.

A node longer than max_tokens becomes a chain of pieces, each the child of the previous one:
that is how a long prompt runs in chunks that carry their state. Pieces are max_tokens long
from the node's start (a multiple of 64 under the default limits, so `fixed` stays aligned).

Launches are filled first-fit-decreasing, one tree depth at a time: every piece goes into the
first launch after its parent's launch that still has room. Each launch is one forward pass and
so one read of the weights, which is what dominates short requests on a GPU; fewer launches is
the aim, ties broken towards the earliest launch so states are freed early.
"""

from __future__ import annotations

from collections.abc import Sequence

from openjev.worker.planner.plan import PackLimits, Segment
from openjev.worker.planner.tree import TreeNode


def split_into_segments(nodes: Sequence[TreeNode], max_tokens: int) -> list[Segment]:
    """Segments in tree order (parents first); only a node's last piece keeps its readers."""
    parents: list[int | None] = []
    pieces: list[tuple[tuple[int, ...], int, tuple]] = []  # (tokens, start_position, readers)
    last_piece_of_node: list[int] = []
    for node in nodes:
        if not node.token_ids:
            raise ValueError("tree nodes must not be empty")
        parent = None if node.parent is None else last_piece_of_node[node.parent]
        for offset in range(0, len(node.token_ids), max_tokens):
            tokens = node.token_ids[offset : offset + max_tokens]
            is_last = offset + max_tokens >= len(node.token_ids)
            pieces.append((tokens, node.start_position + offset, node.readers if is_last else ()))
            parents.append(parent)
            parent = len(pieces) - 1
        last_piece_of_node.append(len(pieces) - 1)
    has_child = [False] * len(pieces)
    for parent in parents:
        if parent is not None:
            has_child[parent] = True
    return [
        Segment(i, parents[i], tokens, start, readers, has_child[i])
        for i, (tokens, start, readers) in enumerate(pieces)
    ]


def pack_launches(segments: Sequence[Segment], limits: PackLimits) -> list[tuple[int, ...]]:
    """Group segments (parents listed before children) into launches within `limits`."""
    depth = [0] * len(segments)
    for s in segments:
        if s.num_tokens > limits.max_tokens:
            raise ValueError(f"segment {s.index} has {s.num_tokens} tokens > {limits.max_tokens}")
        if s.parent is not None:
            if s.parent >= s.index:
                raise ValueError("segments must list parents before children")
            depth[s.index] = depth[s.parent] + 1
    order = sorted(range(len(segments)), key=lambda i: (depth[i], -segments[i].num_tokens, i))
    smallest = min((s.num_tokens for s in segments), default=1)

    launch_of = [0] * len(segments)
    members: list[list[int]] = []
    num_tokens: list[int] = []
    # Launches that may still take a segment; a full one leaves this list so that packing
    # tens of thousands of candidates stays linear-ish rather than rescanning every launch.
    open_launches: list[int] = []
    for i in order:
        seg = segments[i]
        earliest = 0 if seg.parent is None else launch_of[seg.parent] + 1
        chosen = None
        for launch in open_launches:
            if launch >= earliest and num_tokens[launch] + seg.num_tokens <= limits.max_tokens:
                chosen = launch
                break
        if chosen is None:
            members.append([])
            num_tokens.append(0)
            chosen = len(members) - 1
            open_launches.append(chosen)
        members[chosen].append(i)
        num_tokens[chosen] += seg.num_tokens
        launch_of[i] = chosen
        if len(members[chosen]) == limits.max_sequences or limits.max_tokens - num_tokens[chosen] < smallest:
            open_launches.remove(chosen)
    return [tuple(sorted(m)) for m in members]
