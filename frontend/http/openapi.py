"""The OpenAPI 3.1 document of the HTTP route, served at `GET /openapi.json`.

Written out by hand from the contract (DESIGN section 2, docs/contract.md) rather than derived
from code, so it says what a caller may send and get back; the schemathesis test holds the server
to it.
"""

from __future__ import annotations

import copy
from typing import Any

from openjev.contract.literals import PREFIX_POLICIES

_DESCRIPTION: dict[str, Any] = {"type": ["string", "object", "array"]}
_NUMBER_01 = {"type": "number", "minimum": 0, "maximum": 1}
_PROBABILITIES = {"type": "object", "additionalProperties": _NUMBER_01}


def _question(kind: str, criteria: dict[str, Any], *, required: bool) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", "instructions", *(["criteria"] if required else [])],
        "properties": {"type": {"const": kind}, "instructions": _DESCRIPTION, "criteria": criteria},
    }


def _answer(kind: str, properties: dict[str, Any]) -> dict[str, Any]:
    props = {"type": {"const": kind}, **properties}
    return {"type": "object", "required": list(props), "properties": props, "additionalProperties": False}


SCHEMAS: dict[str, Any] = {
    # One schema per type, so that what the document calls valid the server accepts.
    "Question": {
        "oneOf": [
            {"$ref": "#/components/schemas/ChoiceQuestion"},
            {"$ref": "#/components/schemas/ScoreQuestion"},
            {"$ref": "#/components/schemas/NoulQuestion"},
        ]
    },
    "ChoiceQuestion": _question(
        "choice",
        {
            "type": "object",
            "minProperties": 1,
            "maxProperties": 255,
            "description": "option -> null (the option is its key) or a description, in order",
            "additionalProperties": {"type": ["string", "object", "array", "null"]},
        },
        required=True,
    ),
    "ScoreQuestion": _question(
        "score",
        {"type": "array", "minItems": 2, "maxItems": 10, "items": _DESCRIPTION, "description": "levels, lowest first"},
        required=True,
    ),
    "NoulQuestion": _question(
        "noul",
        {
            "type": ["object", "null"],
            "required": ["true", "false"],
            "additionalProperties": False,
            "properties": {"true": _DESCRIPTION, "false": _DESCRIPTION},
            "description": "what yes and no mean (appended to the instructions)",
        },
        required=False,
    ),
    "DecideRequest": {
        "type": "object",
        "required": ["state", "questions"],
        "properties": {
            "model": {
                "type": ["string", "null"],
                "description": "absent, null, the model id or an alias",
            },  # enum set per server
            "state": _DESCRIPTION,
            "questions": {
                "type": "object",
                "minProperties": 1,  # maxProperties: the server's question limit
                "description": "question id -> question, answered in this order",
                "additionalProperties": {"$ref": "#/components/schemas/Question"},
            },
            "prefix_policy": {
                "type": ["string", "null"],
                "enum": [*PREFIX_POLICIES, None],
                "description": "this service's extension: which prompt prefixes may be computed once",
            },
        },
    },
    "Answer": {
        "oneOf": [
            _answer(
                "choice", {"choice": {"type": "string"}, "probabilities": _PROBABILITIES, "confidence": _NUMBER_01}
            ),
            _answer(
                "score",
                {
                    "score": {"type": "number", "minimum": 0},
                    "probabilities": _PROBABILITIES,
                    "confidence": _NUMBER_01,
                    "legend": {"type": "object"},
                },
            ),
            _answer("noul", {"noul": _NUMBER_01}),
        ]
    },
    "DecideResponse": {
        "type": "object",
        "required": ["model", "answers", "usage", "metadata"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string"},
            "answers": {"type": "object", "additionalProperties": {"$ref": "#/components/schemas/Answer"}},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {
                    "input_tokens": {"type": "integer", "minimum": 1},
                    "output_tokens": {"type": "integer", "const": 0},
                },
            },
            "metadata": {
                "type": "object",
                "required": [
                    "method",
                    "temperature",
                    "candidate_sequences",
                    "inference_seconds",
                    "max_length",
                    "prefix_cache",
                ],
                "properties": {
                    "method": {"type": "string"},
                    "temperature": {"type": "number", "exclusiveMinimum": 0},
                    "candidate_sequences": {"type": "integer", "minimum": 1},
                    "inference_seconds": {"type": "number", "minimum": 0},
                    "max_length": {"type": "integer", "minimum": 1},
                    "prefix_cache": {
                        "type": "object",
                        "required": ["policy", "enabled", "scope", "saved_tokens"],
                        "additionalProperties": False,
                        "properties": {
                            "policy": {"type": "string", "enum": list(PREFIX_POLICIES)},
                            "enabled": {"type": "boolean"},
                            "scope": {"type": "string", "enum": ["none", "within_question", "across_questions"]},
                            "saved_tokens": {"type": "integer", "minimum": 0},
                        },
                    },
                },
            },
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "for 422, the contract's exact message"}},
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string", "enum": ["SERVING", "NOT_SERVING"]}, "reason": {"type": "string"}},
    },
}

