"""Request validation and compilation: one test per contract message, the check order, prompts.

The golden requests (tests/contract/data/) were produced by the reference service.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from pathlib import Path

import pytest

from openjev.contract import errors
from openjev.contract.errors import ContractError
from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX
from openjev.contract.request import (
    MAX_JSON_DEPTH,
    MAX_RENDERED_BYTES,
    DecisionRequest,
    Question,
    check_json_value,
    parse_request,
    parse_request_json,
)

DATA = Path(__file__).parent / "data"
MODEL_ID = "Qwen/Qwen3.8-27B"
ALIAS = "open-jev-27b-v1.1"
ACCEPTED = frozenset({MODEL_ID, ALIAS})
NOUL = {"type": "noul", "instructions": "Is it?"}


def parse(obj, **kw) -> DecisionRequest:
    return parse_request(obj, accepted_models=ACCEPTED, **kw)


def rejected(obj, message: str, **kw) -> None:
    with pytest.raises(ContractError) as caught:
        parse(obj, **kw)
    assert caught.value.message == message
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)


def one(question, state="s") -> dict:
    return {"state": state, "questions": {"q": question}}


# --- golden requests -------------------------------------------------------------------------


def test_golden_requests_compile_in_order():
    cases = json.loads((DATA / "contract_cases.json").read_text())["cases"]
    first = parse(cases[0]["request"])
    assert [q.id for q in first.questions] == ["route", "refund_review", "urgency"]
    assert [q.kind for q in first.questions] == ["choice", "noul", "score"]
    assert first.questions[0].options == ("billing", "security", "technical")
    assert first.questions[1].options == ()
    assert first.questions[2].options == ("0", "1", "2")
    assert first.questions[2].legend == tuple(cases[0]["request"]["questions"]["urgency"]["criteria"])
    assert [len(q.prompts) for q in first.questions] == [3, 1, 3]
    assert first.num_candidates == 7
    assert first.model is None and first.prefix_policy is None
    second = parse(cases[1]["request"])
    assert second.model == ALIAS
    assert second.questions[0].prompts == (
        "Context:\nAnything\n\nQuestion: Pick\nProposed answer: only\n"
        "Is this proposed answer correct? Answer Yes or No.",
    )


def test_prompt_text_of_each_kind():
    state = "A customer says: I was charged twice."
    request = parse(
        {
            "state": state,
            "questions": {
                "route": {
                    "type": "choice",
                    "instructions": "Which team?",
                    "criteria": {"billing": "Charges.", "other": None},
                },
                "dup": {"type": "noul", "instructions": "Duplicate?"},
                "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]},
            },
        }
    )
    head = f"Context:\n{state}\n\n"
    tail = "\nIs this proposed answer correct? Answer Yes or No."
    route, dup, urgency = request.questions
    assert route.prompts == (
        head + "Question: Which team?\nProposed answer: billing: Charges." + tail,
        head + "Question: Which team?\nProposed answer: other" + tail,
    )
    assert dup.prompts == (head + "Question: Duplicate?\nIs the answer to this question yes? Answer Yes or No.",)
    assert urgency.prompts == (
        head + "Question: How urgent?\nProposed answer: low" + tail,
        head + "Question: How urgent?\nProposed answer: high" + tail,
    )


def test_noul_descriptions_are_appended_to_the_instructions():
    request = parse(
        one({"type": "noul", "instructions": "Refund?", "criteria": {"false": "keep it", "true": {"b": 1, "a": "é"}}})
    )
    assert request.questions[0].prompts == (
        'Context:\ns\n\nQuestion: Refund?\nYes means: {"a": "é", "b": 1}\nNo means: keep it\n'
        "Is the answer to this question yes? Answer Yes or No.",
    )


def test_structured_state_instructions_and_levels_are_rendered():
    request = parse(
        {
            "state": {"z": [1, 1e16, -0.0], "a": "ü"},
            "questions": {"q": {"type": "score", "instructions": ["rate", 1e-05], "criteria": [{"level": 0}, "high"]}},
        }
    )
    question = request.questions[0]
    assert question.prompts[0].startswith(
        'Context:\n{"a": "ü", "z": [1, 1e+16, -0.0]}\n\nQuestion: ["rate", 1e-05]\nProposed answer: {"level": 0}\n'
    )
    assert question.legend == ({"level": 0}, "high")


def test_state_whitespace_inside_the_prompt_is_kept():
    request = parse(one(NOUL, state="  padded\n\n"))
    assert request.questions[0].prompts[0].startswith("Context:\n  padded\n\n\n\nQuestion:")


def test_limits_at_their_edges_are_accepted():
    choice = {"type": "choice", "instructions": "x", "criteria": {str(i): None for i in range(255)}}
    assert len(parse(one(choice)).questions[0].prompts) == 255
    for levels in (2, 10):
        score = {"type": "score", "instructions": "x", "criteria": ["l"] * levels}
        assert parse(one(score)).questions[0].options == tuple(str(i) for i in range(levels))
    many = {"state": "s", "questions": {f"q{i}": NOUL for i in range(4096)}}
    assert len(parse(many).questions) == 4096
    assert parse(one(choice), max_candidates=255).num_candidates == 255


def test_accepted_models():
    for model in (None, MODEL_ID, ALIAS, "open-jev", "jev-latest"):
        assert parse({"model": model, **one(NOUL)}).model == model
    assert parse(one(NOUL)).model is None


def test_unknown_fields_are_ignored():
    request = parse({**one({**NOUL, "extra": 1}), "stream": True})
    assert request.questions[0].kind == "noul"


@pytest.mark.parametrize("policy", ["off", "default", "shared", "fixed", "auto", None])
def test_prefix_policy(policy):
    assert parse({**one(NOUL), "prefix_policy": policy}).prefix_policy == policy


def test_question_is_a_frozen_record():
    question = parse(one(NOUL)).questions[0]
    assert question == Question("q", "noul", (), (), (question.prompts[0],))
    with pytest.raises(AttributeError):
        question.kind = "choice"


# --- one test per message ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "{",
        "",
        "[1,]",
        '{"state": "x",}',
        "{'state': 'x'}",
        '{"state": NaN, "questions": {}}',
        '{"state": {"x": Infinity}, "questions": {}}',
        '{"state": [-Infinity], "questions": {}}',
        '{"state": [1e400], "questions": {}}',
        '{"state": "x", "state": "y", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        '{"state": {"a": 1, "a": 2}, "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        '{"state": "\\ud800", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        '{"state": {"\\udfff": 1}, "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        '\ufeff{"state": "x", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        '{"state": "a\nb", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        b'{"state": "\xff", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
    ],
)
def test_invalid_json(body):
    with pytest.raises(ContractError) as caught:
        parse_request_json(body, accepted_models=ACCEPTED)
    assert caught.value.message == errors.INVALID_JSON


def test_valid_json_details():
    pair = parse_request_json(
        '{"state": "\\ud83d\\ude00 \\\\ud800", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
        accepted_models=ACCEPTED,
    )
    assert pair.questions[0].prompts[0].startswith("Context:\n\U0001f600 \\ud800\n")
    utf8 = parse_request_json(
        '{"state": "é", "questions": {"q": {"type": "noul", "instructions": "x"}}}'.encode(), accepted_models=ACCEPTED
    )
    assert utf8.questions[0].prompts[0].startswith("Context:\né\n")
    big = parse_request_json(
        '{"state": [123456789012345678901234567890, -0, 1.0, 1E2], '
        '"questions": {"q": {"type": "noul", "instructions": "x"}}}',
        accepted_models=ACCEPTED,
    )
    assert big.questions[0].prompts[0].startswith("Context:\n[123456789012345678901234567890, 0, 1.0, 100.0]\n")


def test_nesting_limit():
    def body(depth):
        return (
            '{"state": '
            + "[" * (depth - 1)
            + "]" * (depth - 1)
            + ', "questions": {"q": {"type": "noul", "instructions": "x"}}}'
        )

    assert parse_request_json(body(MAX_JSON_DEPTH), accepted_models=ACCEPTED)
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(ContractError) as caught:
            parse_request_json(body(depth), accepted_models=ACCEPTED)
        assert caught.value.message == errors.INVALID_JSON


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        {1: "x"},
        ("tuple",),
        b"bytes",
        {"\ud800": 1},
        "\udc00",
        {1.5},
    ],
)
def test_parsed_objects_get_the_same_value_checks(value):
    with pytest.raises(ContractError) as caught:
        check_json_value({"state": value})
    assert caught.value.message == errors.INVALID_JSON
    rejected({"state": value, "questions": {"q": NOUL}}, errors.INVALID_JSON)


def test_parsed_object_nesting_limit():
    deep: list = []
    for _ in range(MAX_JSON_DEPTH - 2):
        deep = [deep]  # with the request object: MAX_JSON_DEPTH containers
    assert parse({"state": deep, "questions": {"q": NOUL}})
    rejected({"state": [deep], "questions": {"q": NOUL}}, errors.INVALID_JSON)


@pytest.mark.parametrize("body", ["[]", "1", '"text"', "null", "true"])
def test_body_must_be_an_object(body):
    with pytest.raises(ContractError) as caught:
        parse_request_json(body, accepted_models=ACCEPTED)
    assert caught.value.message == errors.NOT_AN_OBJECT
    rejected(json.loads(body), errors.NOT_AN_OBJECT)


@pytest.mark.parametrize("model", ["other", "", "Open-Jev", 5, True, ["open-jev"], {}])
def test_requested_model_is_not_loaded(model):
    rejected({"model": model, **one(NOUL)}, "requested model is not loaded")


def test_request_requires_state():
    rejected({"questions": {"q": NOUL}}, "request requires state")


@pytest.mark.parametrize("state", [None, 12, 1.5, True, False])
def test_state_type(state):
    rejected({"state": state, "questions": {"q": NOUL}}, "state must be text, a JSON object, or an array")


@pytest.mark.parametrize("questions", [[], ["q"], "q", None, 1, "missing"])
def test_questions_must_be_an_object(questions):
    body = {"state": "s"} if questions == "missing" else {"state": "s", "questions": questions}
    rejected(body, "questions must be an object")


def test_questions_count():
    message = "questions must be nonempty and within the server question limit"
    rejected({"state": "s", "questions": {}}, message)
    rejected({"state": "s", "questions": {f"q{i}": NOUL for i in range(4097)}}, message)
    rejected({"state": "s", "questions": {"a": NOUL, "b": NOUL}}, message, max_questions=1)


@pytest.mark.parametrize("definition", [None, "noul", ["noul"], 3])
def test_question_definition_must_be_an_object(definition):
    rejected(one(definition), "question definition must be an object")


@pytest.mark.parametrize(
    "question",
    [
        {"type": "noul"},
        {"type": "noul", "instructions": None},
        {"type": "noul", "instructions": 3},
        {"type": "noul", "instructions": True},
        {"type": "bogus"},  # instructions are checked before the type
        {"instructions": 1.5},
        {"type": "choice", "instructions": "x", "criteria": {"a": "fine", "b": 4}},
        {"type": "choice", "instructions": "x", "criteria": {"a": False}},
        {"type": "score", "instructions": "x", "criteria": ["low", None]},
        {"type": "score", "instructions": "x", "criteria": [0, 1, 2]},
        {"type": "noul", "instructions": "x", "criteria": {"true": None, "false": "no"}},
        {"type": "noul", "instructions": "x", "criteria": {"true": "yes", "false": 0}},
    ],
)
def test_instructions_and_descriptions_type(question):
    rejected(one(question), "instructions and descriptions must be text, an object, or an array")


@pytest.mark.parametrize("criteria", ["missing", None, ["a", "b"], "a", 3])
def test_choice_requires_an_object(criteria):
    question = {"type": "choice", "instructions": "x"}
    if criteria != "missing":
        question["criteria"] = criteria
    rejected(one(question), "Choice requires an object")


@pytest.mark.parametrize("size", [0, 256])
def test_choice_candidate_count(size):
    question = {"type": "choice", "instructions": "x", "criteria": {f"k{i}": None for i in range(size)}}
    rejected(one(question), "Choice requires between 1 and 255 candidates")


def test_choice_count_is_checked_before_descriptions():
    criteria = {f"k{i}": 5 for i in range(256)}
    rejected(
        one({"type": "choice", "instructions": "x", "criteria": criteria}),
        "Choice requires between 1 and 255 candidates",
    )


@pytest.mark.parametrize("criteria", ["missing", None, {"0": "low"}, "low", 2])
def test_score_requires_an_array(criteria):
    question = {"type": "score", "instructions": "x"}
    if criteria != "missing":
        question["criteria"] = criteria
    rejected(one(question), "Score requires an array")


@pytest.mark.parametrize("levels", [0, 1, 11])
def test_score_level_count(levels):
    rejected(
        one({"type": "score", "instructions": "x", "criteria": ["l"] * levels}),
        "Score requires 2 to 10 descriptive levels",
    )


@pytest.mark.parametrize(
    "criteria",
    [
        {"true": "yes"},
        {"false": "no"},
        {},
        {"true": "yes", "false": "no", "maybe": "?"},
        {"True": "yes", "false": "no"},
        ["yes", "no"],
        "yes",
        0,
        False,
    ],
)
def test_noul_criteria(criteria):
    rejected(
        one({"type": "noul", "instructions": "x", "criteria": criteria}),
        "Noul criteria must contain true and false descriptions",
    )


def test_noul_criteria_null_means_none():
    with_null = parse(one({"type": "noul", "instructions": "x", "criteria": None}))
    without = parse(one({"type": "noul", "instructions": "x"}))
    assert with_null.questions[0].prompts == without.questions[0].prompts


@pytest.mark.parametrize("kind", ["missing", None, "generation", "Choice", "boolean", 1, ["noul"]])
def test_question_type(kind):
    question = {"instructions": "x", "criteria": {"a": None}}
    if kind != "missing":
        question["type"] = kind
    rejected(one(question), "question type must be choice, score, or noul")


def test_candidate_limit_counts_every_candidate_of_the_request():
    choice = {"type": "choice", "instructions": "x", "criteria": {"a": None, "b": None}}
    body = {"state": "s", "questions": {"c": choice, "n": NOUL}}
    assert parse(body, max_candidates=3).num_candidates == 3
    rejected(body, "request exceeds the candidate limit", max_candidates=2)


def test_default_candidate_limit_is_65536():
    choice = {"type": "choice", "instructions": "x", "criteria": {str(i): None for i in range(255)}}
    questions = {f"q{i}": choice for i in range(257)}  # 65,535 candidates
    assert parse({"state": "s", "questions": questions}).num_candidates == 65535
    questions["last"] = {"type": "score", "instructions": "x", "criteria": ["a", "b"]}
    rejected({"state": "s", "questions": questions}, "request exceeds the candidate limit")


@pytest.mark.parametrize("policy", ["OFF", "none", "", 1, True, ["off"]])
def test_prefix_policy_values(policy):
    rejected({**one(NOUL), "prefix_policy": policy}, "prefix_policy must be off, default, shared, fixed or auto")


# --- order ------------------------------------------------------------------------------------


def test_order_of_the_request_level_checks():
    rejected({"model": "other"}, errors.MODEL_NOT_LOADED)
    rejected({"model": "other", "questions": []}, errors.MODEL_NOT_LOADED)
    rejected({"questions": []}, errors.STATE_REQUIRED)
    rejected({"state": None, "questions": []}, errors.STATE_TYPE)
    rejected({"state": "s", "questions": []}, errors.QUESTIONS_TYPE)
    rejected({"state": "s", "questions": {}, "prefix_policy": "bad"}, errors.QUESTIONS_COUNT)


def test_questions_are_checked_in_order():
    body = {
        "state": "s",
        "questions": {
            "ok": NOUL,
            "bad_type": {"type": "x", "instructions": "x"},
            "bad_definition": None,
        },
    }
    rejected(body, errors.QUESTION_TYPE)


def test_within_a_question_instructions_then_type_then_criteria():
    rejected(one({"type": "x", "criteria": 5}), errors.DESCRIPTION_TYPE)
    rejected(one({"type": "x", "instructions": "x", "criteria": 5}), errors.QUESTION_TYPE)
    rejected(one({"type": "choice", "instructions": 5, "criteria": 5}), errors.DESCRIPTION_TYPE)
    rejected(one({"type": "score", "instructions": "x", "criteria": [None]}), errors.SCORE_COUNT)


def test_candidate_limit_is_checked_after_each_question():
    # Like the reference: once the running count is over the limit, later questions are not
    # looked at; a malformed question before that point is reported first.
    choice = {"type": "choice", "instructions": "x", "criteria": {"a": None, "b": None}}
    rejected({"state": "s", "questions": {"c": choice, "bad": None}}, errors.CANDIDATE_LIMIT, max_candidates=1)
    rejected({"state": "s", "questions": {"bad": None, "c": choice}}, errors.QUESTION_DEFINITION, max_candidates=1)


def test_prefix_policy_is_checked_after_the_reference_checks():
    rejected({**one({"type": "x", "instructions": "x"}), "prefix_policy": "bad"}, errors.QUESTION_TYPE)
    rejected({**one(NOUL), "prefix_policy": "bad"}, errors.CANDIDATE_LIMIT, max_candidates=0)
    rejected({"model": "other", **one(NOUL), "prefix_policy": "bad"}, errors.MODEL_NOT_LOADED)


def test_invalid_json_wins_over_everything():
    with pytest.raises(ContractError) as caught:
        parse_request_json('{"model": "other", "state": NaN}', accepted_models=ACCEPTED)
    assert caught.value.message == errors.INVALID_JSON


def test_subclasses_of_json_types_are_accepted():
    from collections import OrderedDict
    from enum import IntEnum

    class Level(IntEnum):
        LOW = 1

    request = parse(OrderedDict(state=OrderedDict(b=Level.LOW, a=[True, None, 2.5]), questions={"q": NOUL}))
    assert request.questions[0].prompts[0].startswith('Context:\n{"a": [true, null, 2.5], "b": 1}\n')


# --- edges: body decoding, value checks, check order, rendered size (docs/contract.md's values) ---

INVALID_JSON = "request body must be valid JSON"


def rejected_body(body, message: str, **kw) -> None:
    with pytest.raises(ContractError, match=f"^{re.escape(message)}$"):
        parse_request_json(body, accepted_models=ACCEPTED, **kw)


def test_bytes_carrying_an_encoded_surrogate_are_not_utf8():
    # ED A0 80 would decode to U+D800 under "surrogatepass"; strict UTF-8 has no surrogates
    body = b'{"state": "\xed\xa0\x80", "questions": {"q": {"type": "noul", "instructions": "x"}}}'
    rejected_body(body, INVALID_JSON)
    rejected_body(bytearray(body), INVALID_JSON)


def test_a_str_body_holding_a_lone_surrogate_is_invalid():
    # the character itself, not an escape: no UTF-8 body can carry it
    rejected_body('{"state": "a\ud800", "questions": {"q": {"type": "noul", "instructions": "x"}}}', INVALID_JSON)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_bytes_like_bodies_are_decoded_as_utf8(kind):
    text = '{"state": "é ☃", "questions": {"q": {"type": "noul", "instructions": "x"}}}'
    request = parse_request_json(kind(text.encode()), accepted_models=ACCEPTED)
    assert request == parse_request_json(text, accepted_models=ACCEPTED)
    assert request.state_text == "é ☃"
    rejected_body(kind(b'{"state": "\xff", "questions": {}}'), INVALID_JSON)


def deep_body(depth: int, escape: bool) -> str:
    """A body `depth` containers deep with exactly `depth` brackets, every one in one chain."""
    state = '"\\ud83d\\ude00"' if escape else '"s"'  # an escape sends the body to the full value check
    nested = depth - 3  # the body, "questions" and "q" are the other three
    return (
        f'{{"state": {state}, "questions": {{"q": {{"type": "noul", "instructions": {"[" * nested}{"]" * nested}}}}}}}'
    )


@pytest.mark.parametrize("escape", [False, True], ids=["bracket_count_shortcut", "full_check"])
def test_nesting_limit_is_127_containers(escape):
    # docs/contract.md: nesting deeper than 127 containers is invalid JSON (the reference's parser)
    accepted, refused = deep_body(127, escape), deep_body(128, escape)
    assert accepted.count("[") + accepted.count("{") == 127
    assert refused.count("[") + refused.count("{") == 128
    assert parse_request_json(accepted, accepted_models=ACCEPTED).num_candidates == 1
    rejected_body(refused, INVALID_JSON)
    assert parse(json.loads(accepted)).num_candidates == 1
    rejected(json.loads(refused), INVALID_JSON)


@pytest.mark.parametrize("value", [math.nan, math.inf, "\ud800"], ids=["nan", "inf", "lone_surrogate"])
def test_a_bare_value_gets_the_value_checks_before_the_object_check(value):
    rejected(value, INVALID_JSON)


class _Text(str):
    pass


class _Number(float):
    pass


class _Items(list):
    pass


@pytest.mark.parametrize(
    "state",
    [
        _Text("\udc00"),
        ["ok", _Text("\udc00")],
        OrderedDict(a=math.nan),
        {"k": OrderedDict(a=[math.inf])},
        _Items([math.nan]),
        [_Items(["\ud800"])],
        [_Number("nan")],
        {"k": _Number("-inf")},
    ],
    ids=["str", "str_in_list", "ordereddict", "nested_ordereddict", "list", "nested_list", "float", "float_in_dict"],
)
def test_subclasses_of_json_types_get_the_value_checks(state):
    rejected({"state": state, "questions": {"q": NOUL}}, INVALID_JSON)


def test_an_integer_past_the_digit_limit_passes_the_full_value_check():
    # the escaped pair sends the body through check_json_value, which must accept the kept digits
    digits = "9" * 5000  # over Python's default 4,300-digit conversion limit
    body = f'{{"state": ["\\ud83d\\ude00", {digits}], "questions": {{"q": {{"type": "noul", "instructions": "x"}}}}}}'
    request = parse_request_json(body, accepted_models=ACCEPTED)
    assert request.state_text == f'["\U0001f600", {digits}]'


@pytest.mark.parametrize(
    "criteria",
    [{"true": "yes", "maybe": "no"}, {"true": None}, {"true": 5, "maybe": "no"}],
    ids=["true_and_another_key", "true_null_alone", "bad_true_and_another_key"],
)
def test_noul_keys_are_checked_before_their_descriptions(criteria):
    rejected(
        one({"type": "noul", "instructions": "x", "criteria": criteria}),
        "Noul criteria must contain true and false descriptions",
    )


@pytest.mark.parametrize("criteria", [[], "", ["a"] * 256], ids=["empty_list", "empty_str", "long_list"])
def test_choice_object_is_checked_before_the_count(criteria):
    rejected(one({"type": "choice", "instructions": "x", "criteria": criteria}), "Choice requires an object")


RENDERED_LIMIT = "request exceeds the rendered size limit"
SIZED = {
    "state": "État ☃",
    "questions": {
        "c": {"type": "choice", "instructions": "Lequel?", "criteria": {"é": None, "b": "ü", "c": {"k": "😀"}}},
        "n": {"type": "noul", "instructions": "Oui?"},
    },
}


def sized_bytes() -> int:
    """The UTF-8 bytes of SIZED's prompts, counted from the prompts themselves."""
    return sum(len(p.encode("utf-8")) for q in parse(SIZED).questions for p in q.prompts)


