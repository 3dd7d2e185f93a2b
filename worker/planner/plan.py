"""The planner's output: a token tree cut into segments, and the launches that run them.

Everything here is ints and token ids; the engine turns a `Plan` into runner calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openjev.contract.literals import ExecutedPolicy, PrefixPolicy, PrefixScope
from openjev.worker.geometry import GDN_CHUNK_TOKENS


@dataclass(frozen=True, order=True)
class Reader:
    """A candidate prompt whose head score is read at a segment's last token."""

    question: int
    candidate: int


@dataclass(frozen=True)
class PackLimits:
    """The pass budget: most segments and tokens one forward pass may carry, and the length of
    the pieces a longer tree node is cut into (they carry their state from pass to pass, and
    other requests' segments ride in the same passes). shared_tokens: most tokens of a pass
    while several requests wait (None: max_tokens); a shorter pass answers the requests that
    ride in it sooner, beside a long prompt's chunks."""

    max_sequences: int = 64
    max_tokens: int = 4096
    chunk_tokens: int = 2048
    shared_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_sequences < 1 or self.max_tokens < 1 or self.chunk_tokens < 1:
            raise ValueError(f"pack limits must be positive, got {self}")
        if self.chunk_tokens > self.max_tokens:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} exceeds the pass budget {self.max_tokens}")
        if self.shared_tokens is not None and not self.chunk_tokens <= self.shared_tokens <= self.max_tokens:
            # a chunk over the shared pass would never run beside another request
            raise ValueError(
                f"shared_tokens {self.shared_tokens} must lie between chunk_tokens {self.chunk_tokens} "
                f"and the pass budget {self.max_tokens}"
            )

    @property
    def pass_tokens_shared(self) -> int:
        """Most tokens of a pass while several requests wait."""
        return shared_pass_tokens(self.max_tokens, self.shared_tokens)


def shared_pass_tokens(max_tokens: int, shared_tokens: int | None) -> int:
    """Most tokens of a pass while several requests wait (shared_tokens None: the whole budget);
    the worker's flags are checked with it before a PackLimits exists."""
    return max_tokens if shared_tokens is None else shared_tokens


def default_chunk_tokens(pass_tokens: int) -> int:
    """Half the pass's tokens (the shared pass's where it is capped), on the 64-token grid: a chunk
    that fills a whole pass leaves other requests no room beside a long prompt (bench-load with a
    2,048-token budget and 2,048-token chunks: short requests waited for the whole 16,384-token
    request, docs/benchmarks/index.md)."""
    return max(GDN_CHUNK_TOKENS, pass_tokens // 2 // GDN_CHUNK_TOKENS * GDN_CHUNK_TOKENS)


@dataclass(frozen=True)
class Segment:
    """One packed sequence: a run of tokens continuing from its parent's final state.

    start_position: tokens before this segment in every prompt that contains it.
    readers: candidates whose head reads this segment's last token.
    keep_state: some segment continues from this one, so its final state must be kept.
    """

    index: int
    parent: int | None
    token_ids: Sequence[int]  # array('I') as planned: 4 bytes an id for as long as the request runs
    start_position: int
    readers: tuple[Reader, ...]
    keep_state: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class Plan:
    """What one request executes.

    launches: segment indices per forward pass when the request runs alone (a parent runs in an
        earlier pass or the same one); the scheduler may mix other requests into them.
    num_submitted_tokens: every candidate's full length, shared or not (= usage.input_tokens).
    num_computed_tokens: tokens the model actually runs (sum of segment lengths).
    num_saved_tokens: num_submitted_tokens - num_computed_tokens, i.e. (g - 1) * p summed over
        segments of p tokens under which g candidates read.
    policy: the requested policy; executed_policy: the one whose tree ran (differs only for auto).
    """

    segments: tuple[Segment, ...]
    launches: tuple[tuple[int, ...], ...]
    policy: PrefixPolicy
    executed_policy: ExecutedPolicy
    num_submitted_tokens: int
    num_computed_tokens: int
    num_saved_tokens: int
    scope: PrefixScope
    num_questions: int
    num_candidates_per_question: tuple[int, ...]

    @property
    def enabled(self) -> bool:
        """Whether any prefix computation was actually skipped."""
        return self.num_saved_tokens > 0

    @property
    def num_launches(self) -> int:
        return len(self.launches)
