"""The one error type of the request contract, and its exact messages.

Every rejection of a request is a `ContractError` whose `.message` is the exact text the reference
service (Open-Jev `POST /v1/systemone`) returns; the gRPC layer maps it to `INVALID_ARGUMENT`.
The messages are constants here so that the validators, the servicer and the tests share one
spelling.
"""

from __future__ import annotations


class ContractError(ValueError):
    """A request the contract rejects; `.message` is the exact contract message."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# Body (before any contract check; see openjev.contract.request.parse_request_json).
INVALID_JSON = "request body must be valid JSON"
NOT_AN_OBJECT = "request body must be a JSON object"

# The contract's messages (docs/contract.md, "Validation"), in the order they are checked.
MODEL_NOT_LOADED = "requested model is not loaded"
STATE_REQUIRED = "request requires state"
STATE_TYPE = "state must be text, a JSON object, or an array"
QUESTIONS_TYPE = "questions must be an object"
QUESTIONS_COUNT = "questions must be nonempty and within the server question limit"
QUESTION_DEFINITION = "question definition must be an object"
DESCRIPTION_TYPE = "instructions and descriptions must be text, an object, or an array"
CHOICE_OBJECT = "Choice requires an object"
CHOICE_COUNT = "Choice requires between 1 and 255 candidates"
SCORE_ARRAY = "Score requires an array"
SCORE_COUNT = "Score requires 2 to 10 descriptive levels"
NOUL_CRITERIA = "Noul criteria must contain true and false descriptions"
QUESTION_TYPE = "question type must be choice, score, or noul"
CANDIDATE_LIMIT = "request exceeds the candidate limit"

# Our extension field (not in the reference): checked after every reference check.
PREFIX_POLICY = "prefix_policy must be off, default, shared, fixed or auto"

# Our total-work bounds (docs/reliability.md), checked after every contract check above: the
# rendered size before tokenization, then the submitted tokens while tokenizing (in candidate
# order, beside the max_length check).
RENDERED_LIMIT = "request exceeds the rendered size limit"
TOKEN_LIMIT = "request exceeds the token limit"


# A question id in a message is cut to this many characters ("..." after them): gRPC carries the
# message in a header, percent-encoded (up to 9 bytes a character), refused over 16 KiB, so a
# longer id turned the refusal into RESOURCE_EXHAUSTED ("retry later") on gRPC alone.
MAX_ID_CHARS_IN_MESSAGE = 256


def too_many_bytes_message(question_id: str, num_bytes: int, max_length: int) -> str:
    """A candidate whose prompt is too long to tokenize at all: its bytes (NFC) over max_length
    times the longest token's (so more than max_length tokens whatever they are)."""
    if len(question_id) > MAX_ID_CHARS_IN_MESSAGE:
        question_id = question_id[:MAX_ID_CHARS_IN_MESSAGE] + "..."
    return (
        f"question {question_id}: {num_bytes} bytes of prompt, more tokens than max_length={max_length}; "
        "no silent truncation"
    )


def too_long_message(question_id: str, num_tokens: int, max_length: int) -> str:
    """The tokenization-stage message for a candidate longer than the model's max_length."""
    if len(question_id) > MAX_ID_CHARS_IN_MESSAGE:
        question_id = question_id[:MAX_ID_CHARS_IN_MESSAGE] + "..."
    return f"question {question_id}: {num_tokens} tokens exceeds max_length={max_length}; no silent truncation"
