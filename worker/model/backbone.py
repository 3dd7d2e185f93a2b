"""One forward pass of the hybrid backbone over a launch of packed segments.

Pre-norm residual layers; the layer kind comes from config.layer_types. Dense work (norms,
projections, MLP) runs once over all rows [T_total, D]; mixers loop over segments. After the last
layer's mixer only the rows the head reads go on: the rest feed nothing (states come from mixer
inputs), so the last MLP and the final norm skip them, and a last attention layer makes its
queries and outputs for those rows alone (keys and values, the states, for all).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from torch import Tensor

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import AttentionLayerWeights, GdnLayerWeights, LayerWeights, ModelWeights
from openjev.worker.model import ops
from openjev.worker.model.gated_attention import attention_mixer
from openjev.worker.model.gated_deltanet import GdnPlan, gdn_mixer, gdn_plan
from openjev.worker.model.state import AttentionState, GdnState, LayerState

StateT = TypeVar("StateT", GdnState, AttentionState)


@dataclass(frozen=True)
class PackedLaunch:
    """token_ids: [T_total] int64, all segments' tokens back to back, then pad rows up to the row
    quantum (in no span: the mixers leave them zero); positions: [T_total] int64 rotary
    positions; spans: each segment's [start, end) rows; parents: per segment, its
    parent's per-layer states from an earlier pass, or the index of an earlier segment of this
    pass, or None (start of prompt); head_rows: rows whose final hidden state is wanted, in
    output order; keep: per segment, whether its state is wanted after the pass (an attention
    state no one wants is not kept, layer by layer: it is a copy of its ancestors' keys)."""

    token_ids: Tensor
    positions: Tensor
    spans: tuple[tuple[int, int], ...]
    parents: tuple[tuple[LayerState, ...] | int | None, ...]
    head_rows: tuple[int, ...]
    keep: tuple[bool, ...] | None = None  # None: every segment's


def mlp(x: Tensor, layer: LayerWeights) -> Tensor:
    """SiLU-gated MLP. x: [N, D] -> [N, D]."""
    return (ops.silu(x @ layer.mlp_gate.T) * (x @ layer.mlp_up.T)) @ layer.mlp_down.T


def run_mixer(
    layer: LayerWeights,
    config: ModelConfig,
    h: Tensor,
    launch: PackedLaunch,
    index: int,
    plan: GdnPlan,
    query_rows: Sequence[int] | None = None,
) -> tuple[Tensor, Sequence[LayerState | None]]:
    parents = [p if p is None or isinstance(p, int) else p[index] for p in launch.parents]
    if isinstance(layer, GdnLayerWeights):
        return gdn_mixer(layer.mixer, config, h, launch.spans, _states_of(GdnState, parents, index), plan)
    parent_states = _states_of(AttentionState, parents, index)
    return attention_mixer(
        layer.mixer, config, h, launch.positions, launch.spans, parent_states, query_rows, launch.keep
    )


def _states_of(
    state_type: type[StateT], parents: Sequence[LayerState | int | None], index: int
) -> list[StateT | int | None]:
    """The parents' states of one layer, checked to be that layer's kind of state (an int: the
    index of an in-pass parent)."""
    states: list[StateT | int | None] = []
    for state in parents:
        if state is not None and not isinstance(state, int | state_type):
            raise ValueError(f"layer {index}: parent state is a {type(state).__name__}, not a {state_type.__name__}")
        states.append(state)
    return states


def forward(
    weights: ModelWeights, config: ModelConfig, launch: PackedLaunch
) -> tuple[Tensor, list[tuple[LayerState, ...] | None]]:
    """Returns (final-normed hidden states of launch.head_rows [R, D], and per segment its
    per-layer final states, None for a segment launch.keep does not keep)."""
    x = weights.embed_tokens[launch.token_ids]  # [T_total, D]
    per_layer_states: list[Sequence[LayerState | None]] = []
    last = len(weights.layers) - 1
    head_rows = _padded(list(launch.head_rows))
    plan = gdn_plan(launch.spans, launch.parents, config, len(launch.token_ids))  # one for all GDN layers
    for index, layer in enumerate(weights.layers):
        normed = ops.rms_norm(x, layer.input_norm, config.rms_norm_eps)
        if index == last and isinstance(layer, AttentionLayerWeights):
            # only the head rows go on: the last attention layer asks queries of them alone
            mixed, states = run_mixer(layer, config, normed, launch, index, plan, head_rows)
            x = x[head_rows] + mixed
        else:
            mixed, states = run_mixer(layer, config, normed, launch, index, plan)
            x = x + mixed
            if index == last:
                x = x[head_rows]
        per_layer_states.append(states)
        x = x + mlp(ops.rms_norm(x, layer.post_attention_norm, config.rms_norm_eps), layer)
    hidden = ops.rms_norm(x, weights.final_norm, config.rms_norm_eps)[: len(launch.head_rows)]
    kept = launch.keep or (True,) * len(launch.spans)
    per_segment = [
        cast(tuple[LayerState, ...], tuple(layer_states[s] for layer_states in per_layer_states)) if keep else None
        for s, keep in enumerate(kept)
    ]
    return hidden, per_segment


def _padded(rows: list[int]) -> list[int]:
    """Head rows repeated up to a multiple of ROW_QUANTUM (see pack)."""
    return rows + rows[-1:] * (-len(rows) % ROW_QUANTUM) if rows else rows


# Elementwise CPU kernels run a vectorised body and a scalar tail that can round differently, and
# CPU BLAS sums products of fewer than 16 rows in another order: an element's bits could depend on
# what else shares its pass. Rows (and head rows) padded to a multiple of this leave no tail and no
# short product, so a row's result is independent of the pass it shares.
ROW_QUANTUM = 16


def pack(
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    parents: Sequence[tuple[LayerState, ...] | int | None],
    read_head: Sequence[bool],
    keep: Sequence[bool] | None = None,
) -> PackedLaunch:
    """Lay segments back to back, plus pad rows (token 0 from position 0, in no segment: only the
    row-wise dense work sees them) up to a multiple of ROW_QUANTUM rows. The head reads each
    reading segment's last row."""
    spans: list[tuple[int, int]] = []
    positions: list[int] = []
    flat: list[int] = []
    for ids, start_position in zip(token_ids, start_positions, strict=True):
        begin = len(flat)
        flat.extend(ids)
        spans.append((begin, len(flat)))
        positions.extend(range(start_position, start_position + len(ids)))
    num_pad = -len(flat) % ROW_QUANTUM
    flat.extend([0] * num_pad)
    positions.extend(range(num_pad))
    return PackedLaunch(
        token_ids=torch.tensor(flat, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        spans=tuple(spans),
        parents=tuple(parents),
        head_rows=tuple(end - 1 for (_, end), reads in zip(spans, read_head, strict=True) if reads),
        keep=None if keep is None else tuple(keep),
    )
