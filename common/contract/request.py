"""The request contract (docs/contract.md): validate a request and compile it into candidate prompts.

`parse_request` follows the reference service check for check (ThinkFlowLab/system1-omni,
`contract::compile`, adapted from Open-Jev @ 3308a15): it stops at the first error and raises
`ContractError` with the reference's exact message. Decisions, each taken from the reference
unless marked otherwise:

Body (`parse_request_json`):
- Malformed JSON, invalid UTF-8, a UTF-8 BOM, `NaN`/`Infinity`/`-Infinity`, a number that
  overflows to infinity (`1e400`), a key repeated in one object, a lone UTF-16 surrogate escape
  (`"\\ud800"`) and nesting deeper than 127 containers are all "request body must be valid JSON"
  (the reference parser rejects each of them; Python's `json` would accept most). A body that is
  valid JSON but not an object is "request body must be a JSON object" (the reference's parser
  message). `parse_request` applies the same value checks to an already-parsed object, so a
  caller handing in a dict (a protobuf Struct, say) cannot get past them either.

Checks, in this order:
1. `model`: absent or null is fine; otherwise it must be a string among `accepted_models`,
   `open-jev` or `jev-latest` (those two are always accepted). Any other value, including a
   non-string, is "requested model is not loaded".
2. `state` missing: "request requires state". Present but not a string, object or array
   (null included): "state must be text, a JSON object, or an array".
3. `questions` missing or not an object: "questions must be an object"; 0 or more than
   `max_questions` entries: "questions must be nonempty and within the server question limit".
4. Per question, in the object's order:
   a. the definition must be an object;
   b. `instructions` must be a string, object or array (missing and null fail) -- before the
      type is looked at;
   c. `type` must be the string "choice", "score" or "noul", else "question type must be
      choice, score, or noul" (after the instructions check, before any criteria check);
   d. choice: `criteria` must be an object (missing/null: "Choice requires an object") with
      1..255 entries; then, in order, each value is either null (the option is the bare key)
      or a description: a string, object or array. Any other value (number, boolean) is
      "instructions and descriptions must be text, an object, or an array";
   e. score: `criteria` must be an array (missing/null: "Score requires an array") of 2..10
      levels; every level is a description (string, object or array); null or a number as a
      level is the descriptions error. The legend keeps each raw level;
   f. noul: `criteria` absent or null means no descriptions. Anything else must be an object
      with exactly the two keys "true" and "false" (else "Noul criteria must contain true and
      false descriptions"); both values are descriptions (the "true" one is checked first), so
      a null description is the descriptions error, not the noul error;
   g. the running candidate count (every candidate of this and earlier questions; a noul
      question is one) must not exceed `max_candidates`: "request exceeds the candidate limit".
      Like the reference, this is checked after each question, so a request already over the
      limit reports the limit even if a later question is malformed.
5. `prefix_policy` (our extension; the reference ignores unknown fields): absent or null is
   the server default (None); otherwise one of off, default, shared, fixed, auto. It is checked
   after every reference check so that any request the reference rejects gets the reference's
   message.
6. Our total-work bound: the UTF-8 bytes of every candidate prompt together (chat template
   included) must not exceed `max_rendered_bytes`: "request exceeds the rendered size limit".
   Computed without rendering a prompt, after every check above (so a request the reference
   rejects at one of them keeps the reference's message) and before tokenization: a request over
   this bound that the reference would refuse at tokenization gets this message instead of the
   reference's, whose token count only tokenizing its megabytes would give.
Tokenization (the last check, "question {id}: {n} tokens exceeds max_length=...") happens in
`openjev.frontend.batches`. Other unknown fields are ignored, as the reference does.

Rendering (see `openjev.contract.render`): strings are used as is, other values as Python's
`json.dumps(sort_keys=True, ensure_ascii=False)`. The state is rendered once per request, and
prompts are built only when read (`openjev.contract.prompts`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openjev.contract import errors
from openjev.contract.errors import ContractError
from openjev.contract.literals import PrefixPolicy, QuestionKind, is_prefix_policy
from openjev.contract.prompts import Prompts, utf8_size
from openjev.contract.render import BigInt, parse_int, render_value

ALWAYS_ACCEPTED_MODELS = ("open-jev", "jev-latest")
MAX_QUESTIONS = 4096
MAX_CANDIDATES = 65536
MAX_CHOICE_CANDIDATES = 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10
MAX_JSON_DEPTH = 127  # nested containers; the reference parser's limit
# Our total-work bound (not in the reference): the UTF-8 bytes of every candidate prompt
# together, chat template included, computed without rendering them (docs/reliability.md).
MAX_RENDERED_BYTES = 64 * 1024 * 1024

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Question:
    """One compiled question.

    options: the answer keys in order: choice criteria keys; score "0".."n-1"; noul ().
    legend: score only, the raw levels (JSON values) in order; else ().
    prompts: one per candidate (noul: exactly one), stripped, not chat-wrapped; rendered when
        read (`openjev.contract.prompts`), so a request holds one copy of its state.
    """

    id: str
    kind: QuestionKind
    options: tuple[str, ...]
    legend: tuple[Any, ...]
    prompts: Sequence[str]


@dataclass(frozen=True)
class DecisionRequest:
    """A validated request: `model` as sent (None when absent or null), questions in order.
    rendered_bytes: UTF-8 bytes of every candidate prompt, chat template excluded.
    state_text: the rendered state every prompt starts with (the frontend routes by it)."""

    model: str | None
    questions: tuple[Question, ...]
    prefix_policy: PrefixPolicy | None
    rendered_bytes: int = 0
    state_text: str = field(default="", repr=False, compare=False)

    @property
    def num_candidates(self) -> int:
        return sum(len(q.prompts) for q in self.questions)


def parse_request_json(text: str | bytes, **kw: Any) -> DecisionRequest:
    """JSON text (or UTF-8 bytes) -> `parse_request(**kw)`; see the module docstring for what
    counts as invalid JSON."""
    return _compile(decode_request_json(text), **kw)


def decode_request_json(text: str | bytes) -> Any:
    """Decode a request body as strictly as the reference parser (module docstring, "Body")."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")  # strict: no surrogates can come out of this
        except UnicodeDecodeError:
            raise ContractError(errors.INVALID_JSON) from None
    elif not text.isascii() and _SURROGATE.search(text):
        raise ContractError(errors.INVALID_JSON)  # a str that no UTF-8 body can encode
    try:
        value = json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=parse_int,
        )
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise ContractError(errors.INVALID_JSON) from None
    # The decoder already refused every other non-JSON value. Only an escape can produce a lone
    # surrogate, and only text with enough brackets can nest too deeply: look further only then.
    if _SURROGATE_ESCAPE.search(text):
        check_json_value(value)
    elif text.count("[") + text.count("{") > MAX_JSON_DEPTH and _too_deep(value):
        raise ContractError(errors.INVALID_JSON)
    return value