def test_default_rendered_size_limit_is_64_mib():
    assert MAX_RENDERED_BYTES == 64 * 1024 * 1024  # docs/contract.md, check 13a: --max-rendered-bytes (64 MiB)


def test_rendered_size_limit_is_inclusive_for_parsed_objects_and_bodies():
    size = sized_bytes()
    assert parse(SIZED, max_rendered_bytes=size).rendered_bytes == size
    rejected(SIZED, RENDERED_LIMIT, max_rendered_bytes=size - 1)
    body = json.dumps(SIZED)
    assert parse_request_json(body, accepted_models=ACCEPTED, max_rendered_bytes=size).rendered_bytes == size
    rejected_body(body, RENDERED_LIMIT, max_rendered_bytes=size - 1)


def test_rendered_size_limit_counts_the_chat_template_once_per_candidate():
    template = len((DEFAULT_CHAT_PREFIX + DEFAULT_CHAT_SUFFIX).encode("utf-8"))
    limit = sized_bytes() + 4 * template  # four candidates: three choice, one noul
    body = json.dumps(SIZED)
    assert parse_request_json(body, accepted_models=ACCEPTED, max_rendered_bytes=limit, chat_template_bytes=template)
    rejected_body(body, RENDERED_LIMIT, max_rendered_bytes=limit - 1, chat_template_bytes=template)


def test_prefix_policy_is_checked_before_the_rendered_size():
    rejected(
        {**SIZED, "prefix_policy": "bad"},
        "prefix_policy must be off, default, shared, fixed or auto",
        max_rendered_bytes=1,
    )


@pytest.mark.parametrize(
    ("question_type", "criteria"), [("choice", {"a": None, "b": None}), ("score", ["x", "y"]), ("noul", None)]
)
def test_prompts_never_equal_a_sequence_of_another_length(question_type, criteria):
    body = {"state": "s", "questions": {"q": {"type": question_type, "instructions": "i", "criteria": criteria}}}
    prompts = parse_request(body, accepted_models=()).questions[0].prompts
    as_list = list(prompts)
    assert prompts == as_list
    assert (prompts == as_list[:-1]) is False
    assert (prompts == [*as_list, as_list[-1]]) is False
    assert prompts != as_list[:-1]
