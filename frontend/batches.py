"""Tokenize a compiled request into candidate batches, streaming (the contract's last check).

Candidates are rendered and tokenized in question/candidate order, `batch_size` at a time, and
each batch is yielded as soon as it is tokenized so that the caller can stream it to the worker
while the rest are tokenized: the frontend holds one batch of prompts at a time, never the
whole request's (and of a large batch, one candidate's encoding at a time). A candidate longer
than `max_length` raises `ContractError("question {id}: {n} tokens exceeds max_length={m}; no
silent truncation")` for the first such candidate in that order, before its batch is yielded;
once the running token count passes `max_tokens`, the batch raises `ContractError("request
exceeds the token limit")`.

Because earlier batches have already been yielded by then, a caller that streams must treat
those errors as the end of the request: cancel what it sent to the worker and answer
INVALID_ARGUMENT (the worker never answers a request whose stream did not complete). A caller
that must not send anything for an invalid request uses `tokenize_request`, which tokenizes
everything first.

A split at the state's end is not exact for every state (the pre-tokenizer's regex may join the
state's last characters with the text after it: whitespace runs, letters after an apostrophe),
so prompts are cut only where the tokenizer provably starts afresh, after a line feed that a
non-whitespace character follows (`openjev.pieces`): the pieces a request's candidates share,
and those an earlier request already had, are encoded once. The ids are those of whole-text
encoding, bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from openjev.abi import BATCH_CANDIDATES
from openjev.contract import errors
from openjev.contract.errors import ContractError, too_long_message, too_many_bytes_message
from openjev.contract.request import DecisionRequest
from openjev.frontend.turns import Turns
from openjev.sequences import common_prefix_length
from openjev.tokenizer import PromptTokenizer

# What `encode` is run through: a bounded executor's submit-and-wait in the server, or a plain
# call. Lets the frontend keep tokenization off its RPC threads without this module knowing.
Encode = Callable[[list[str]], list[list[int]]]


# Batches of at most this many characters take the express lane (EncodeLanes): a tenth of a
# second of tokenizing or less, where a batch of one 24 MB candidate took a minute.
EXPRESS_CHARS = 64 * 1024


class EncodeLanes:
    """Two Turns gates of `slots` each: small batches (`is_express`) take the express one, so
    requests of megabytes, each a long encode, cannot hold every slot while a small request
    waits behind them (seen: a 0.3 s request took 60 s behind two 24 MB ones)."""

    def __init__(self, encode: Encode, slots: int):
        self.express = Turns(encode, slots, "tokenized")
        self.bulk = Turns(encode, slots, "tokenized")

    def __call__(self, prompts: list[str], wanted: Callable[[], bool] | None = None) -> list[list[int]]:
        return (self.express if is_express(prompts) else self.bulk)(prompts, wanted)


def is_express(prompts: list[str]) -> bool:
    """Whether encoding `prompts` works through EXPRESS_CHARS or fewer characters, counting each
    prompt less the start it shares with the one before: the state every candidate starts with
    is encoded once (`openjev.pieces`), so 16 candidates over a 5 KB state are a small batch."""
    if sum(len(prompt) for prompt in prompts) <= EXPRESS_CHARS:
        return True
    if max(len(prompt) for prompt in prompts) > EXPRESS_CHARS:
        return False
    fresh = len(prompts[0]) + sum(len(b) - common_prefix_length(a, b) for a, b in itertools.pairwise(prompts))
    return fresh <= EXPRESS_CHARS


@dataclass(frozen=True)
class TokenizedCandidate:
    question_index: int
    candidate_index: int
    # The encoder's list, as is: protobuf copies a list of ints into a message about twice as
    # fast as an array('I') (whose ints it must create), and the list exists either way.
    token_ids: list[int]


def iter_candidate_batches(
    request: DecisionRequest,
    tokenizer: PromptTokenizer,
    max_length: int,
    batch_size: int = BATCH_CANDIDATES,
    *,
    max_tokens: int | None = None,
    encode: Encode | None = None,
) -> Iterator[list[TokenizedCandidate]]:
    """Yield batches of at most `batch_size` tokenized candidates, in question/candidate order."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    if max_length < 1:
        raise ValueError("max_length must be positive")
    run = encode or tokenizer.encode
    total = [0]
    pending: list[tuple[int, int]] = []
    prompts: list[str] = []
    for question_index, question in enumerate(request.questions):
        for candidate_index, prompt in enumerate(question.prompts):
            pending.append((question_index, candidate_index))
            prompts.append(prompt)
            if len(prompts) == batch_size:
                yield _tokenize(request, tokenizer, run, max_length, max_tokens, total, pending, prompts)
                pending, prompts = [], []
    if prompts:
        yield _tokenize(request, tokenizer, run, max_length, max_tokens, total, pending, prompts)


def tokenize_request(
    request: DecisionRequest, tokenizer: PromptTokenizer, max_length: int, *, max_tokens: int | None = None
) -> list[list[list[int]]]:
    """Every candidate's token ids, [question][candidate], checked before anything is returned
    (an offline helper: it holds the whole request)."""
    ids: list[list[list[int]]] = [[] for _ in request.questions]
    for batch in iter_candidate_batches(request, tokenizer, max_length, 64, max_tokens=max_tokens):
        for candidate in batch:
            ids[candidate.question_index].append(candidate.token_ids)
    return ids


def _tokenize(
    request: DecisionRequest,
    tokenizer: PromptTokenizer,
    encode: Encode,
    max_length: int,
    max_tokens: int | None,
    total: list[int],
    positions: list[tuple[int, int]],
    prompts: list[str],
) -> list[TokenizedCandidate]:
    for at, prompt in enumerate(prompts):
        size = tokenizer.surely_too_long(prompt, max_length)
        if size is not None:  # too long to tokenize; an earlier candidate's count may still come first
            _tokenize(request, tokenizer, encode, max_length, max_tokens, total, positions[:at], prompts[:at])
            question_id = request.questions[positions[at][0]].id
            raise ContractError(too_many_bytes_message(question_id, size, max_length))
    # A large batch is encoded a candidate at a time, each checked before the next is encoded:
    # a refused 33 MB request once raised the frontend's peak memory from 0.4 to 2.5 GiB
    # encoding its whole batch first.
    encoded = iter(encode(prompts)) if is_express(prompts) else (encode([prompt])[0] for prompt in prompts)
    batch = []
    for (question_index, candidate_index), token_ids in zip(positions, encoded, strict=True):
        if len(token_ids) > max_length:
            question_id = request.questions[question_index].id
            raise ContractError(too_long_message(question_id, len(token_ids), max_length))
        total[0] += len(token_ids)
        if max_tokens is not None and total[0] > max_tokens:
            raise ContractError(errors.TOKEN_LIMIT)
        batch.append(TokenizedCandidate(question_index, candidate_index, token_ids))
    return batch
