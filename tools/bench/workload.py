"""A seeded JevBench-shaped workload, written as contract JSON so any client can replay it.

The public JevBench split is 231 single-question requests (139 choice, 74 noul, 18 score; 775
candidates) spread over four length groups by the longest candidate's token count. Requests here
have those exact counts; their states are realistic support/ops texts whose length is tuned with
the real tokenizer until the longest candidate falls inside its group. Multi-question requests
(3, 4, 8 questions over one state) and capacity cases complete the set.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUPS = ((1, 128), (129, 512), (513, 2048), (2049, 4096))
GROUP_NAMES = ("1-128", "129-512", "513-2048", "2049-4096")
# Requests per kind and length group in the public split.
COUNTS = {"choice": (72, 23, 17, 27), "noul": (36, 26, 6, 6), "score": (12, 2, 1, 3)}
TOTAL_CANDIDATES = 775

_SUBJECTS = [
    "The customer",
    "The on-call engineer",
    "A reviewer",
    "The billing system",
    "The user",
    "The security scanner",
    "The support agent",
    "The deployment pipeline",
    "The account owner",
]
_VERBS = ["reports", "notes", "confirms", "observes", "claims", "logs", "mentions", "flags"]
_OBJECTS = [
    "a duplicate charge on the last invoice",
    "intermittent 502 errors from the API gateway",
    "a password reset email that never arrived",
    "an unexpected login from a new country",
    "slow page loads since the last release",
    "a refund that has not been processed",
    "a failed nightly backup job",
    "a certificate that expires in three days",
    "an order shipped to the wrong address",
    "a spike in memory use on worker nodes",
    "that the mobile app crashes on start",
    "a request to change the billing plan",
]
_DETAILS = [
    "No other customers are affected.",
    "The issue started yesterday at 14:02 UTC.",
    "Service status shows all systems operational.",
    "There is no sign of unauthorized access.",
    "The ticket was escalated twice.",
    "Logs show retries with exponential backoff.",
    "The customer has been with us for six years.",
    "A workaround exists but is manual.",
    "Two-factor authentication is enabled on the account.",
    "The amount in question is 49.99 EUR.",
]
_CHOICES = {
    "billing": "Problems with charges, invoices, refunds or payments.",
    "security": "Unauthorized access or account compromise.",
    "technical": "Service unavailable or a software malfunction.",
    "shipping": "Deliveries, addresses and tracking.",
    "account": "Profile, login and plan changes.",
    "feedback": "Suggestions and general comments.",
    "legal": "Contracts, compliance and data requests.",
    "other": None,
}
_LEVELS = [
    "Routine: nothing is disrupted.",
    "Low: a minor inconvenience.",
    "Moderate: one feature degraded.",
    "Elevated: several users affected.",
    "High: a core service degraded.",
    "Severe: a core service down.",
    "Urgent: customer money at risk.",
    "Critical: active unauthorized access.",
    "Emergency: data loss in progress.",
    "Catastrophic: everything is down.",
]


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # choice | noul | score | multi | capacity
    group: str  # length group of the longest candidate, or the capacity case's label
    request: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(
            {"name": self.name, "kind": self.kind, "group": self.group, "request": self.request}, ensure_ascii=False
        )


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}. {rng.choice(_DETAILS)}"


def _question(rng: random.Random, kind: str, num_candidates: int) -> dict[str, Any]:
    if kind == "noul":
        q: dict[str, Any] = {"type": "noul", "instructions": "Does this message describe a duplicate charge?"}
        if rng.random() < 0.5:
            q["criteria"] = {"true": "A charge appears twice.", "false": "No charge is repeated."}
        return q
    if kind == "score":
        return {
            "type": "score",
            "instructions": "Assess the urgency using only the given evidence.",
            "criteria": _LEVELS[:num_candidates],
        }
    keys = list(_CHOICES)
    criteria: dict[str, Any] = {}
    for i in range(num_candidates):
        key = keys[i % len(keys)] + ("" if i < len(keys) else f"_{i // len(keys)}")
        criteria[key] = _CHOICES[keys[i % len(keys)]]
    return {"type": "choice", "instructions": "Which team should handle this issue?", "criteria": criteria}


def _state_of(rng: random.Random, num_sentences: int, as_json: bool) -> Any:
    sentences = [_sentence(rng) for _ in range(num_sentences)]
    if as_json:
        return {
            "ticket": {
                "id": rng.randrange(10**6),
                "messages": sentences,
                "priority": rng.choice([1, 2, 3]),
                "amount": round(rng.uniform(1, 500), 2),
            }
        }
    return " ".join(sentences)


def _fit_state(
    rng: random.Random, questions: dict, low: int, high: int, longest_tokens: Callable[[dict], int]
) -> dict[str, Any]:
    """A request whose longest candidate has between low and high tokens: grow the state sentence
    by sentence (binary search over the count), with a fixed seed per request. Its state has at
    least one sentence wherever one fits the group (a target drawn below that length once left
    most 1-128 requests without a state, and many of them identical)."""
    seed = rng.randrange(2**32)
    as_json = rng.random() < 0.3

    def build(n: int) -> dict[str, Any]:
        return {"state": _state_of(random.Random(seed), n, as_json), "questions": questions}

    one = longest_tokens(build(1))
    fewest, shortest = (1, one) if one <= high else (0, longest_tokens(build(0)))
    target = rng.randint(max(low, shortest), high)
    lo, hi = fewest, fewest + 1
    while longest_tokens(build(hi)) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # largest n with tokens <= target
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if longest_tokens(build(mid)) <= target else (lo, mid)
    request = build(lo)
    n = longest_tokens(request)
    if n < low:  # one more sentence overshoots the target but may still land inside the group
        request = build(lo + 1)
        n = longest_tokens(request)
    if not low <= n <= high:
        raise ValueError(f"could not fit a request into {low}-{high} tokens (got {n})")
    return request


def _candidate_counts(rng: random.Random) -> dict[str, list[int]]:
    """Per-request candidate counts with the split's totals: noul 1 each, score 2..10 levels,
    choice the rest (2..8 each) so the whole set has exactly 775 candidates."""
    n_choice, n_noul, n_score = (sum(COUNTS[k]) for k in ("choice", "noul", "score"))
    score = [rng.randint(2, 10) for _ in range(n_score)]
    remaining = TOTAL_CANDIDATES - n_noul - sum(score)
    choice = [2] * n_choice
    remaining -= 2 * n_choice
    while remaining > 0:
        i = rng.randrange(n_choice)
        if choice[i] < 8:
            choice[i] += 1
            remaining -= 1
    return {"choice": choice, "noul": [1] * n_noul, "score": score}


def jevbench_cases(longest_tokens: Callable[[dict], int], seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    counts = _candidate_counts(rng)
    cases = []
    for kind in ("choice", "noul", "score"):
        index = 0
        for group, (low, high), n_requests in zip(GROUP_NAMES, GROUPS, COUNTS[kind], strict=True):
            for _ in range(n_requests):
                questions = {"q": _question(rng, kind, counts[kind][index])}
                request = _fit_state(rng, questions, low, high, longest_tokens)
                cases.append(Case(f"{kind}-{group}-{index}", kind, group, request))
                index += 1
    return cases


def multi_question_cases(longest_tokens: Callable[[dict], int], seed: int = 1) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for num_questions in (3, 4, 8):
        for low, high in ((129, 512), (513, 2048)):
            kinds = ["choice", "noul", "score"]
            questions = {}
            for i in range(num_questions):
                kind = kinds[i % 3]
                questions[f"q{i}"] = _question(
                    rng, kind, {"choice": rng.randint(2, 5), "score": rng.randint(2, 5), "noul": 1}[kind]
                )
            request = _fit_state(rng, questions, low, high, longest_tokens)
            cases.append(Case(f"multi-{num_questions}q-{low}-{high}", "multi", f"{num_questions}q", request))
    return cases


def capacity_cases(longest_tokens: Callable[[dict], int], max_length: int, seed: int = 2) -> list[Case]:
    rng = random.Random(seed)
    specs = [
        ("capacity-16k", {"q": _question(rng, "choice", 3)}, max_length - 512, max_length),
        ("capacity-17-candidates", {"q": _question(rng, "choice", 17)}, 513, 1024),
        ("capacity-33-candidates", {"q": _question(rng, "choice", 33)}, 513, 1024),
        ("capacity-score-2", {"q": _question(rng, "score", 2)}, 129, 512),
        ("capacity-score-10", {"q": _question(rng, "score", 10)}, 129, 512),
        (
            "capacity-mixed",
            {"a": _question(rng, "choice", 4), "b": _question(rng, "noul", 1), "c": _question(rng, "score", 5)},
            2049,
            4096,
        ),
    ]
    return [
        Case(name, "capacity", name.removeprefix("capacity-"), _fit_state(rng, q, low, high, longest_tokens))
        for name, q, low, high in specs
    ]


def write_jsonl(cases: list[Case], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(case.to_json() + "\n" for case in cases), encoding="utf-8")


def read_jsonl(path: Path) -> list[Case]:
    cases = []
    for line in path.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        cases.append(Case(item["name"], item["kind"], item["group"], item["request"]))
    return cases
