"""A small client of the public API, and the proto -> contract JSON conversion that
`openjev decide` prints (write it with `contract.render.dumps_exact`: a score level may hold an
integer too long for `int()`, kept as a `BigInt`)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from openjev import abi, serving
from openjev.contract.literals import PrefixPolicy
from openjev.contract.render import parse_int
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc


def answer_to_json(answer: api.Answer) -> dict[str, Any]:
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
    raise ValueError(f"answer for {answer.question_id!r} has no kind")


def response_to_json(response: api.DecideResponse) -> dict[str, Any]:
    """The contract's response JSON (docs/contract.md, "Response"), answers in question order."""
    m = response.metadata
    return {
        "model": response.model,
        "answers": {a.question_id: answer_to_json(a) for a in response.answers},
        "usage": {"input_tokens": response.usage.input_tokens, "output_tokens": response.usage.output_tokens},
        "metadata": {
            "method": m.method,
            "temperature": m.temperature,
            "candidate_sequences": m.candidate_sequences,
            "inference_seconds": m.inference_seconds,
            "max_length": m.max_length,
            "prefix_cache": {
                "policy": abi.policy_from_enum(m.prefix_cache.policy),
                "enabled": m.prefix_cache.enabled,
                "scope": abi.scope_from_enum(m.prefix_cache.scope),
                "saved_tokens": m.prefix_cache.saved_tokens,
            },
        },
    }


class Client:
    """One persistent channel to a frontend."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None):
        """credentials: TLS (grpc.ssl_channel_credentials) for a frontend serving TLS; None: plaintext."""
        options = serving.channel_options()
        self.channel = (
            grpc.insecure_channel(address, options=options)
            if credentials is None
            else grpc.secure_channel(address, credentials, options=options)
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
        text = request if isinstance(request, str) else json.dumps(request, ensure_ascii=False)
        message = api.DecideRequest(request_json=text, prefix_policy=abi.policy_to_enum(policy))
        metadata = [("x-request-id", request_id)] if request_id else None
        return response_to_json(self.stub.Decide(message, timeout=timeout, metadata=metadata))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
