"""The gated full-attention mixer over a launch's packed rows.

Projections, per-head norms and rotary run once over all rows; attention runs per segment over
its parent's keys/values followed by its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import AttentionWeights
from openjev.worker.model import ops
from openjev.worker.model.state import AttentionState


def split_query_gate(projected: Tensor, num_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """q_proj output [T, Hq*2*Dh] -> (query [T, Hq, Dh], gate [T, Hq, Dh]). Per head the first Dh
    outputs are the query and the next Dh the gate (not all queries then all gates)."""
    per_head = projected.unflatten(-1, (num_heads, 2 * head_dim))
    return per_head[..., :head_dim], per_head[..., head_dim:]


def attention_mixer(
    w: AttentionWeights,
    config: ModelConfig,
    h: Tensor,
    positions: Tensor,
    spans: Sequence[tuple[int, int]],
    parent_states: Sequence[AttentionState | int | None],
    query_rows: Sequence[int] | None = None,
    keep: Sequence[bool] | None = None,
) -> tuple[Tensor, list[AttentionState | None]]:
    """h: [T_total, D] normed hidden rows; positions: [T_total] int64 rotary positions;
    spans: each segment's [start, end) rows; parent_states: each segment's ancestors' keys/values,
    or the index of an earlier segment of this launch whose keys/values it continues; rows after
    the last span are padding (their output is zero). query_rows: only these rows' outputs are
    wanted, each the last row of its segment (the last layer's head rows): keys and values are
    still made for every row (the states), queries and outputs for these rows alone.
    Returns (mixer output [T_total, D], or [len(query_rows), D] in query_rows' order, and each
    segment's AttentionState covering all its positions; None for a segment that keep says is
    not kept and that no later segment of the launch continues: its keys are its ancestors' and
    its own, copied, and 255 candidates under a 16,000-token state grew the demo worker by 2.3 GB
    of such copies, 0.2 GB without them: benchmarks/wide_tree_memory_cpu.py)."""
    num_heads, num_kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    rows = list(query_rows) if query_rows is not None else None
    asking = h if rows is None else h[rows]
    query, gate = split_query_gate(asking @ w.q_proj.T, num_heads, head_dim)
    query = ops.rms_norm(query, w.q_norm, eps)
    keys = ops.rms_norm((h @ w.k_proj.T).unflatten(-1, (num_kv_heads, head_dim)), w.k_norm, eps)
    values = (h @ w.v_proj.T).unflatten(-1, (num_kv_heads, head_dim))
    # one table for keys and queries (a query row's entries are its row's: elementwise, no tail
    # since the runner's rows come in multiples of 16)
    cos, sin = ops.rotary_cos_sin(positions, config.rotary_dim, config.rope_theta)
    query = ops.rotate(query, cos, sin) if rows is None else ops.rotate(query, cos[rows], sin[rows])
    keys = ops.rotate(keys, cos, sin)

    out = torch.empty_like(query)
    if rows is None:
        out[spans[-1][1] if spans else 0 :] = 0  # pad rows after the last span: in no segment
    # query_rows: where each segment's last row sits among them (a row may be asked twice)
    asked: dict[int, list[int]] = {}
    for place, row in enumerate(rows or ()):
        asked.setdefault(row, []).append(place)
    continued = {source for source in parent_states if isinstance(source, int)}
    states: list[AttentionState | None] = []
    for index, ((start, end), source) in enumerate(zip(spans, parent_states, strict=True)):
        parent = states[source] if isinstance(source, int) else source
        assert parent is not None or source is None  # a continued segment's state is always made
        if parent is None:
            all_keys, all_values, num_before = keys[start:end], values[start:end], 0
        else:
            all_keys = torch.cat([parent.keys, keys[start:end]])
            all_values = torch.cat([parent.values, values[start:end]])
            num_before = parent.keys.shape[0]
        if rows is None:
            out[start:end] = ops.attention(query[start:end], all_keys, all_values, q_offset=num_before)
        elif end - 1 in asked:  # the segment's last query alone, over all its keys
            places = asked.pop(end - 1)
            last = ops.attention(query[places[0] : places[0] + 1], all_keys, all_values, q_offset=all_keys.shape[0] - 1)
            out[places] = last.expand(len(places), -1, -1)
        needed = keep is None or keep[index] or index in continued
        states.append(AttentionState(keys=all_keys, values=all_values) if needed else None)

    if asked:
        raise ValueError(f"query rows {sorted(asked)} are not the last row of a segment")
    gated = out.flatten(1) * ops.sigmoid(gate.flatten(1))
    return gated @ w.o_proj.T, states
