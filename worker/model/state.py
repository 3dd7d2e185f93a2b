"""The per-segment state a child segment starts from (opaque to the engine).

Each mixer kind declares its state here: what must survive a segment boundary so that a child
computes exactly what the whole prompt would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class GdnState:
    """Gated DeltaNet layer state.
    conv_window: [K-1, C] the last K-1 conv inputs (mixed q,k,v before the conv), compute dtype.
    recurrent: [Hv, Dk, Dv] fp32, the delta-rule state."""

    conv_window: Tensor
    recurrent: Tensor


@dataclass(frozen=True)
class AttentionState:
    """Full-attention layer state: keys (after per-head norm and rotary) and values of every
    position so far, ancestors' and own. keys, values: [S, Hkv, D] compute dtype."""

    keys: Tensor
    values: Tensor


LayerState = GdnState | AttentionState


@dataclass(frozen=True)
class SegmentState:
    """num_tokens: positions covered (the end position of the segment); layers: one per layer."""

    num_tokens: int
    layers: tuple[LayerState, ...]
