"""A question's prompts as a sequence, and `rendered_bytes` (what the rendered-size limit counts)
against the UTF-8 size of the prompts themselves."""

from __future__ import annotations

import pytest

from openjev.contract.request import parse_request

# Non-ASCII in one place at a time, so a count by characters anywhere shows up.
QUESTIONS = {
    "choice_options": {"type": "choice", "instructions": "Which?", "criteria": {"é": None, "b": "ü ☃", "c": ["😀"]}},
    "choice_instructions": {"type": "choice", "instructions": "Lequel? ☃", "criteria": {"a": None, "b": "B"}},
    "score_levels": {"type": "score", "instructions": "How?", "criteria": ["bas", "très haut", {"k": "😀"}]},
    "score_instructions": {"type": "score", "instructions": "Combien? 😀", "criteria": ["lo", "hi"]},
    "noul": {"type": "noul", "instructions": "Is it?"},
    "noul_instructions": {"type": "noul", "instructions": "Est-ce ☃?"},
    "noul_criteria": {"type": "noul", "instructions": "Is it?", "criteria": {"true": "oui ü", "false": ["non 😀"]}},
}


def utf8_bytes(prompts) -> int:
    return sum(len(prompt.encode("utf-8")) for prompt in prompts)


@pytest.mark.parametrize("state", ["plain", "État 😀"], ids=["ascii_state", "non_ascii_state"])
@pytest.mark.parametrize("question_id", list(QUESTIONS))
def test_rendered_bytes_are_the_utf8_bytes_of_the_prompts(question_id, state):
    request = parse_request({"state": state, "questions": {question_id: QUESTIONS[question_id]}}, accepted_models=())
    prompts = request.questions[0].prompts
    assert request.rendered_bytes == utf8_bytes(prompts)
    assert prompts.rendered_bytes(len(state.encode("utf-8"))) == utf8_bytes(prompts)


def test_rendered_bytes_of_a_request_sum_every_question():
    request = parse_request({"state": "État 😀", "questions": QUESTIONS}, accepted_models=())
    assert request.num_candidates == 3 + 2 + 3 + 2 + 1 + 1 + 1
    assert request.rendered_bytes == sum(utf8_bytes(q.prompts) for q in request.questions)


def test_a_noul_question_has_exactly_one_prompt():
    request = parse_request({"state": "s", "questions": {"q": QUESTIONS["noul"]}}, accepted_models=())
    prompts = request.questions[0].prompts
    only = "Context:\ns\n\nQuestion: Is it?\nIs the answer to this question yes? Answer Yes or No."
    assert len(prompts) == 1 and prompts[0] == prompts[-1] == only
    for index in (1, -2, 7):
        with pytest.raises(IndexError):
            prompts[index]
    assert list(prompts) == [prompts[0]] and prompts[0:5] == (prompts[0],)
