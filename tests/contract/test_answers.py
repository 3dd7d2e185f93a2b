"""Head scores to answers against the golden vectors (tests/contract/data/, produced by
the reference service), and the arithmetic rules of docs/contract.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openjev.contract.answers import (
    answer_from_probabilities,
    answers_from_scores,
    question_probabilities,
)
from openjev.contract.request import Question, parse_request

GOLDEN = json.loads((Path(__file__).parent / "data" / "contract_cases.json").read_text())
ACCEPTED = {"Qwen/Qwen3.8-27B", "open-jev-27b-v1.1"}
T = GOLDEN["temperature"]


def compile_one(question):
    return parse_request({"state": "s", "questions": {"q": question}}, accepted_models=ACCEPTED).questions[0]


CHOICE3 = compile_one({"type": "choice", "instructions": "x", "criteria": {"a": None, "b": "B", "c": None}})
SCORE3 = compile_one({"type": "score", "instructions": "x", "criteria": ["lo", {"m": 1}, "hi"]})
NOUL = compile_one({"type": "noul", "instructions": "x"})


def assert_same_json(actual, expected, path="$"):
    """Same structure, same key order, numbers within 1e-12, everything else equal."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_json(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (int, float)) and not isinstance(expected, bool):
        assert isinstance(actual, float), f"{path}: {actual!r} is not a float"
        assert abs(actual - expected) <= 1e-12, f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, path


@pytest.mark.parametrize("index", range(len(GOLDEN["cases"])))
def test_golden_answers(index):
    case = GOLDEN["cases"][index]
    request = parse_request(case["request"], accepted_models=ACCEPTED)
    answers = answers_from_scores(request.questions, case["head_logits"], T)
    assert_same_json(answers, case["answers"])


def test_golden_answers_are_exact():
    # The arithmetic is the reference's operation for operation: not just close, equal.
    for case in GOLDEN["cases"]:
        request = parse_request(case["request"], accepted_models=ACCEPTED)
        answers = answers_from_scores(request.questions, case["head_logits"], T)
        assert json.dumps(answers) == json.dumps(case["answers"])


def test_answer_key_order():
    assert list(answer_from_probabilities(CHOICE3, [0.2, 0.3, 0.5])) == [
        "type",
        "choice",
        "probabilities",
        "confidence",
    ]
    assert list(answer_from_probabilities(SCORE3, [0.2, 0.3, 0.5])) == [
        "type",
        "score",
        "probabilities",
        "confidence",
        "legend",
    ]
    assert list(answer_from_probabilities(NOUL, [0.4, 0.6])) == ["type", "noul"]


@pytest.mark.parametrize("score", [-40.0, -3.0, -1e-3, 0.0, 0.5, 1.0, 7.25, 40.0])
def test_noul_is_sigmoid_of_score_over_temperature(score):
    p_no, p_yes = question_probabilities("noul", [score], T)
    assert p_yes == pytest.approx(1.0 / (1.0 + math.exp(-score / T)), rel=1e-13, abs=1e-300)
    assert p_no + p_yes == pytest.approx(1.0, abs=1e-15)
    assert answer_from_probabilities(NOUL, [p_no, p_yes]) == {"type": "noul", "noul": p_yes}


def test_noul_extremes_do_not_overflow():
    assert question_probabilities("noul", [1e6], 1.0) == [0.0, 1.0]
    assert question_probabilities("noul", [-1e6], 1.0) == [1.0, 0.0]


def test_choice_with_one_candidate():
    one = compile_one({"type": "choice", "instructions": "x", "criteria": {"only": None}})
    assert answers_from_scores([one], [[-123.0]], T) == {
        "q": {"type": "choice", "choice": "only", "probabilities": {"only": 1.0}, "confidence": 1.0}
    }


def test_choice_ties_go_to_the_first_key():
    answer = answers_from_scores([CHOICE3], [[1.0, 3.0, 3.0]], T)["q"]
    assert answer["choice"] == "b"
    uniform = answers_from_scores([CHOICE3], [[0.5, 0.5, 0.5]], T)["q"]
    assert uniform["choice"] == "a" and uniform["confidence"] == pytest.approx(0.0, abs=1e-15)


def test_choice_confidence_formula():
    probabilities = [0.1, 0.7, 0.2]
    answer = answer_from_probabilities(CHOICE3, probabilities)
    assert answer["choice"] == "b"
    assert answer["confidence"] == pytest.approx((0.7 - 1 / 3) / (1 - 1 / 3), abs=1e-15)
    assert answer["probabilities"] == {"a": 0.1, "b": 0.7, "c": 0.2}


def test_score_formulas():
    answer = answer_from_probabilities(SCORE3, [0.1, 0.7, 0.2])
    assert answer["score"] == pytest.approx(0.7 + 2 * 0.2, abs=1e-15)
    distance = 0.1 * 1 + 0.2 * 1
    uniform_distance = (1 + 0 + 1) / 3
    assert answer["confidence"] == pytest.approx(1 - distance / uniform_distance, abs=1e-15)
    assert answer["probabilities"] == {"0": 0.1, "1": 0.7, "2": 0.2}
    assert answer["legend"] == {"0": "lo", "1": {"m": 1}, "2": "hi"}


