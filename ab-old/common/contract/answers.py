"""Head scores to answers (docs/contract.md, "Scores to answers"), all in fp64.

The arithmetic follows the reference (`contract::answer`) operation for operation, so results
agree to the last bit where the inputs do: `p_i = exp((s_i - max s) / T) / sum_j exp(...)` with a
left-to-right sum (an explicit loop: Python 3.12's `sum()` compensates, the reference does not).

- noul: the question has one candidate with score s; the scores normalized are `[0, s]`, so the
  answer is `p_yes = sigmoid(s / T)`.
- choice: the mode is the first key with the highest p (ties go to the earlier key);
  `confidence = (p_mode - 1/n) / (1 - 1/n)`, 1.0 when n = 1.
- score: keys "0".."n-1"; `score = sum(i * p_i)`; `confidence = max(0, 1 - sum(|i - mode| * p_i)
  / U)` with `U = mean_i |i - (n-1)/2|`; `legend` maps each key to its raw level.
Key order of each answer object is the reference response's: type, choice|score|noul,
probabilities, confidence, legend.
A non-finite head score is an error (ValueError "non-finite head score"), never an answer; so
is a temperature that is not finite and positive, and a score count that does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openjev.contract.literals import QuestionKind
from openjev.contract.request import Question


def question_probabilities(kind: QuestionKind, head_scores: Sequence[float], temperature: float) -> list[float]:
    """Softmax of one question's head scores at temperature T.

    head_scores: one per candidate, in candidate order (noul: exactly one).
    Returns one probability per candidate; for noul `[p_no, p_yes]`.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError("temperature must be finite and positive")
    scores = [float(s) for s in head_scores]
    if not all(math.isfinite(s) for s in scores):
        raise ValueError("non-finite head score")
    if kind == "noul":
        if len(scores) != 1:
            raise ValueError(f"a noul question has 1 head score, got {len(scores)}")
        scores = [0.0, scores[0]]
    elif kind in ("choice", "score"):
        if not scores:
            raise ValueError(f"a {kind} question needs at least one head score")
    else:
        raise ValueError(f"unknown question kind {kind!r}")
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    total = 0.0
    for w in weights:
        total += w
    return [w / total for w in weights]


def answer_from_probabilities(question: Question, probabilities: Sequence[float]) -> dict[str, Any]:
    """The JSON answer object of one question from its normalized probabilities."""
    probs = [float(p) for p in probabilities]
    if question.kind == "noul":
        if len(probs) != 2:
            raise ValueError(f"a noul answer needs [p_no, p_yes], got {len(probs)} values")
        return {"type": "noul", "noul": probs[1]}
    n = len(question.options)
    if len(probs) != n:
        raise ValueError(f"question {question.id}: {len(probs)} probabilities for {n} options")
    mode = 0
    for i in range(1, n):
        if probs[i] > probs[mode]:
            mode = i
    by_key = dict(zip(question.options, probs, strict=True))
    if question.kind == "choice":
        confidence = 1.0 if n == 1 else (probs[mode] - 1.0 / n) / (1.0 - 1.0 / n)
        return {
            "type": "choice",
            "choice": question.options[mode],
            "probabilities": by_key,
            "confidence": confidence,
        }
    if question.kind != "score":
        raise ValueError(f"unknown question kind {question.kind!r}")
    score = 0.0
    distance = 0.0
    for i, p in enumerate(probs):
        score += i * p
        distance += abs(i - mode) * p
    center = (n - 1) / 2.0
    uniform_distance = 0.0
    for i in range(n):
        uniform_distance += abs(i - center)
    uniform_distance /= n
    confidence = 1.0 - distance / uniform_distance
    return {
        "type": "score",
        "score": score,
        "probabilities": by_key,
        "confidence": confidence if confidence > 0.0 else 0.0,
        "legend": dict(zip(question.options, question.legend, strict=True)),
    }


def answers_from_scores(
    questions: Sequence[Question],
    head_scores_per_question: Sequence[Sequence[float]],
    temperature: float,
) -> dict[str, dict[str, Any]]:
    """id -> answer, in question order. head_scores_per_question[i]: question i's head scores,
    one per candidate (however the candidates were batched)."""
    if len(questions) != len(head_scores_per_question):
        raise ValueError(f"{len(head_scores_per_question)} score rows for {len(questions)} questions")
    answers = {}
    for question, scores in zip(questions, head_scores_per_question, strict=True):
        if len(scores) != len(question.prompts):
            raise ValueError(
                f"question {question.id}: {len(scores)} head scores for {len(question.prompts)} candidates"
            )
        probabilities = question_probabilities(question.kind, scores, temperature)
        answers[question.id] = answer_from_probabilities(question, probabilities)
    return answers
