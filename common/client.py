"""A small client of the public API, and the proto -> contract JSON conversion that
`openjev decide` prints (write it with `contract.render.dumps_exact`: a score level may hold an
integer too long for `int()`, kept as a `BigInt`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from openjev import abi, serving
from openjev.contract.literals import PREFIX_POLICIES, PrefixPolicy
from openjev.contract.render import dumps_exact, parse_int
from openjev.interceptors import valid_request_id
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc


def answer_to_json(answer: api.Answer, *, newer_kinds: bool = False) -> dict[str, Any]:
    """newer_kinds: an answer of a kind this build does not know (a newer server's, a change buf
    allows) is `{"type": "unknown", "probabilities": ...}` (a client's view); else ValueError (the
    frontend's own answers always have a kind)."""
    kind = answer.WhichOneof("kind")
    probabilities = dict(zip(answer.keys, answer.probabilities, strict=True))
    if kind == "noul":
        return {"type": "noul", "noul": answer.noul.noul}
    if kind == "choice":
        return {
            "type": "choice",
            "choice": answer.choice.choice,
            "probabilities": probabilities,
            "confidence": answer.choice.confidence,
        }
    if kind == "score":
        # a level may hold an integer too long for int(): kept as its digits (render.BigInt)
        legend = {
            key: json.loads(level, parse_int=parse_int)
            for key, level in zip(answer.keys, answer.score.legend_json, strict=True)
        }
        return {
            "type": "score",
            "score": answer.score.score,
            "probabilities": probabilities,
            "confidence": answer.score.confidence,
            "legend": legend,
        }
    if newer_kinds:  # the other answers stand (a ValueError lost them all)
        return {"type": "unknown", "probabilities": probabilities}
    raise ValueError(f"answer for {answer.question_id!r} has no kind")


def response_to_json(response: api.DecideResponse, *, newer_kinds: bool = False) -> dict[str, Any]:
    """The contract's response JSON (docs/contract.md, "Response"), answers in question order
    (newer_kinds: answer_to_json's)."""
    m = response.metadata
    return {
        "model": response.model,
        "answers": {a.question_id: answer_to_json(a, newer_kinds=newer_kinds) for a in response.answers},
        "usage": {"input_tokens": response.usage.input_tokens, "output_tokens": response.usage.output_tokens},
        "metadata": {
            "method": m.method,
            "temperature": m.temperature,
            "candidate_sequences": m.candidate_sequences,
            "inference_seconds": m.inference_seconds,
            "max_length": m.max_length,
            "prefix_cache": {
                "policy": _known(abi.policy_from_enum, m.prefix_cache.policy),
                "enabled": m.prefix_cache.enabled,
                "scope": _known(abi.scope_from_enum, m.prefix_cache.scope),
                "saved_tokens": m.prefix_cache.saved_tokens,
            },
        },
    }


def _known(name_of, value: int) -> str | None:
    """The enum value's name, or `unknown-N` for one a newer server sent that this build does
    not know (a KeyError lost the answers the server had computed)."""
    try:
        return name_of(value)
    except KeyError:
        return f"unknown-{value}"


def sendable_token(token: str) -> bool:
    """gRPC metadata carries printable ASCII only: any other token would fail every call with
    INTERNAL "Invalid metadata"."""
    return bool(token) and all(" " <= c <= "~" for c in token)


# gRPC turns a deadline past 2**63 ns since the epoch (about 7.4e9 s from now) into one already
# expired, failing the call at once with DEADLINE_EXCEEDED: a longer timeout here is no deadline
MAX_DEADLINE_SECONDS = 1e9


class Client:
    """One persistent channel to a frontend."""

    def __init__(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        token: str | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ):
        """credentials: TLS (grpc.ssl_channel_credentials; with a client certificate for a frontend
        that requires one) for a frontend serving TLS; None: plaintext. token: a bearer token, sent
        as `authorization: Bearer <token>` on every call (for a frontend with `--auth-token-file` or
        `OPENJEV_AUTH_TOKENS`). options: more channel options, e.g.
        `[("grpc.ssl_target_name_override", "openjev-frontend")]` where the frontend's certificate
        does not name the address dialled."""
        self._auth: list[tuple[str, str]] = []
        if token is not None:
            token = token.strip()
            if not sendable_token(token):  # the message names no token: it is a secret
                raise ValueError("the token is empty or not printable ASCII (gRPC metadata cannot carry it)")
            self._auth = [("authorization", f"Bearer {token}")]
        # the caller's options first: gRPC keeps the first of a repeated key
        given = {key for key, _ in options}
        # a restarted frontend (a rolling update) reached within a second (40 s after a 75 s restart
        # with gRPC's backoff), a frozen one found by pings (during calls only)
        defaults = [*serving.channel_options(), *serving.liveness_options()]
        channel_options = [*options, *((k, v) for k, v in defaults if k not in given)]
        self.channel = (
            grpc.insecure_channel(address, options=channel_options)
            if credentials is None
            else grpc.secure_channel(address, credentials, options=channel_options)
        )
        self.stub = decision_pb2_grpc.DecisionServiceStub(self.channel)

    def decide(
        self,
        request: dict | str,
        *,
        policy: PrefixPolicy | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """The contract's JSON answer. timeout: seconds (None or inf: no deadline); request_id: 1-128
        visible ASCII characters (what the servers keep; others failed as INTERNAL)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if timeout is not None and timeout > MAX_DEADLINE_SECONDS:  # inf too
            timeout = None  # gRPC fails a deadline past its range at once
        if request_id is not None and not valid_request_id(request_id):
            raise ValueError("request_id must be 1 to 128 visible ASCII characters (no spaces)")
        if policy is not None and policy not in PREFIX_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(PREFIX_POLICIES)} or None, not {policy!r}")
        enum = abi.policy_to_enum(policy)
        # dumps_exact: a BigInt's digits, as the servers read them (json.dumps refuses it)
        text = request if isinstance(request, str) else dumps_exact(request, sort_keys=False)
        try:
            message = api.DecideRequest(request_json=text, prefix_policy=enum)
        except UnicodeEncodeError:  # a lone surrogate has no UTF-8: a dict's goes as its \u escape,
            if isinstance(request, str):  # for the server to refuse as it would over HTTP
                raise
            message = api.DecideRequest(request_json=json.dumps(request), prefix_policy=enum)
        metadata = [*self._auth, *([("x-request-id", request_id)] if request_id else [])]
        reply = self.stub.Decide(message, timeout=timeout, metadata=metadata or None)
        return response_to_json(reply, newer_kinds=True)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
