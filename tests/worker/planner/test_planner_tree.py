"""Tree shapes from the three builders, checked node by node."""

from array import array

from openjev.worker.planner.plan import Reader
from openjev.worker.planner.tree import (
    TreeNode,
    common_prefix_length,
    common_prefix_star,
    compressed_trie,
    singletons,
)


def R(q, c):
    return Reader(q, c)


def ids(*tokens):
    return array("I", tokens)


def test_common_prefix_length():
    assert common_prefix_length((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_length((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix_length((), (1,)) == 0
    assert common_prefix_length((5,), (6,)) == 0
    long = tuple(range(5000))
    assert common_prefix_length(long, long[:3001] + (-1,)) == 3001
    assert common_prefix_length(long, long) == 5000


def test_singletons_keep_identical_prompts_apart():
    nodes = singletons([(R(0, 0), [1, 2]), (R(0, 1), [1, 2])])
    assert nodes == [TreeNode(None, 0, ids(1, 2), (R(0, 0),)), TreeNode(None, 0, ids(1, 2), (R(0, 1),))]


def test_star_shares_only_the_common_prefix():
    nodes = common_prefix_star(
        [(R(0, 0), [1, 2, 3, 7]), (R(0, 1), [1, 2, 3, 7]), (R(0, 2), [1, 2, 9]), (R(0, 3), [1, 2])]
    )
    assert nodes == [
        TreeNode(None, 0, ids(1, 2), (R(0, 3),)),  # candidate 3 is the common prefix: reads the root
        TreeNode(0, 2, ids(3, 7), (R(0, 0),)),  # identical tails are not merged under default
        TreeNode(0, 2, ids(3, 7), (R(0, 1),)),
        TreeNode(
            0,
            2,
            ids(
                9,
            ),
            (R(0, 2),),
        ),
    ]


def test_star_without_common_prefix_is_singletons():
    prompts = [(R(0, 0), [1, 2]), (R(0, 1), [3, 2])]
    assert common_prefix_star(prompts) == singletons(prompts)


def test_trie_merges_identical_prompts_and_prefix_readers():
    nodes = compressed_trie(
        [
            (R(0, 0), [1, 2, 3, 4, 5]),
            (R(1, 0), [1, 2, 3]),  # a prefix of the others: reads the internal node
            (R(0, 1), [1, 2, 3, 4, 5]),  # identical to (0, 0)
            (R(1, 1), [1, 2, 3, 6]),
            (R(2, 0), [8, 9]),  # nothing in common: its own root
        ]
    )
    assert nodes == [
        TreeNode(None, 0, ids(1, 2, 3), (R(1, 0),)),
        TreeNode(0, 3, ids(4, 5), (R(0, 0), R(0, 1))),
        TreeNode(
            0,
            3,
            ids(
                6,
            ),
            (R(1, 1),),
        ),
        TreeNode(None, 0, ids(8, 9), (R(2, 0),)),
    ]


def test_trie_blocks_cut_boundaries_down_to_block_multiples():
    # Boundaries at 5 (branch) and 3 (a reader) cut down to 4 and 0 with 4-token blocks.
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 4, 5, 9]
    c = [1, 2, 3]
    nodes = compressed_trie([(R(0, 0), a), (R(0, 1), b), (R(0, 2), c)], block_tokens=4)
    assert nodes == [
        TreeNode(None, 0, ids(1, 2, 3), (R(0, 2),)),  # its last block is partial: never shared
        TreeNode(None, 0, ids(1, 2, 3, 4), ()),
        TreeNode(1, 4, ids(5, 6, 7), (R(0, 0),)),
        TreeNode(1, 4, ids(5, 9), (R(0, 1),)),
    ]
    for node in nodes:
        if any(n.parent is not None and nodes[n.parent] is node for n in nodes):
            assert (node.start_position + len(node.token_ids)) % 4 == 0


def test_trie_parents_come_first():
    prompts = [(R(0, i), [0, i % 3, i % 5, i]) for i in range(30)]
    nodes = compressed_trie(prompts)
    for index, node in enumerate(nodes):
        if node.parent is not None:
            assert node.parent < index
            parent = nodes[node.parent]
            assert node.start_position == parent.start_position + len(parent.token_ids)
    assert sorted(r for n in nodes for r in n.readers) == [R(0, i) for i in range(30)]


def test_trie_under_a_long_shared_context_is_the_trie_of_the_tails_below_it():
    """Eight candidates after a 3,000-token context (how a long state reaches the planner): the
    root is the context, and below it the trie of the tails, node for node."""
    context = list(range(1000, 4000))
    tails = [[7, 1, i % 2, i] for i in range(6)] + [[7, 2], [7]]
    readers = [R(0, i) for i in range(len(tails))]
    nodes = compressed_trie([(r, context + t) for r, t in zip(readers, tails, strict=True)])
    below = compressed_trie(list(zip(readers, tails, strict=True)))
    assert nodes[0] == TreeNode(None, 0, array("I", context) + below[0].token_ids, below[0].readers)
    shifted = [TreeNode(n.parent, n.start_position + len(context), n.token_ids, n.readers) for n in below[1:]]
    assert nodes[1:] == shifted
