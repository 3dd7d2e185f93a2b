"""Prefix policies: which token tree a request runs, and what that saved.

| policy  | tree                                                                  |
|---------|-----------------------------------------------------------------------|
| off     | every candidate alone, whole prompt (identical candidates run twice)  |
| default | per question: common prefix of its candidates + each tail             |
| shared  | the compressed trie of the whole request, across questions            |
| fixed   | as shared, every shared boundary cut down to a multiple of 64 tokens  |
| auto    | shared if the cost model says it beats off, else default              |

Savings are counted from the executed tree, never from what could have been shared.
"""

from __future__ import annotations

from collections.abc import Sequence

from openjev.contract.literals import PREFIX_POLICIES, ExecutedPolicy, PrefixPolicy, PrefixScope
from openjev.worker.geometry import GDN_CHUNK_TOKENS
from openjev.worker.planner.cost import CostModel, off_seconds_at_least
from openjev.worker.planner.packing import split_into_segments
from openjev.worker.planner.passes import pack_passes
from openjev.worker.planner.plan import PackLimits, Plan, Reader
from openjev.worker.planner.tree import (
    Prompt,
    TreeNode,
    common_prefix_star,
    compressed_trie,
    singletons,
    token_array,
)


def plan_request(
    candidates: Sequence[Sequence[Sequence[int]]],
    policy: PrefixPolicy,
    limits: PackLimits = PackLimits(),
    cost_model: CostModel | None = None,
    max_pass_depth: int = 1 << 16,
) -> Plan:
    """Plan one request. candidates[q][c]: token ids of question q's candidate c (complete,
    chat-wrapped prompts, never empty). `auto` needs a cost model. max_pass_depth: tree levels
    the runner holds in one pass."""
    if policy not in PREFIX_POLICIES:
        raise ValueError(f"unknown prefix policy {policy!r}; expected one of {PREFIX_POLICIES}")
    if not candidates or any(len(q) == 0 for q in candidates):
        raise ValueError("every request needs at least one question with one candidate")
    for q, question in enumerate(candidates):
        for c, tokens in enumerate(question):
            if len(tokens) == 0:
                raise ValueError(f"question {q} candidate {c} has no tokens")
    # array('I') once here (the worker's are already): the tree builders work on them, and
    # `auto` builds two or three trees
    candidates = [[token_array(tokens) for tokens in q] for q in candidates]
    if policy != "auto":
        return _plan_tree(candidates, policy, policy, limits, max_pass_depth)
    if cost_model is None:
        raise ValueError("policy 'auto' needs a cost model")
    if len(candidates) == 1 and len(candidates[0]) == 1:
        # One prompt: the shared and the off tree are the same single node, so their costs tie
        # and auto runs `default`; planning it alone skips two plans (a noul request's case).
        return _plan_tree(candidates, "default", "auto", limits, max_pass_depth)
    shared = _plan_tree(candidates, "shared", "auto", limits, max_pass_depth)
    shared_seconds = cost_model.estimated_seconds(shared)
    lengths = [len(tokens) for q in candidates for tokens in q]
    # off is planned only where a bound of its cost does not already lose to shared
    if shared_seconds < off_seconds_at_least(cost_model, lengths, limits):
        return shared
    off = _plan_tree(candidates, "off", "auto", limits, max_pass_depth)
    if shared_seconds < cost_model.estimated_seconds(off):
        return shared
    return _plan_tree(candidates, "default", "auto", limits, max_pass_depth)


def build_tree(candidates: Sequence[Sequence[Sequence[int]]], policy: ExecutedPolicy) -> list[TreeNode]:
    """The token tree one concrete policy (not auto) runs."""
    prompts: list[Prompt] = [
        (Reader(q, c), tokens) for q, question in enumerate(candidates) for c, tokens in enumerate(question)
    ]
    if policy == "off":
        return singletons(prompts)
    if policy == "shared":
        return compressed_trie(prompts)
    if policy == "fixed":
        return compressed_trie(prompts, block_tokens=GDN_CHUNK_TOKENS)
    if policy == "default":
        nodes: list[TreeNode] = []
        start = 0
        for question in candidates:
            offset = len(nodes)
            for node in common_prefix_star(prompts[start : start + len(question)]):
                parent = None if node.parent is None else node.parent + offset
                nodes.append(TreeNode(parent, node.start_position, node.token_ids, node.readers))
            start += len(question)
        return nodes
    raise ValueError(f"no tree for policy {policy!r}")


def _plan_tree(
    candidates: Sequence[Sequence[Sequence[int]]],
    executed_policy: ExecutedPolicy,
    policy: PrefixPolicy,
    limits: PackLimits,
    max_pass_depth: int,
) -> Plan:
    segments = split_into_segments(build_tree(candidates, executed_policy), limits.chunk_tokens)
    launches = pack_passes(segments, limits, max_pass_depth)

    # Per segment: how many candidates read at or below it, and the lowest and highest question
    # among them (children come after parents, so one backward walk fills them).
    num_readers = [len(s.readers) for s in segments]
    lowest = [min((r.question for r in s.readers), default=len(candidates)) for s in segments]
    highest = [max((r.question for r in s.readers), default=-1) for s in segments]
    for s in reversed(segments):
        if s.parent is not None:
            num_readers[s.parent] += num_readers[s.index]
            lowest[s.parent] = min(lowest[s.parent], lowest[s.index])
            highest[s.parent] = max(highest[s.parent], highest[s.index])

    num_saved_tokens = sum((g - 1) * s.num_tokens for s, g in zip(segments, num_readers, strict=True))
    num_computed_tokens = sum(s.num_tokens for s in segments)
    num_submitted_tokens = sum(len(tokens) for q in candidates for tokens in q)
    assert num_submitted_tokens == num_computed_tokens + num_saved_tokens, "tree lost tokens"

    shared_across = any(lo < hi for lo, hi in zip(lowest, highest, strict=True))
    scope: PrefixScope
    if shared_across:
        scope = "across_questions"
    elif num_saved_tokens > 0:
        scope = "within_question"
    else:
        scope = "none"
    return Plan(
        segments=tuple(segments),
        launches=tuple(launches),
        policy=policy,
        executed_policy=executed_policy,
        num_submitted_tokens=num_submitted_tokens,
        num_computed_tokens=num_computed_tokens,
        num_saved_tokens=num_saved_tokens,
        scope=scope,
        num_questions=len(candidates),
        num_candidates_per_question=tuple(len(q) for q in candidates),
    )