_REQUEST_ID_HEADER = {
    "description": "the caller's x-request-id, or the one the server made",
    "schema": {"type": "string"},
}

_ERRORS = {
    "400": "x-timeout-seconds is not a decimal number of seconds in (0, 86400], the request carries two "
    "content-type or x-timeout-seconds headers, or both content-length and transfer-encoding, or it is no "
    "HTTP request that parses",
    "401": "bearer token missing or unknown (only where the server is given tokens)",
    "408": "the body did not arrive within 60 s",
    "405": "a method other than POST (the allow header names it)",
    "413": "the body is over the server's limit",
    "415": "the body is not application/json in UTF-8, or it is compressed (a content-encoding other than identity)",
    "422": "the request breaks the contract (the same message as gRPC INVALID_ARGUMENT)",
    "500": "a fault of this server (no details are given)",
    "502": "the worker failed (gRPC INTERNAL): `model inference failed (request id ID)`, the reason in the log",
    "503": "the worker queue is full, the server holds its limit of request bodies or requests, or no "
    "(compatible) worker is serving; retry after Retry-After seconds",
    "504": "the deadline passed (x-timeout-seconds, or the server's own cap on a worker's answer), also while the "
    "body was being received",
}


_HEADERS = {
    "405": {"allow": {"description": "the methods the route takes", "schema": {"type": "string"}}},
    "503": {"retry-after": {"description": "seconds to wait before trying again", "schema": {"type": "integer"}}},
}


def _error_response(code: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {"x-request-id": _REQUEST_ID_HEADER, **_HEADERS.get(code, {})},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


_METRICS_PATH = {
    "get": {
        "operationId": "metrics",
        "summary": "Prometheus metrics of this frontend",
        "responses": {"200": {"description": "text exposition", "content": {"text/plain": {}}}},
    }
}


def openapi_document(
    max_body_bytes: int, accepted_models: list[str], max_questions: int, metrics: bool = False
) -> dict[str, Any]:
    """The document of one server: the model names it accepts, its question limit, /metrics where
    it serves it."""
    schemas = copy.deepcopy(SCHEMAS)
    request = schemas["DecideRequest"]["properties"]
    request["model"]["enum"] = [None, *sorted(accepted_models)]
    request["questions"]["maxProperties"] = max_questions
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Open-Jev decision service",
            "version": "1",
            "description": "The reference Open-Jev HTTP route; the gRPC API (openjev.v1.DecisionService) "
            "answers the same requests with the same answers.",
        },
        "paths": {
            "/v1/systemone": {
                "post": {
                    "operationId": "systemone",
                    "summary": "Answer the questions about a state",
                    "parameters": [
                        {"name": "x-request-id", "in": "header", "required": False, "schema": {"type": "string"}},
                        {
                            "name": "x-timeout-seconds",
                            "in": "header",
                            "required": False,
                            "description": "deadline of this request; without it, and when it is longer, the "
                            "server's own cap on the wait for a worker applies (--worker-deadline-seconds, 120 s "
                            "by default)",
                            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
                        },
                    ],
                    "requestBody": {
                        "required": True,
                        "description": f"at most {max_body_bytes} bytes",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DecideRequest"}}},
                    },
                    "responses": {
                        "200": {
                            "description": "the answers, in question order",
                            "headers": {"x-request-id": _REQUEST_ID_HEADER},
                            "content": {
                                "application/json": {"schema": {"$ref": "#/components/schemas/DecideResponse"}}
                            },
                        },
                        **{code: _error_response(code, text) for code, text in _ERRORS.items()},
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Ready: a compatible worker is serving and the frontend is not draining",
                    "responses": {
                        code: {
                            "description": text,
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}},
                        }
                        for code, text in (("200", "ready"), ("503", "not ready"))
                    },
                }
            },
            **({"/metrics": _METRICS_PATH} if metrics else {}),
        },
        "components": {"schemas": schemas},
    }
