"""The worker's checks of an ExecuteUnary message: an over-long candidate is refused from its
length alone, before its ids are copied out of the message."""

from __future__ import annotations

import tracemalloc

import pytest

from openjev.v1 import decision_pb2 as api
from openjev.worker.stream import BadStream, StreamLimits, collect_unary
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
