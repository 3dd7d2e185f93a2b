"""Fixtures for the state-cache tests: the demo model's torch runner, the real tokenizer, the
benchmark workload (request builders: cache_requests.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKLOAD = Path(__file__).resolve().parents[3] / "benchmarks" / "workload.jsonl"


@pytest.fixture(scope="session")
def workload() -> list[dict]:
    return [json.loads(line)["request"] for line in WORKLOAD.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tokenizer(demo_model):
    from openjev.tokenizer import PromptTokenizer

    return PromptTokenizer.from_export(demo_model)


@pytest.fixture(scope="module")
def torch_runner(demo_model):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(demo_model, num_threads=1)
