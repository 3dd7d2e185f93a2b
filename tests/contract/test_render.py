"""Rendering edge cases: JSON values exactly as Python's json.dumps(sort_keys, ensure_ascii=False)."""

from __future__ import annotations

import json
import sys

import pytest

from openjev.contract.render import (
    DEFAULT_CHAT_PREFIX,
    DEFAULT_CHAT_SUFFIX,
    BigInt,
    candidate_prompt,
    chat_wrap,
    dumps_exact,
    noul_prompt,
    parse_int,
    prompt_head,
    render_value,
)
from openjev.contract.request import decode_request_json


@pytest.mark.parametrize(
    "value,text",
    [
        ("plain text", "plain text"),
        ("", ""),
        ("  keeps  whitespace\n", "  keeps  whitespace\n"),
        ('{"a": 1}', '{"a": 1}'),  # a string is never re-rendered
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (-0.0, "-0.0"),
        (0.0, "0.0"),
        (1e-05, "1e-05"),
        (0.0001, "0.0001"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1.5e300, "1.5e+300"),
        (12345678901234567890, "12345678901234567890"),
        (-7, "-7"),
        (True, "true"),
        (False, "false"),
        (None, "null"),
        ([], "[]"),
        ({}, "{}"),
        ([1, "two", None, 3.0], '[1, "two", null, 3.0]'),
        ({"b": 1, "a": 2}, '{"a": 2, "b": 1}'),
        ({"z": {"y": 1, "x": [{"d": 0, "c": 1}]}, "a": []}, '{"a": [], "z": {"x": [{"c": 1, "d": 0}], "y": 1}}'),
        ({"é": "ü", "e": "日本"}, '{"e": "日本", "é": "ü"}'),  # sorted by code point, kept as is
        (["\U0001f600"], '["\U0001f600"]'),
        (['a"b\\c\nd\te\x01'], '["a\\"b\\\\c\\nd\\te\\u0001"]'),
        (["\u2028\x7f"], '["\u2028\x7f"]'),
        ({"B": 1, "a": 2, "_": 3, "1": 4}, '{"1": 4, "B": 1, "_": 3, "a": 2}'),
    ],
)
def test_render_value(value, text):
    assert render_value(value) == text


def test_prompt_pieces():
    head = prompt_head("state", "instructions")
    assert head == "Context:\nstate\n\nQuestion: instructions\n"
    assert candidate_prompt(head, "k: v") == (
        "Context:\nstate\n\nQuestion: instructions\nProposed answer: k: v\n"
        "Is this proposed answer correct? Answer Yes or No."
    )
    assert noul_prompt(head) == (
        "Context:\nstate\n\nQuestion: instructions\nIs the answer to this question yes? Answer Yes or No."
    )


def test_prompts_are_stripped_but_only_at_the_ends():
    head = prompt_head("  state  ", "  q  ")
    assert candidate_prompt(head, " {x} ").startswith("Context:\n  state  \n\nQuestion:   q  \n")
    assert "Proposed answer:  {x} \n" in candidate_prompt(head, " {x} ")


def test_chat_wrap():
    assert chat_wrap("p", DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX) == (
        "<|im_start|>user\np<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert chat_wrap("p", "[", "]") == "[p]"


def test_integers_past_pythons_digit_limit_render_exactly_and_in_one_pass():
    """Integers json cannot convert (over 4,300 digits) keep their digits. Each used to be put
    back with a replace over the whole text: 4,000 of them in one state took 35 s of a
    frontend's core (quadratic), now milliseconds; this checks the digits, in order and nested."""
    huge = [str(i) * 4301 for i in range(1, 10)] + ["-" + "7" * 4400]
    body = json.dumps({"b": [1, {"x": None}], "a": "text"})[:-1] + ', "z": [' + ", ".join(huge * 300) + "]}"
    value = json.loads(body, parse_int=parse_int)
    assert render_value(value) == '{"a": "text", "b": [1, {"x": null}], "z": [' + ", ".join(huge * 300) + "]}"
    assert dumps_exact(value["z"][:2], sort_keys=False, indent=1) == "[\n " + huge[0] + ",\n " + huge[1] + "\n]"


DIGIT_LIMIT = sys.get_int_max_str_digits()  # Python's int <-> str limit (4,300 by default)


@pytest.mark.parametrize("digits", ["1" * DIGIT_LIMIT, "-" + "9" * DIGIT_LIMIT])
def test_integers_within_pythons_digit_limit_decode_as_int(digits):
    """Only an integer past the limit is a BigInt; one Python can convert (sign not counted) is an int."""
    assert type(parse_int(digits)) is int
    value = decode_request_json('{"n": ' + digits + "}")["n"]
    assert type(value) is int
    assert value == int(digits)


def test_integers_past_the_limit_compare_by_their_digits():
    one, two = "1" * (DIGIT_LIMIT + 1), "2" * (DIGIT_LIMIT + 1)
    assert BigInt(one) == BigInt(one)
    assert BigInt(one) != BigInt(two)
    assert decode_request_json(f"[{one}]") == decode_request_json(f"[{one}]")
    assert decode_request_json(f"[{one}]") != decode_request_json(f"[{two}]")
