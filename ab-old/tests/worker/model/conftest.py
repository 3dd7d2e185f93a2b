"""Fixtures for the model tests: a demo export built into a temp dir and the transformers oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

PREFIX = "model.language_model."


def build_model_only_export(out_dir: Path, seed: int) -> Path:
    """The demo export without the real tokenizer: the worker never tokenizes, and the export
    check only needs tokenizer.json to exist. Keeps these tests independent of openjev.tokenizer."""
    from openjev.tools.demo_model import build_demo_model

    build_demo_model(out_dir, seed=seed, with_tokenizer=False)
    (out_dir / "tokenizer.json").write_text("{}\n")
    return out_dir


@pytest.fixture(scope="session")
def model_export(tmp_path_factory) -> Path:
    return build_model_only_export(tmp_path_factory.mktemp("export") / "demo", seed=0)


@pytest.fixture(scope="session")
def runner(model_export):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(model_export, num_threads=2)


@pytest.fixture(scope="session")
def oracle(model_export):
    """transformers' Qwen3_5TextModel in fp32 holding the same weights (strict state-dict load,
    so our tensor names and shapes are exactly transformers')."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    text_config = json.loads((model_export / "config.json").read_text())["text_config"]
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config)).float().eval()
    tensors = load_file(model_export / "model.safetensors")
    state = {name.removeprefix(PREFIX): t.float() for name, t in tensors.items()}
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="session")
def oracle_last_hidden(oracle):
    """token ids -> [D] fp32, transformers' final-normed hidden state of the last token."""

    def last_hidden(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = oracle(input_ids=torch.tensor([token_ids]))
        return out.last_hidden_state[0, -1]

    return last_hidden
