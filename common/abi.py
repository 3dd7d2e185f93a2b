"""The frontend <-> worker ABI version and the enum mappings both sides share.

Bump ABI_VERSION whenever protos/openjev/worker/v1 changes incompatibly (a field removed,
renumbered or retyped, a message's meaning changed). A frontend refuses a worker whose version
differs; tests/test_protos.py holds the descriptor fingerprint this version was released with, so
a schema change without a bump fails there.
"""

from __future__ import annotations

from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire

ABI_VERSION = 1

POLICIES = ("off", "default", "shared", "fixed", "auto")
_POLICY_TO_ENUM = {name: getattr(api, f"PREFIX_POLICY_{name.upper()}") for name in POLICIES}
_ENUM_TO_POLICY = {value: name for name, value in _POLICY_TO_ENUM.items()}

SCOPES = ("none", "within_question", "across_questions")
_SCOPE_TO_ENUM = {name: getattr(api, f"PREFIX_SCOPE_{name.upper()}") for name in SCOPES}
_ENUM_TO_SCOPE = {value: name for name, value in _SCOPE_TO_ENUM.items()}

KINDS = ("choice", "score", "noul")
_KIND_TO_ENUM = {name: getattr(wire, f"QUESTION_KIND_{name.upper()}") for name in KINDS}
_ENUM_TO_KIND = {value: name for name, value in _KIND_TO_ENUM.items()}


def policy_to_enum(policy: str | None) -> int:
    return api.PREFIX_POLICY_UNSPECIFIED if policy is None else _POLICY_TO_ENUM[policy]


def policy_from_enum(value: int) -> str | None:
    """None for UNSPECIFIED; KeyError for a value this build does not know."""
    return None if value == api.PREFIX_POLICY_UNSPECIFIED else _ENUM_TO_POLICY[value]


def scope_to_enum(scope: str) -> int:
    return _SCOPE_TO_ENUM[scope]


def scope_from_enum(value: int) -> str:
    return _ENUM_TO_SCOPE[value]


def kind_to_enum(kind: str) -> int:
    return _KIND_TO_ENUM[kind]


def kind_from_enum(value: int) -> str:
    return _ENUM_TO_KIND[value]
