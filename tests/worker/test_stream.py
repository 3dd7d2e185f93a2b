"""The worker's checks of an ExecuteUnary message: an over-long candidate is refused from its
length alone, before its ids are copied out of the message."""

from __future__ import annotations

import tracemalloc

import pytest

from openjev.v1 import decision_pb2 as api
from openjev.worker.stream import BadStream, StreamLimits, collect, collect_unary
from openjev.worker.v1 import worker_pb2 as wire


def test_an_over_long_candidate_is_refused_before_its_ids_are_copied():
    ids = list(range(100_000, 100_000 + 2_000_000))  # 2M ids: ~64 MB as a list of Python ints
    request = wire.ExecuteUnaryRequest(
        header=wire.ExecuteHeader(
            prefix_policy=api.PREFIX_POLICY_OFF,
            questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)],
        ),
        candidates=[wire.Candidate(question_index=0, candidate_index=0, token_ids=ids)],
    )
    del ids
    tracemalloc.start()
    try:
        with pytest.raises(BadStream, match="has 2000000 tokens; expected 1 to 16384"):
            collect_unary(request, StreamLimits(max_questions=8))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing"


def test_a_committed_stream_keeps_no_room_in_the_budget():
    """At its commit every candidate is in: the budget keeps no room for what its header said it
    might still send, so other calls may take the rest while it waits and runs."""
    from openjev.worker.held import HeldTokens

    budget = HeldTokens(100)
    header = wire.ExecuteHeader(
        request_id="committed",
        prefix_policy=api.PREFIX_POLICY_OFF,
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=2)],
    )
    candidates = [
        wire.Candidate(question_index=0, candidate_index=0, token_ids=[1, 2, 3]),
        wire.Candidate(question_index=0, candidate_index=1, token_ids=[4, 5]),
    ]
    messages = [
        wire.ExecuteRequest(header=header),
        wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=candidates)),
        wire.ExecuteRequest(commit=wire.Commit()),
    ]
    with budget.hold() as first:
        assert collect(iter(messages), StreamLimits(max_questions=8), first) is not None
        assert first.bound > 100  # what the header allowed: room the others would have left it
        with budget.hold() as second:
            second.take(95)
            assert budget.held == 100
