"""Fixtures of the reliability tests: hypothesis profiles, a deliberately slow worker pair."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# CI: a modest, derandomized run. OPENJEV_HYPOTHESIS_PROFILE=long for a longer local search.
settings.register_profile(
    "openjev-ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "openjev-long", parent=settings.get_profile("openjev-ci"), max_examples=1500, derandomize=False
)
HYPOTHESIS = settings.get_profile("openjev-" + os.environ.get("OPENJEV_HYPOTHESIS_PROFILE", "ci"))


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
