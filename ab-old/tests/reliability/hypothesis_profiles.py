"""The reliability tests' hypothesis settings, in a module of its own name: test modules import
it directly (`from conftest import ...` would find whichever conftest.py was imported first when
several test folders are collected together)."""

from __future__ import annotations

import os

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
