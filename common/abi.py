"""The frontend <-> worker ABI version and the enum mappings both sides share.

Bump ABI_VERSION whenever protos/openjev/worker/v1 changes incompatibly (a field removed,
renumbered or retyped, a message's meaning changed). A frontend refuses a worker whose version
differs; tests/test_protos.py holds the descriptor fingerprint this version was released with, so
a schema change without a bump fails there. A compatible addition keeps the version: an optional
method (ExecuteUnary) is offered in Describe (`execute_unary`), and a frontend calls it only where
every worker offers it, so older peers on either side keep working.
"""

from __future__ import annotations

import hashlib

from openjev.contract.literals import (
    PREFIX_POLICIES,
    PREFIX_SCOPES,
    QUESTION_KINDS,
    PrefixPolicy,
    PrefixScope,
    QuestionKind,
)
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire

ABI_VERSION = 1

# Candidates in one Execute message (a stream's batch, or an ExecuteUnary's whole request): the
# frontend sends at most this many, the worker states its limit in Describe and refuses more.
BATCH_CANDIDATES = 16

# Response-header key a worker sends once it accepts an Execute stream (committed and valid).
# A call that failed before this header came never ran on that worker, so the frontend may try it
# again elsewhere; empty headers cannot say that, since a failed call reports its headers as empty.
ACCEPTED_METADATA_KEY = "openjev-accepted"

# Request-header key a frontend sends with every worker call: what it expects of the worker
# (`expected_worker`). Describe is asked only every refresh period, so a worker restarted with
# another tokenizer or model could take calls meanwhile; it refuses these itself, before accepting.
EXPECT_METADATA_KEY = "openjev-expect"


def expected_worker(tokenizer_fingerprint: str, max_length: int, model_id: str, temperature: float) -> str:
    """What makes a worker's answers this frontend's, as a digest both sides compute alike (a
    header value must be ASCII; a model id need not be)."""
    described = f"{ABI_VERSION}\n{tokenizer_fingerprint}\n{max_length}\n{model_id}\n{temperature!r}"
    return hashlib.sha256(described.encode()).hexdigest()[:32]


# Request-header key: what the frontend's workers agreed on at its last Describe round, their
# checkpoint revision and default prefix policy (`expected_fleet`). A worker restarted meanwhile
# with a retrained head (same model id and tokenizer) would otherwise answer the same request
# otherwise than the others until the next round; it refuses these calls itself, unaccepted.
EXPECT_FLEET_METADATA_KEY = "openjev-expect-fleet"


def expected_fleet(checkpoint_revision: str, default_prefix_policy: int, weights_fingerprint: str = "") -> str:
    """A digest of what the workers behind one frontend must agree on (the policy as its enum
    value: what Describe says); without a weights fingerprint (a worker from before it), the
    digest such a worker computes."""
    described = f"{checkpoint_revision}\n{default_prefix_policy}"
    if weights_fingerprint:
        described += f"\n{weights_fingerprint}"
    return hashlib.sha256(described.encode()).hexdigest()[:32]


def weights_fingerprint(model_config: str, head_weight: tuple[float, ...], head_bias: float) -> str:
    """A digest of what a worker's answers depend on beside its tokenizer and declared revision:
    the model's parsed config (its repr) and the export's head. Two heads under one revision
    answered a request by whichever worker it reached."""
    described = f"{model_config}\n{head_weight!r}\n{head_bias!r}"
    return hashlib.sha256(described.encode()).hexdigest()[:32]


# Each literal's enum value is its name upper-cased after the enum's prefix (protos/ says so).
_POLICY_TO_ENUM: dict[PrefixPolicy, api.PrefixPolicy] = {
    name: api.PrefixPolicy.Value(f"PREFIX_POLICY_{name.upper()}") for name in PREFIX_POLICIES
}
_ENUM_TO_POLICY: dict[int, PrefixPolicy] = {value: name for name, value in _POLICY_TO_ENUM.items()}

_SCOPE_TO_ENUM: dict[PrefixScope, api.PrefixScope] = {
    name: api.PrefixScope.Value(f"PREFIX_SCOPE_{name.upper()}") for name in PREFIX_SCOPES
}
_ENUM_TO_SCOPE: dict[int, PrefixScope] = {value: name for name, value in _SCOPE_TO_ENUM.items()}

_KIND_TO_ENUM: dict[QuestionKind, wire.QuestionKind] = {
    name: wire.QuestionKind.Value(f"QUESTION_KIND_{name.upper()}") for name in QUESTION_KINDS
}
_ENUM_TO_KIND: dict[int, QuestionKind] = {value: name for name, value in _KIND_TO_ENUM.items()}


def policy_to_enum(policy: PrefixPolicy | None) -> api.PrefixPolicy:
    return api.PREFIX_POLICY_UNSPECIFIED if policy is None else _POLICY_TO_ENUM[policy]


def policy_from_enum(value: int) -> PrefixPolicy | None:
    """None for UNSPECIFIED; KeyError for a value this build does not know."""
    return None if value == api.PREFIX_POLICY_UNSPECIFIED else _ENUM_TO_POLICY[value]


def scope_to_enum(scope: PrefixScope) -> api.PrefixScope:
    return _SCOPE_TO_ENUM[scope]


def scope_from_enum(value: int) -> PrefixScope:
    return _ENUM_TO_SCOPE[value]


def kind_to_enum(kind: QuestionKind) -> wire.QuestionKind:
    return _KIND_TO_ENUM[kind]


def kind_from_enum(value: int) -> QuestionKind:
    return _ENUM_TO_KIND[value]
