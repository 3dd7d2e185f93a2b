"""Fixtures of the reliability tests: a deliberately slow worker pair (hypothesis profiles: hypothesis_profiles.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def busy_pair(demo_model, tmp_path_factory):
    """A worker that is busy for seconds on a long request: one sequence per launch (so a launch
    boundary comes about every 0.5 s), two requests may wait. No state cache: the tests send the
    same long request again and again, and each must cost the whole computation."""
    from openjev.tools import launch

    started = launch.start_pair(
        demo_model,
        tmp_path_factory.mktemp("busy"),
        worker_args=["--max-launch-sequences", "1", "--queue-capacity", "2", "--state-cache-bytes", "0"],
    )
    yield started
    started.stop()