def parse_request(
    obj: Any,
    *,
    accepted_models: Collection[str],
    max_questions: int = MAX_QUESTIONS,
    max_candidates: int = MAX_CANDIDATES,
    max_rendered_bytes: int | None = None,
) -> DecisionRequest:
    """Validate an already-parsed request (dicts keep key order) and compile its prompts."""
    check_json_value(obj)
    return _compile(
        obj,
        accepted_models=accepted_models,
        max_questions=max_questions,
        max_candidates=max_candidates,
        max_rendered_bytes=max_rendered_bytes,
    )


def check_json_value(value: Any) -> None:
    """Raise "request body must be valid JSON" unless `value` is what strict JSON decodes to:
    dicts with str keys, lists, str without lone surrogates, int, finite float, bool, None,
    nested at most MAX_JSON_DEPTH containers deep."""
    level = [value]  # breadth first: `level` holds the values at one depth, 1 to MAX_JSON_DEPTH
    for _ in range(MAX_JSON_DEPTH):
        strings: list = []
        containers: list = []
        children: Iterable[Any]
        for item in level:
            if isinstance(item, dict):
                strings.extend(item)
                children = item.values()
            elif isinstance(item, list):
                children = item
            else:
                children = (item,)
            for child in children:
                kind = type(child)
                if kind is str:
                    strings.append(child)
                elif kind is dict or kind is list:
                    containers.append(child)
                elif kind is float:
                    if not math.isfinite(child):
                        raise ContractError(errors.INVALID_JSON)
                elif not (child is None or kind is int or kind is bool):
                    _check_other(child, strings, containers)
        for text in strings:
            if not isinstance(text, str) or (not text.isascii() and _SURROGATE.search(text)):
                raise ContractError(errors.INVALID_JSON)
        if not containers:
            return
        level = containers
    raise ContractError(errors.INVALID_JSON)  # nested deeper than MAX_JSON_DEPTH


