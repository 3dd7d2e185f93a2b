"""TorchRunner: the PyTorch CPU backend of ModelRunner, and the reference the CUDA backend is
held to. It loads an export, packs each launch's segments and runs them in one forward pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from openjev.export import ExportMeta, load_export_meta
from openjev.worker.checkpoint.config import ModelConfig, load_model_config
from openjev.worker.checkpoint.weights import load_weights
from openjev.worker.model import ops
from openjev.worker.model.backbone import forward, pack
from openjev.worker.model.state import AttentionState, GdnState, SegmentState
from openjev.worker.runner_api import SegmentResult, SegmentRun, pass_depths


class TorchRunner:
    """Runs passes of tree segments on CPU (parents and children in one pass). dtype is the compute dtype of weights and
    activations (the GDN recurrent state and the head are fp32 regardless)."""

    backend = "torch"
    max_pass_depth = 1 << 16  # the mixers walk a pass's segments in order, parents first
    # GDN chunks and attention query blocks run from each segment's start (ops.py): a segment
    # may be cut exactly only on that 64-token grid (openjev.worker.cache.keys)
    state_cut_anywhere = False

    def __init__(self, model_dir: Path, *, dtype: torch.dtype = torch.float32, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.meta: ExportMeta = load_export_meta(model_dir)
        self.config: ModelConfig = load_model_config(model_dir)
        self.dtype = dtype
        # weights it serves from, so in memory of their own: an F32 export's stayed views of the
        # file's map, so an export rewritten in place changed answers and a truncated one killed
        # the worker (SIGBUS)
        self.weights = load_weights(model_dir, self.config, dtype, own=True)
        self.head_weight = torch.tensor(self.meta.head_weight, dtype=torch.float32)

    def _check(self, run: SegmentRun) -> None:
        if len(run.token_ids) == 0:
            raise ValueError("SegmentRun.token_ids must not be empty")
        parent = run.parent_state
        if parent is not None and not isinstance(parent, SegmentState):
            raise TypeError(f"parent_state is a {type(parent).__name__}, not a state this runner returned")
        # every run's ids, a child's in the same pass too (-1 read the table's last row)
        bad = [t for t in run.token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (size {self.config.vocab_size})")
        if run.parent_in_pass is not None:
            return  # pass_depths checked its start position
        num_before = 0 if parent is None else parent.num_tokens
        if run.start_position != num_before:
            raise ValueError(f"start_position {run.start_position} != the parent's end position {num_before}")

    def final_hidden(self, runs: Sequence[SegmentRun]) -> tuple[Tensor, list[SegmentState | None]]:
        """Final-normed hidden states [R, D] of the reading runs' last tokens (in run order), and
        every run's final state (None where the run keeps none)."""
        pass_depths(runs)
        for run in runs:
            self._check(run)
        launch = pack(
            [list(run.token_ids) for run in runs],
            [run.start_position for run in runs],
            [run.parent_in_pass if run.parent_state is None else run.parent_state.layers for run in runs],
            [run.read_head for run in runs],
            [run.keep_state for run in runs],
        )
        with torch.inference_mode():
            hidden, layer_states = forward(self.weights, self.config, launch)
        states = [
            None if layers is None else SegmentState(num_tokens=run.start_position + len(run.token_ids), layers=layers)
            for run, layers in zip(runs, layer_states, strict=True)
        ]
        return hidden, states

    def cacheable_state(self, state: SegmentState) -> tuple[SegmentState, int]:
        """The state as the state cache keeps it, and its bytes: tensors that are views of a
        pass's buffers (a root segment's keys) are copied, so the cache pins only its own bytes."""
        layers = tuple(
            GdnState(_own(layer.conv_window), _own(layer.recurrent))
            if isinstance(layer, GdnState)
            else AttentionState(_own(layer.keys), _own(layer.values))
            for layer in state.layers
        )
        nbytes = sum(getattr(layer, f.name).nbytes for layer in layers for f in dataclasses.fields(layer))
        return SegmentState(state.num_tokens, layers), nbytes

    def run_launch(self, runs: Sequence[SegmentRun]) -> list[SegmentResult]:
        hidden, states = self.final_hidden(runs)
        rows = iter(hidden)
        results = []
        for run, state in zip(runs, states, strict=True):
            score = ops.head_score(next(rows), self.head_weight, self.meta.head_bias) if run.read_head else None
            results.append(SegmentResult(state=state if run.keep_state else None, head_score=score))
        return results


def _own(tensor: Tensor) -> Tensor:
    """The tensor itself if it owns exactly its storage, else a compact copy (same bits)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
