"""The Gated DeltaNet (linear attention) mixer over a launch's packed rows.

Dense projections run once over all rows; the conv and the delta rule run per segment, each
continuing from its parent's GdnState.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import GdnWeights
from openjev.worker.model import ops
from openjev.worker.model.state import GdnState


def decay_and_beta(a: Tensor, b: Tensor, w: GdnWeights) -> tuple[Tensor, Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0) and beta = sigmoid(b).
    a, b: [T, Hv]. Returns (g [T, Hv] fp32, beta [T, Hv] in b.dtype)."""
    g = -w.a_log.exp() * F.softplus(a.float() + w.dt_bias)
    return g, torch.sigmoid(b)


def split_qkv(mixed: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [T, C] -> delta-rule inputs q, k [T, Hv, Dk] fp32 (L2-normalized, q scaled by
    Dk^-0.5, key heads repeated to the value heads) and v [T, Hv, Dv]."""
    seq_len = mixed.shape[0]
    key_dim = config.linear_key_dim
    q, k, v = torch.split(mixed, [key_dim, key_dim, config.linear_value_dim], dim=-1)
    q = ops.l2_normalize(q.reshape(seq_len, config.linear_num_key_heads, -1).float())
    k = ops.l2_normalize(k.reshape(seq_len, config.linear_num_key_heads, -1).float())
    q = q * config.linear_key_head_dim**-0.5
    # Value head h reads key head h // ratio (transformers' repeat_interleave).
    ratio = config.linear_num_value_heads // config.linear_num_key_heads
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q, k, v.reshape(seq_len, config.linear_num_value_heads, config.linear_value_head_dim)


def gdn_mixer(
    w: GdnWeights,
    config: ModelConfig,
    h: Tensor,
    spans: Sequence[tuple[int, int]],
    parent_states: Sequence[GdnState | int | None],
) -> tuple[Tensor, list[GdnState]]:
    """h: [T_total, D] normed hidden rows of all segments; spans: each segment's [start, end) rows;
    parent_states: each segment's starting state, or the index of an earlier segment of this
        launch whose final state it continues from (None: start of prompt).
    Returns (mixer output [T_total, D], each segment's final GdnState)."""
    mixed_qkv = h @ w.in_proj_qkv.T  # [T, C], the conv input (and so the conv window)
    z = (h @ w.in_proj_z.T).unflatten(-1, (config.linear_num_value_heads, config.linear_value_head_dim))
    g, beta = decay_and_beta(h @ w.in_proj_a.T, h @ w.in_proj_b.T, w)

    core = h.new_empty(h.shape[0], config.linear_num_value_heads, config.linear_value_head_dim)
    states: list[GdnState] = []
    for (start, end), source in zip(spans, parent_states, strict=True):
        parent = states[source] if isinstance(source, int) else source
        conv_out, window = ops.causal_conv1d(
            mixed_qkv[start:end], w.conv_weight, None if parent is None else parent.conv_window
        )
        q, k, v = split_qkv(conv_out, config)
        core[start:end], recurrent = ops.gated_delta_rule(
            q, k, v, g[start:end], beta[start:end], None if parent is None else parent.recurrent
        )
        states.append(GdnState(conv_window=window, recurrent=recurrent))

    normed = ops.gated_rms_norm(core, z, w.norm_weight, config.rms_norm_eps)
    return normed.flatten(1) @ w.out_proj.T, states
