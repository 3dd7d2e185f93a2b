"""The requests the soak sends and the answers it compares them with.

Valid requests (distinct states, kinds, sizes and prefix policies), invalid ones with their exact
INVALID_ARGUMENT message, oversized ones for the hostile mix, and MEDIUM for cancellations and
deadlines. Every answer is compared, without its timing, with the answer to the same request sent
alone before the run."""

from __future__ import annotations

import json
from typing import Any

from openjev.client import Client
from openjev.contract.literals import PrefixPolicy
from openjev.tools.soak.hostile import Hostile

STATES = [
    "A customer says: I was charged twice for one order.",
    {"ticket": 4821, "messages": ["Hi", "My card was declined", "¿Puedes ayudarme?"], "vip": True},
    "人力资源管理 asks: can I move my 2 days of leave to next month? 🙂",
    ["step 1: login", "step 2: open settings", {"error": "403", "retry": 1e-05}],
]
# A request of this size takes about a second on the CPU demo model: long enough to be cancelled
# or to run out of its deadline part-way.
MEDIUM = {
    "state": "word " * 600,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(6)}}},
}


def comparable(response: dict) -> dict:
    """A response without its timing (the only field that may differ between two runs)."""
    copy = json.loads(json.dumps(response))
    copy["metadata"].pop("inference_seconds", None)
    return copy


def tagged(request: dict, tag: str) -> dict:
    """The request with each question id suffixed by `tag`. Ids are in no prompt, so its answer is
    the untagged one's under the tagged ids: an answer meant for another request (the same text
    under another tag) then differs, which it did not between two sends of one request."""
    return {**request, "questions": {f"{q}-{tag}": v for q, v in request["questions"].items()}}


def tagged_answer(answer: dict, tag: str) -> dict:
    """`answer` (to the untagged request) as the answer to `tagged(request, tag)`."""
    return {**answer, "answers": {f"{q}-{tag}": v for q, v in answer["answers"].items()}}


def valid_requests() -> list[tuple[dict[str, Any], PrefixPolicy | None]]:
    """(request, policy) pairs: distinct states, kinds, sizes and prefix policies."""
    out: list[tuple[dict[str, Any], PrefixPolicy | None]] = []
    for i, state in enumerate(STATES):
        questions = {
            "route": {
                "type": "choice",
                "instructions": "Which team should handle this?",
                "criteria": {"billing": "Charges and refunds.", "security": None, "hr": {"scope": "people"}},
            },
            "urgent": {
                "type": "noul",
                "instructions": "Is this urgent?",
                "criteria": {"true": "needs action today", "false": "can wait"},
            },
            "severity": {
                "type": "score",
                "instructions": "How severe is it?",
                "criteria": ["none", "low", "medium", "high", "critical"][: 2 + i],
            },
        }
        if i % 2:
            questions = dict(reversed(list(questions.items())))
        for policy in ("off", "auto") if i < 2 else ("shared",):
            out.append(({"state": state, "questions": questions}, policy))
    out.append(
        ({"model": "open-jev", "state": "short", "questions": {"only": {"type": "noul", "instructions": "ok?"}}}, None)
    )
    return out


def invalid_requests() -> list[tuple[str, str]]:
    """(request JSON text, the exact INVALID_ARGUMENT message)."""
    noul = {"type": "noul", "instructions": "x"}
    return [
        ("{not json", "request body must be valid JSON"),
        ('{"state": NaN, "questions": {}}', "request body must be valid JSON"),
        (
            '{"state": "x", "questions": {"a": {"type": "noul", "instructions": "x"}, '
            '"a": {"type": "noul", "instructions": "x"}}}',
            "request body must be valid JSON",
        ),
        ("[1, 2]", "request body must be a JSON object"),
        (json.dumps({"model": "gpt", "state": "x", "questions": {"q": noul}}), "requested model is not loaded"),
        (json.dumps({"questions": {"q": noul}}), "request requires state"),
        (
            json.dumps({"state": "x", "questions": {}}),
            "questions must be nonempty and within the server question limit",
        ),
        (
            json.dumps({"state": "x", "questions": {"q": {"type": "score", "instructions": "x", "criteria": ["a"]}}}),
            "Score requires 2 to 10 descriptive levels",
        ),
        (
            json.dumps({"state": "x", "questions": {"q": noul}, "prefix_policy": "always"}),
            "prefix_policy must be off, default, shared, fixed or auto",
        ),
        (json.dumps({"state": "word " * 17000, "questions": {"q": noul}}), "too_long"),  # message checked by prefix
    ]


def oversized_requests(hostile: Hostile) -> list[tuple[str, str]]:
    """(request JSON text, exact INVALID_ARGUMENT message): over the rendered-size limit (refused
    before tokenizing) and over the token limit (refused while tokenizing, before the worker runs).
    The token case is left out where the limit is too large to reach cheaply."""
    out = []
    state = "x" * (hostile.max_rendered_bytes // 16 + 1)  # 16 candidates: over the limit
    criteria = dict.fromkeys(map(str, range(16)))
    body = {"state": state, "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": criteria}}}
    out.append((json.dumps(body), "request exceeds the rendered size limit"))
    if hostile.max_request_tokens <= 262144:
        # "word " * 1000 is about 1,030 tokens a candidate, far under max_length.
        n = hostile.max_request_tokens // 1000 + 8
        criteria = dict.fromkeys(map(str, range(n)))
        body = {
            "state": "word " * 1000,
            "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": criteria}},
        }
        out.append((json.dumps(body), "request exceeds the token limit"))
    return out


def baseline(address: str, valid: list[tuple[dict, PrefixPolicy | None]], timeout: float) -> list[dict]:
    """Each valid request sent alone (one at a time) before the run: the answers to compare with."""
    with Client(address) as client:
        return [comparable(client.decide(request, policy=policy, timeout=timeout)) for request, policy in valid]
