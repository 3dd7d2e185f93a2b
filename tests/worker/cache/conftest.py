"""Fixtures for the state-cache tests: the demo model's torch runner, the real tokenizer, and
agent-session requests built from the benchmark workload (rendered and tokenized as the
frontend does)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from openjev.contract.request import parse_request
from openjev.worker.engine import QuestionWork

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


def to_work(tokenizer, request: dict) -> list[QuestionWork]:
    compiled = parse_request(request, accepted_models=())
    return [QuestionWork(q.kind, tuple(map(tuple, tokenizer.encode(q.prompts)))) for q in compiled.questions]


def states_of(workload: list[dict], lo_chars: int, hi_chars: int, count: int) -> list[str]:
    """`count` distinct workload states of lo..hi characters (a state is a string or JSON)."""
    found: list[str] = []
    for request in workload:
        state = request["state"]
        if lo_chars <= len(json.dumps(state)) <= hi_chars and state not in found:
            found.append(state)
        if len(found) == count:
            return found
    raise AssertionError(f"the workload has fewer than {count} states of {lo_chars}-{hi_chars} characters")


def session_request(rng: random.Random, workload: list[dict], state) -> dict:
    """One agent call: the given state and the questions of a random workload request
    (1 to 3 of them)."""
    single = [r for r in workload if 1 <= len(r["questions"]) <= 3]
    return {"state": state, "questions": rng.choice(single)["questions"]}