def test_score_confidence_is_never_negative():
    spread = answer_from_probabilities(SCORE3, [0.5, 0.0, 0.5])
    assert spread["confidence"] == 0.0 and math.copysign(1.0, spread["confidence"]) == 1.0
    certain = answer_from_probabilities(SCORE3, [0.0, 0.0, 1.0])
    assert certain["confidence"] == 1.0 and certain["score"] == 2.0


def test_score_with_two_levels():
    two = compile_one({"type": "score", "instructions": "x", "criteria": ["no", "yes"]})
    answer = answer_from_probabilities(two, [0.25, 0.75])
    assert answer["score"] == 0.75
    assert answer["confidence"] == pytest.approx(1 - 0.25 / 0.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind,good", [("choice", [0.0, 1.0]), ("score", [0.0, 1.0]), ("noul", [])])
def test_non_finite_head_score_is_an_error(kind, good, bad):
    with pytest.raises(ValueError, match="^non-finite head score$"):
        question_probabilities(kind, [*good, bad], T)


def test_non_finite_score_is_an_error_through_answers_from_scores():
    with pytest.raises(ValueError, match="^non-finite head score$"):
        answers_from_scores([CHOICE3], [[0.0, math.nan, 1.0]], T)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_invalid_temperature(temperature):
    with pytest.raises(ValueError):
        question_probabilities("choice", [0.0, 1.0], temperature)


def test_score_counts_must_fit():
    with pytest.raises(ValueError):
        question_probabilities("noul", [0.0, 1.0], T)
    with pytest.raises(ValueError):
        question_probabilities("choice", [], T)
    with pytest.raises(ValueError):
        question_probabilities("generation", [1.0], T)
    with pytest.raises(ValueError):
        answers_from_scores([CHOICE3], [[0.0, 1.0]], T)
    with pytest.raises(ValueError):
        answers_from_scores([CHOICE3, NOUL], [[0.0, 1.0, 2.0]], T)
    with pytest.raises(ValueError):
        answer_from_probabilities(CHOICE3, [0.5, 0.5])
    with pytest.raises(ValueError):
        answer_from_probabilities(NOUL, [1.0])


def test_answers_follow_question_order():
    request = parse_request(
        {
            "state": "s",
            "questions": {
                "z": {"type": "noul", "instructions": "x"},
                "a": {"type": "choice", "instructions": "x", "criteria": {"k": None}},
            },
        },
        accepted_models=ACCEPTED,
    )
    assert list(answers_from_scores(request.questions, [[0.0], [0.0]], T)) == ["z", "a"]


finite_scores = st.lists(st.floats(-60.0, 60.0, allow_nan=False), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(finite_scores, st.floats(0.05, 20.0))
def test_softmax_against_an_independent_formula(scores, temperature):
    probabilities = question_probabilities("choice", scores, temperature)
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    total = math.fsum(weights)
    for p, w in zip(probabilities, weights, strict=True):
        assert abs(p - w / total) <= 1e-12
    assert math.fsum(probabilities) == pytest.approx(1.0, abs=1e-12)
    shifted = question_probabilities("choice", [s + 5.0 for s in scores], temperature)
    assert all(abs(a - b) <= 1e-12 for a, b in zip(probabilities, shifted, strict=True))


def test_score_confidence_weighs_each_level_by_its_distance_from_the_mode():
    # Distances over 1 tell sum(|i - mode| * p_i) (docs/contract.md) from other weightings.
    five = compile_one({"type": "score", "instructions": "x", "criteria": ["a", "b", "c", "d", "e"]})
    uniform_distance = (2 + 1 + 0 + 1 + 2) / 5  # U = mean_i |i - (n-1)/2|
    for probabilities, mode, approx in (([0.6, 0.1, 0.1, 0.1, 0.1], 0, 1 / 6), ([0.1, 0.1, 0.6, 0.1, 0.1], 2, 0.5)):
        distance = 0.0
        for i, p in enumerate(probabilities):
            distance += abs(i - mode) * p
        expected = max(0.0, 1.0 - distance / uniform_distance)
        confidence = answer_from_probabilities(five, probabilities)["confidence"]
        assert confidence == expected
        assert confidence == pytest.approx(approx, abs=1e-12)


def test_softmax_sum_is_left_to_right_to_the_last_bit():
    # Found by search: for these scores a compensated sum (math.fsum, Python 3.12's sum())
    # differs from the reference's plain left-to-right sum in the last bit.
    scores = [0.0, -1.0, -2.0]
    weights = [math.exp(s / T) for s in scores]  # the top score is 0.0
    total = 0.0
    for w in weights:
        total += w
    assert total != math.fsum(weights)
    expected = [w / total for w in weights]
    assert [p.hex() for p in expected] == ["0x1.e1289b68f3076p-2", "0x1.4448da2eaf334p-2", "0x1.b51d14d0bb8b1p-3"]
    assert [p.hex() for p in question_probabilities("choice", scores, T)] == [p.hex() for p in expected]
    answer = answers_from_scores([CHOICE3], [scores], T)["q"]
    assert [p.hex() for p in answer["probabilities"].values()] == [p.hex() for p in expected]


def test_answer_for_an_unknown_kind_is_an_error():
    bogus = Question("q", "bogus", ("0", "1"), ("lo", "hi"), ("p0", "p1"))
    with pytest.raises(ValueError, match=r"^unknown question kind 'bogus'$"):
        answer_from_probabilities(bogus, [0.25, 0.75])
