"""Token trees: which runs of tokens several candidate prompts have in common.

A tree is a list of `TreeNode`s, parents before children. A node's tokens follow its parent's
(start_position = parent's end); its readers are the prompts that end exactly at its last token.
No node is empty: a prompt that ends where its parent ends reads the parent instead.

Token ids are array('I') throughout (4 bytes an id; slices and comparisons at C speed, a memcmp
for equality): as tuples of Python ints a request of 4 Mi tokens took ~150 MiB more while it was
planned, and making them took 25 ns a token.

Three shapes serve the policies:
- `singletons`: every prompt alone (off).
- `common_prefix_star`: one node for the common prefix of a group, one per nonempty tail (default).
- `compressed_trie`: the whole compressed trie (shared); with block_tokens=64 branching may only
  happen on 64-token boundaries from the prompt start (fixed).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from openjev.sequences import common_prefix_length
from openjev.worker.planner.plan import Reader

Prompt = tuple[Reader, Sequence[int]]
LONG_CONTEXT_TOKENS = 256  # compressed_trie: prompts at least this long are sorted past their shared context


@dataclass(frozen=True)
class TreeNode:
    parent: int | None
    start_position: int
    token_ids: array  # array('I')
    readers: tuple[Reader, ...]


def token_array(tokens: Sequence[int]) -> array:
    """The ids as array('I'), the same object where they are one already (the worker's are)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)


def singletons(prompts: Sequence[Prompt]) -> list[TreeNode]:
    return [TreeNode(None, 0, token_array(tokens), (reader,)) for reader, tokens in prompts]


def common_prefix_star(prompts: Sequence[Prompt]) -> list[TreeNode]:
    """One group's common prefix as a root, every nonempty tail as its child.

    Identical tails are not merged: that is the trie's job, and `default` promises only the
    common prefix.
    """
    if len(prompts) < 2:
        return singletons(prompts)
    sequences = [token_array(tokens) for _, tokens in prompts]
    shared = min(len(s) for s in sequences)
    for s in sequences[1:]:
        shared = min(shared, common_prefix_length(sequences[0], s))
    if shared == 0:
        return singletons(prompts)
    root_readers = tuple(sorted(r for (r, _), s in zip(prompts, sequences, strict=True) if len(s) == shared))
    nodes = [TreeNode(None, 0, sequences[0][:shared], root_readers)]
    for (reader, _), s in zip(prompts, sequences, strict=True):
        if len(s) > shared:
            nodes.append(TreeNode(0, shared, s[shared:], (reader,)))
    return nodes


def compressed_trie(prompts: Sequence[Prompt], block_tokens: int = 1) -> list[TreeNode]:
    """The compressed trie of all prompts; nodes may only start on block boundaries.

    Prompts are cut into keys of `block_tokens` tokens (the last one may be shorter) and the
    trie is built over keys, so two prompts share a block only if all of its tokens agree:
    that is exactly "every shared boundary cut down to a multiple of block_tokens".
    Built from the sorted key sequences: in a sorted range the common prefix of all is the common
    prefix of its first and last, and prompts that end inside a range sort first.
    """
    if block_tokens < 1:
        raise ValueError("block_tokens must be positive")

    def keys_of(tokens: Sequence[int]):
        t = token_array(tokens)
        if block_tokens == 1:
            return t
        return tuple(t[i : i + block_tokens] for i in range(0, len(t), block_tokens))

    items = [(keys_of(tokens), reader) for reader, tokens in prompts]
    # Prompts that share a long context (a state of thousands of tokens) are sorted by what
    # follows it: the same order as by whole keys, without every comparison walking the context
    # element by element (8 such prompts of 4,736 tokens: 1.7-2.3 ms to plan, now 0.9-1.4).
    shared = 0
    if len(items) > 1 and min(len(k) for k, _ in items) * block_tokens >= LONG_CONTEXT_TOKENS:
        shared = min(common_prefix_length(items[0][0], k) for k, _ in items[1:])
    if shared:
        items.sort(key=lambda item: (item[0][shared:], item[1]))
    else:
        items.sort()
    keys = [k for k, _ in items]
    nodes: list[TreeNode] = []
    # (lo, hi, key depth, parent node index): keys[lo:hi] agree on their first depth+1 keys.
    stack: list[tuple[int, int, int, int | None]] = [
        (lo, hi, 0, None) for lo, hi in reversed(_groups(keys, 0, 0, len(keys)))
    ]
    while stack:
        lo, hi, depth, parent = stack.pop()
        end = depth + common_prefix_length(keys[lo][depth:], keys[hi - 1][depth:])
        first = lo
        while first < hi and len(keys[first]) == end:
            first += 1
        node_keys = keys[lo][depth:end]
        tokens = node_keys if block_tokens == 1 else _joined(node_keys)
        start_position = depth * block_tokens  # only a prompt's last key can be short
        readers = tuple(sorted(reader for _, reader in items[lo:first]))
        nodes.append(TreeNode(parent, start_position, tokens, readers))
        me = len(nodes) - 1
        for glo, ghi in reversed(_groups(keys, end, first, hi)):
            stack.append((glo, ghi, end, me))
    return nodes


def _joined(blocks: Sequence[array]) -> array:
    out = array("I")
    for block in blocks:
        out.extend(block)
    return out


def _groups(keys: list, depth: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Split sorted keys[lo:hi] (all longer than depth) into runs with equal key at depth."""
    groups = []
    start = lo
    for i in range(lo + 1, hi + 1):
        if i == hi or keys[i][depth] != keys[start][depth]:
            groups.append((start, i))
            start = i
    return groups