def _check_other(child: Any, strings: list, containers: list) -> None:
    """Subclasses of the JSON types (OrderedDict, an int enum, ...) are fine; nothing else is."""
    if isinstance(child, str):
        strings.append(child)
    elif isinstance(child, (dict, list)):
        containers.append(child)
    elif isinstance(child, float):
        if not math.isfinite(child):
            raise ContractError(errors.INVALID_JSON)
    elif not isinstance(child, (int, BigInt)):
        raise ContractError(errors.INVALID_JSON)


def _too_deep(value: Any) -> bool:
    """Whether decoded JSON nests more than MAX_JSON_DEPTH containers (containers only)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(MAX_JSON_DEPTH):
        if not level:
            return False
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) is dict or type(child) is list
        ]
    return bool(level)


def _compile(
    obj: Any,
    *,
    accepted_models: Collection[str],
    max_questions: int = MAX_QUESTIONS,
    max_candidates: int = MAX_CANDIDATES,
    max_rendered_bytes: int | None = None,
    chat_template_bytes: int = 0,
) -> DecisionRequest:
    if not isinstance(obj, dict):
        raise ContractError(errors.NOT_AN_OBJECT)
    model = obj.get("model")
    if model is not None and not (
        isinstance(model, str) and (model in accepted_models or model in ALWAYS_ACCEPTED_MODELS)
    ):
        raise ContractError(errors.MODEL_NOT_LOADED)
    if "state" not in obj:
        raise ContractError(errors.STATE_REQUIRED)
    state = obj["state"]
    if not isinstance(state, (str, dict, list)):
        raise ContractError(errors.STATE_TYPE)
    definitions = obj.get("questions")
    if not isinstance(definitions, dict):
        raise ContractError(errors.QUESTIONS_TYPE)
    if not 1 <= len(definitions) <= max_questions:
        raise ContractError(errors.QUESTIONS_COUNT)

    state_text = render_value(state)
    questions = []
    num_candidates = 0
    for question_id, definition in definitions.items():
        question = _compile_question(question_id, definition, state_text)
        num_candidates += len(question.prompts)
        if num_candidates > max_candidates:
            raise ContractError(errors.CANDIDATE_LIMIT)
        questions.append(question)

    prefix_policy = obj.get("prefix_policy")
    if prefix_policy is not None and not is_prefix_policy(prefix_policy):
        raise ContractError(errors.PREFIX_POLICY)
    state_bytes = utf8_size(state_text)
    rendered = sum(q.prompts.rendered_bytes(state_bytes) for q in questions)  # type: ignore[attr-defined]
    if max_rendered_bytes is not None and rendered + chat_template_bytes * num_candidates > max_rendered_bytes:
        raise ContractError(errors.RENDERED_LIMIT)
    return DecisionRequest(
        model=model,
        questions=tuple(questions),
        prefix_policy=prefix_policy,
        rendered_bytes=rendered,
        state_text=state_text,
    )


def _compile_question(question_id: str, definition: Any, state_text: str) -> Question:
    if not isinstance(definition, dict):
        raise ContractError(errors.QUESTION_DEFINITION)
    instructions = _description(definition.get("instructions"))
    criteria = definition.get("criteria")
    kind = definition.get("type")
    legend: tuple[Any, ...] = ()
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise ContractError(errors.CHOICE_OBJECT)
        if not 1 <= len(criteria) <= MAX_CHOICE_CANDIDATES:
            raise ContractError(errors.CHOICE_COUNT)
        keys = tuple(criteria)
        rendered = [key if value is None else f"{key}: {_description(value)}" for key, value in criteria.items()]
    elif kind == "score":
        if not isinstance(criteria, list):
            raise ContractError(errors.SCORE_ARRAY)
        if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
            raise ContractError(errors.SCORE_COUNT)
        keys = tuple(str(i) for i in range(len(criteria)))
        rendered = [_description(level) for level in criteria]
        legend = tuple(criteria)
    elif kind == "noul":
        if criteria is not None:
            if not (isinstance(criteria, dict) and len(criteria) == 2 and "true" in criteria and "false" in criteria):
                raise ContractError(errors.NOUL_CRITERIA)
            yes = _description(criteria["true"])
            no = _description(criteria["false"])
            instructions += f"\nYes means: {yes}\nNo means: {no}"
        return Question(question_id, "noul", (), (), Prompts(state_text, instructions, None))
    else:
        raise ContractError(errors.QUESTION_TYPE)
    return Question(question_id, kind, keys, legend, Prompts(state_text, instructions, rendered))


def _description(value: Any) -> str:
    if not isinstance(value, (str, dict, list)):
        raise ContractError(errors.DESCRIPTION_TYPE)
    return render_value(value)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value
