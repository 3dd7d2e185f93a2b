"""Fixtures of the reliability tests: a deliberately slow worker pair (hypothesis profiles: hypothesis_profiles.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def busy_pair(demo_model, tmp_path_factory):
    """A worker that is busy for seconds on a long request: one sequence per launch (so a launch
    boundary comes about every 0.5 s), two requests may wait. No state cache: the tests send the
    same long request again and again, and each must cost the whole computation."""
    from openjev.tools import launch

    metrics_port = launch.free_port()
    started = launch.start_pair(
        demo_model,
        tmp_path_factory.mktemp("busy"),
        worker_args=[
            *("--max-launch-sequences", "1", "--queue-capacity", "2", "--state-cache-bytes", "0"),
            # execute_started (debug): a request's first pass began; the queue depth gauge:
            # requests admitted (`execute_accepted` comes before admission)
            *("--log-level", "debug", "--metrics-port", str(metrics_port)),
        ],
    )
    started.worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield started
    started.stop()
