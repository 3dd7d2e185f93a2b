"""Agent-session requests built from the benchmark workload, rendered and tokenized as the
frontend does (a module of its own name, imported directly by the state-cache tests)."""

from __future__ import annotations

import json
import random

from openjev.contract.request import parse_request
from openjev.worker.engine import QuestionWork


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
