"""The plain PyTorch ops against their plainest statements (fresh random inputs per check)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openjev.worker.model import ops


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any() and not torch.isnan(want).any()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def delta_rule_inputs(seq_len: int, num_heads: int = 3, key_dim: int = 16, value_dim: int = 8):
    q = ops.l2_normalize(torch.randn(seq_len, num_heads, key_dim)) * key_dim**-0.5
    k = ops.l2_normalize(torch.randn(seq_len, num_heads, key_dim))
    v = torch.randn(seq_len, num_heads, value_dim)
    # A spread of decays from strong to almost none, as real A_log/dt_bias give.
    g = -F.softplus(torch.randn(seq_len, num_heads) * 2 - 2)
    beta = torch.sigmoid(torch.randn(seq_len, num_heads))
    return q, k, v, g, beta


@pytest.mark.parametrize("seq_len", [1, 5, 64, 100, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_delta_rule_matches_recurrent(seq_len, with_state):
    q, k, v, g, beta = delta_rule_inputs(seq_len)
    state = torch.randn(3, 16, 8) if with_state else None
    out_rec, s_rec = ops.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    out, s = ops.gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (seq_len, 3, 8) and s.shape == (3, 16, 8) and s.dtype == torch.float32
    assert rel_err(out, out_rec) < 1e-5
    assert rel_err(s, s_rec) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_delta_rule_split_carries_state(chunk_size):
    """Running a prefix then the rest from its final state equals running it whole, whatever the
    split point (not a chunk multiple) and chunk size."""
    q, k, v, g, beta = delta_rule_inputs(90)
    whole, s_whole = ops.gated_delta_rule(q, k, v, g, beta, None, chunk_size=chunk_size)
    first, s_first = ops.gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], None, chunk_size)
    rest, s_rest = ops.gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:], s_first, chunk_size)
    assert rel_err(torch.cat([first, rest]), whole) < 1e-5
    assert rel_err(s_rest, s_whole) < 1e-5


def test_recurrent_delta_rule_is_the_stated_update():
    """One token from a known state: S' = e^g S + k (beta (v - e^g S^T k))^T and o = S'^T q."""
    q, k, v, g, beta = delta_rule_inputs(1, num_heads=1)
    s0 = torch.randn(1, 16, 8)
    decayed = g[0, 0].exp() * s0[0]
    want_s = decayed + torch.outer(k[0, 0], beta[0, 0] * (v[0, 0] - decayed.T @ k[0, 0]))
    out, s = ops.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    assert rel_err(s[0], want_s) < 1e-6
    assert rel_err(out[0, 0], want_s.T @ q[0, 0]) < 1e-6


@pytest.mark.parametrize("split", [1, 2, 3, 9])
def test_causal_conv_with_window_equals_conv_of_concatenation(split):
    channels, taps = 12, 4
    x = torch.randn(20, channels)
    weight = torch.randn(channels, taps)
    # The plainest statement: torch's depthwise conv1d over the zero-padded whole sequence.
    want = F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=taps - 1, groups=channels)[0, :, :20].T)
    first, window = ops.causal_conv1d(x[:split], weight, None)
    rest, last_window = ops.causal_conv1d(x[split:], weight, window)
    assert window.shape == (taps - 1, channels)
    assert rel_err(torch.cat([first, rest]), want) < 1e-6
    assert torch.equal(last_window, x[-(taps - 1) :])


def full_causal_attention(q, k, v):
    """SDPA over the whole sequence with GQA expanded by hand: the reference rows."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("q_offset", [0, 1, 17])
@pytest.mark.parametrize("block_rows", [512, 5])
def test_attention_with_offset_matches_full_causal_rows(q_offset, block_rows):
    total, head_dim = 30, 16
    q = torch.randn(total, 4, head_dim)
    k, v = torch.randn(total, 2, head_dim), torch.randn(total, 2, head_dim)
    want = full_causal_attention(q, k, v)[q_offset:]
    got = ops.attention(q[q_offset:], k, v, q_offset=q_offset, block_rows=block_rows)
    assert rel_err(got, want) < 1e-5


def test_rms_norm_applies_one_plus_weight():
    x, w = torch.randn(5, 32), torch.randn(32)
    want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w)
    assert rel_err(ops.rms_norm(x, w, 1e-6), want) < 1e-6


def test_gated_rms_norm_applies_weight_and_silu_gate():
    x, gate, w = torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(16)
    want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w * F.silu(gate)
    assert rel_err(ops.gated_rms_norm(x, gate, w, 1e-6), want) < 1e-6


def test_rotary_rotates_first_dims_by_position_angle():
    x = torch.randn(6, 2, 16)
    positions = torch.tensor([0, 1, 2, 50, 1000, 16383])
    got = ops.apply_rotary(x, positions, rotary_dim=8, theta=1e7)
    assert torch.equal(got[..., 8:], x[..., 8:])
    assert torch.allclose(got[0], x[0])  # position 0 is the identity
    # Pair (i, i + 4) is rotated by angle pos * theta^(-2i/8).
    for i in range(4):
        angle = positions.double() * 1e7 ** (-2 * i / 8)
        c, s = angle.cos()[:, None].float(), angle.sin()[:, None].float()
        a, b = x[..., i], x[..., i + 4]
        assert torch.allclose(got[..., i], a * c - b * s, atol=1e-2)  # fp32 angles, as transformers builds them
        assert torch.allclose(got[..., i + 4], b * c + a * s, atol=1e-2)  # fp32 angles, as transformers builds them
    # Rotation keeps each pair's norm (no scaling).
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_head_score_accumulates_in_fp64_rounds_to_fp32():
    hidden, weight = torch.randn(128), torch.randn(128)
    bias = 0.375
    want = float(
        torch.tensor(sum(float(a) * float(b) for a, b in zip(hidden, weight, strict=True)), dtype=torch.float32)
        + torch.tensor(bias, dtype=torch.float32)
    )
    got = ops.head_score(hidden, weight, bias)
    assert got == want
    assert got == float(torch.tensor(got, dtype=torch.float32))  # an fp32 value
