"""The chunked GDN reference's tail semantics on the CPU (the GPU kernel is tested against this
reference in test_kernels.py): a prompt run whole equals a parent plus a child that starts from
the parent's state at its last chunk boundary and its tail rows."""

from __future__ import annotations

import pytest
import torch

from openjev.worker.cuda import reference as ref
from openjev.worker.model import ops


def inputs(T, H=4, Hk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qn = torch.nn.functional.normalize(torch.randn(T, Hk, 128, generator=gen), dim=-1) * 128**-0.5
    kn = torch.nn.functional.normalize(torch.randn(T, Hk, 128, generator=gen), dim=-1)
    v = torch.randn(T, H, 128, generator=gen)
    g = -torch.rand(T, H, generator=gen) * 0.5 - 0.01
    beta = torch.rand(T, H, generator=gen)
    return qn, kn, v, g, beta


@pytest.mark.parametrize("split", [1, 37, 64, 100, 128])
def test_parent_and_child_equal_the_whole(split):
    T = 150
    qn, kn, v, g, beta = inputs(T)
    pos = torch.arange(T, dtype=torch.int32)
    whole_o, whole_f, whole_t = ref.gdn_chunked_packed(qn, kn, v, g, beta, torch.tensor([0, T]), pos)
    # the whole prompt against the plain token recurrence (repeated key heads)
    exp_o, _ = ops.gated_delta_rule_recurrent(qn.repeat_interleave(2, 1), kn.repeat_interleave(2, 1), v, g, beta, None)
    torch.testing.assert_close(whole_o, exp_o, rtol=1e-4, atol=1e-5)
    par = slice(0, split)
    _, par_f, par_t = ref.gdn_chunked_packed(
        qn[par], kn[par], v[par], g[par], beta[par], torch.tensor([0, split]), pos[par]
    )
    assert par_t[0].shape[0] == split % 64
    tail_in = torch.full((1, 64, par_t[0].shape[1]), float("nan"))  # rows past the tail are never read
    tail_in[0, : split % 64] = par_t[0]
    rest = slice(split, T)
    c_o, c_f, c_t = ref.gdn_chunked_packed(
        qn[rest], kn[rest], v[rest], g[rest], beta[rest], torch.tensor([0, T - split]), pos[rest], par_f, tail_in
    )
    torch.testing.assert_close(c_o, whole_o[split:], rtol=0, atol=0)
    torch.testing.assert_close(c_f, whole_f, rtol=0, atol=0)
    torch.testing.assert_close(c_t[0], whole_t[0], rtol=0, atol=0)


def test_tail_words_hold_the_reference_rows_exactly():
    """The kernels' tail rows (k, g, beta fp32; v as bf16 pairs, the first of a pair in a word's
    low half, as the kernels read them) give back the reference's rows bit for bit."""
    from openjev.worker.cuda import chunked_gdn as KC

    _, kn, v, g, beta = inputs(5, H=48, Hk=16)
    v = v.bfloat16().float()  # the kernels' v input is bf16
    words = KC.pack_tails(kn.flatten(1), v.flatten(1), g, beta)
    assert words.dtype == torch.float32 and words.shape == (5, KC.gdn_tail_width(16, 48)) == (5, 5216)
    rows = torch.cat([kn.flatten(1), v.flatten(1), g, beta], dim=1)  # the reference's layout
    assert torch.equal(KC.unpack_tails(words, 16, 48), rows)
    pair = words[0, 16 * 128].view(torch.int32).item() & 0xFFFFFFFF
    first, second = (x.item() & 0xFFFF for x in v[0, 0, :2].bfloat16().view(torch.int16))
    assert pair == first | second << 16
