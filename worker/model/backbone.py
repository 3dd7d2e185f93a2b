"""One forward pass of the hybrid backbone over a launch of packed segments.

Pre-norm residual layers; the layer kind comes from config.layer_types. Dense work (norms,
projections, MLP) runs once over all rows [T_total, D]; mixers loop over segments. After the last
layer's mixer only the rows the head reads go on: the rest feed nothing (states come from mixer
inputs), so the last MLP and the final norm skip them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from openjev.worker.checkpoint.config import ModelConfig
from openjev.worker.checkpoint.weights import GdnLayerWeights, LayerWeights, ModelWeights
from openjev.worker.model import ops
from openjev.worker.model.gated_attention import attention_mixer
from openjev.worker.model.gated_deltanet import gdn_mixer
from openjev.worker.model.state import AttentionState, GdnState, LayerState

StateT = TypeVar("StateT", GdnState, AttentionState)


@dataclass(frozen=True)
class PackedLaunch:
    """token_ids: [T_total] int64, all segments' tokens back to back; positions: [T_total] int64
    rotary positions; spans: each segment's [start, end) rows; parent_layer_states: per segment,
    its parent's per-layer states (None: start of prompt); head_rows: rows whose final hidden
    state is wanted, in output order."""

    token_ids: Tensor
    positions: Tensor
    spans: tuple[tuple[int, int], ...]
    parent_layer_states: tuple[tuple[LayerState, ...] | None, ...]
    head_rows: tuple[int, ...]


def mlp(x: Tensor, layer: LayerWeights) -> Tensor:
    """SiLU-gated MLP. x: [N, D] -> [N, D]."""
    return (F.silu(x @ layer.mlp_gate.T) * (x @ layer.mlp_up.T)) @ layer.mlp_down.T


def run_mixer(
    layer: LayerWeights, config: ModelConfig, h: Tensor, launch: PackedLaunch, index: int
) -> tuple[Tensor, Sequence[LayerState]]:
    parents = [None if states is None else states[index] for states in launch.parent_layer_states]
    if isinstance(layer, GdnLayerWeights):
        return gdn_mixer(layer.mixer, config, h, launch.spans, _states_of(GdnState, parents, index))
    return attention_mixer(
        layer.mixer, config, h, launch.positions, launch.spans, _states_of(AttentionState, parents, index)
    )


def _states_of(state_type: type[StateT], parents: Sequence[LayerState | None], index: int) -> list[StateT | None]:
    """The parents' states of one layer, checked to be that layer's kind of state."""
    states: list[StateT | None] = []
    for state in parents:
        if state is not None and not isinstance(state, state_type):
            raise ValueError(f"layer {index}: parent state is a {type(state).__name__}, not a {state_type.__name__}")
        states.append(state)
    return states


def forward(
    weights: ModelWeights, config: ModelConfig, launch: PackedLaunch
) -> tuple[Tensor, list[tuple[LayerState, ...]]]:
    """Returns (final-normed hidden states of launch.head_rows [R, D], and per segment its
    per-layer final states)."""
    x = weights.embed_tokens[launch.token_ids]  # [T_total, D]
    per_layer_states: list[Sequence[LayerState]] = []
    last = len(weights.layers) - 1
    for index, layer in enumerate(weights.layers):
        mixed, states = run_mixer(layer, config, ops.rms_norm(x, layer.input_norm, config.rms_norm_eps), launch, index)
        per_layer_states.append(states)
        x = x + mixed
        if index == last:
            x = x[list(launch.head_rows)]
        x = x + mlp(ops.rms_norm(x, layer.post_attention_norm, config.rms_norm_eps), layer)
    hidden = ops.rms_norm(x, weights.final_norm, config.rms_norm_eps)
    per_segment = [tuple(layer_states[s] for layer_states in per_layer_states) for s in range(len(launch.spans))]
    return hidden, per_segment


def pack(
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    parent_layer_states: Sequence[tuple[LayerState, ...] | None],
    read_head: Sequence[bool],
) -> PackedLaunch:
    """Lay segments back to back. The head reads each reading segment's last row."""
    spans: list[tuple[int, int]] = []
    positions: list[int] = []
    flat: list[int] = []
    for ids, start_position in zip(token_ids, start_positions, strict=True):
        begin = len(flat)
        flat.extend(ids)
        spans.append((begin, len(flat)))
        positions.extend(range(start_position, start_position + len(ids)))
    return PackedLaunch(
        token_ids=torch.tensor(flat, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        spans=tuple(spans),
        parent_layer_states=tuple(parent_layer_states),
        head_rows=tuple(end - 1 for (_, end), reads in zip(spans, read_head, strict=True) if reads),
    )
