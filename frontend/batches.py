"""Tokenize a compiled request into candidate batches, streaming (the contract's last check).

Candidates are tokenized in question/candidate order, `batch_size` at a time, and each batch is
yielded as soon as it is tokenized so that the caller can stream it to the worker while the rest
are tokenized. A candidate longer than `max_length` raises `ContractError("question {id}: {n}
tokens exceeds max_length={m}; no silent truncation")` for the first such candidate in that
order, before its batch is yielded.

Because earlier batches have already been yielded by then, a caller that streams must treat
that error as the end of the request: cancel what it sent to the worker and answer
INVALID_ARGUMENT (the worker never answers a request whose stream did not complete). A caller
that must not send anything for an invalid request uses `tokenize_request`, which tokenizes
everything first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from openjev.contract.errors import ContractError, too_long_message
from openjev.contract.request import DecisionRequest
from openjev.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class TokenizedCandidate:
    question_index: int
    candidate_index: int
    token_ids: list[int]


def iter_candidate_batches(
    request: DecisionRequest,
    tokenizer: PromptTokenizer,
    max_length: int,
    batch_size: int = 16,
) -> Iterator[list[TokenizedCandidate]]:
    """Yield batches of at most `batch_size` tokenized candidates, in question/candidate order."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    if max_length < 1:
        raise ValueError("max_length must be positive")
    pending: list[tuple[int, int]] = []
    prompts: list[str] = []
    for question_index, question in enumerate(request.questions):
        for candidate_index, prompt in enumerate(question.prompts):
            pending.append((question_index, candidate_index))
            prompts.append(prompt)
            if len(prompts) == batch_size:
                yield _tokenize(request, tokenizer, max_length, pending, prompts)
                pending, prompts = [], []
    if prompts:
        yield _tokenize(request, tokenizer, max_length, pending, prompts)


def tokenize_request(request: DecisionRequest, tokenizer: PromptTokenizer, max_length: int) -> list[list[list[int]]]:
    """Every candidate's token ids, [question][candidate], checked before anything is returned."""
    ids: list[list[list[int]]] = [[] for _ in request.questions]
    batch_size = max(1, request.num_candidates)
    for batch in iter_candidate_batches(request, tokenizer, max_length, batch_size):
        for candidate in batch:
            ids[candidate.question_index].append(candidate.token_ids)
    return ids


def _tokenize(
    request: DecisionRequest,
    tokenizer: PromptTokenizer,
    max_length: int,
    positions: list[tuple[int, int]],
    prompts: list[str],
) -> list[TokenizedCandidate]:
    batch = []
    for (question_index, candidate_index), token_ids in zip(positions, tokenizer.encode(prompts), strict=True):
        if len(token_ids) > max_length:
            question_id = request.questions[question_index].id
            raise ContractError(too_long_message(question_id, len(token_ids), max_length))
        batch.append(TokenizedCandidate(question_index, candidate_index, token_ids))
    return batch
