"""The batched delta rule of a pass (delta_batches.py): each segment's outputs and final state are
the same bits whatever else shares its batches, and agree with ops.gated_delta_rule run on the
segment alone from its parent's state (fresh random inputs per check)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from openjev.worker.model import ops
from openjev.worker.model.delta_batches import delta_plan, delta_rule_segments

HEADS, KEY_DIM, VALUE_DIM = 4, 32, 32


def inputs(num_rows: int):
    q = ops.l2_normalize(torch.randn(num_rows, HEADS, KEY_DIM)) * KEY_DIM**-0.5
    k = ops.l2_normalize(torch.randn(num_rows, HEADS, KEY_DIM))
    v = torch.randn(num_rows, HEADS, VALUE_DIM)
    g = -F.softplus(torch.randn(num_rows, HEADS) * 2 - 2)
    beta = torch.sigmoid(torch.randn(num_rows, HEADS))
    return q, k, v, g, beta


def run(tensors, spans, sources):
    num_rows = tensors[0].shape[0]
    return delta_rule_segments(*tensors, delta_plan(spans, sources, HEADS, num_rows), sources)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_segments_are_bit_identical_alone_and_batched(seed):
    """A forest of segments (roots and in-pass children, lengths across the chunk and padding
    boundaries) against each root-to-leaf chain run as a pass of its own."""
    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 8, 9, 22, 41, 63, 64, 65, 130]) for _ in range(9)]
    sources = [None if i < 3 or rng.random() < 0.3 else rng.randrange(i) for i in range(len(lengths))]
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    tensors = inputs(start + 5)  # 5 pad rows in no segment
    out, finals = run(tensors, spans, sources)
    assert out[start:].abs().max() == 0
    for index in range(len(spans)):
        chain = [index]
        while sources[chain[0]] is not None:
            chain.insert(0, sources[chain[0]])
        rows = torch.cat([torch.arange(*spans[i]) for i in chain])
        chain_spans, at = [], 0
        for i in chain:
            chain_spans.append((at, at + spans[i][1] - spans[i][0]))
            at = chain_spans[-1][1]
        alone_out, alone_finals = run([t[rows] for t in tensors], chain_spans, [None, *range(len(chain) - 1)])
        assert torch.equal(alone_out[chain_spans[-1][0] :], out[slice(*spans[index])])
        assert torch.equal(alone_finals[-1], finals[index])
        # and the unbatched reference, from the parent's final state
        parent = sources[index]
        ref_out, ref_state = ops.gated_delta_rule(
            *(t[slice(*spans[index])] for t in tensors), None if parent is None else finals[parent]
        )
        assert (ref_out - out[slice(*spans[index])]).abs().max() < 1e-5
        assert (ref_state - finals[index]).abs().max() < 1e-5
