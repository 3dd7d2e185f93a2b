"""A pass budget the kernels cannot launch is a clear refusal at start, before the weights load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openjev.tools import launch

pytestmark = pytest.mark.gpu


def test_a_budget_past_the_conv_grid_is_refused_before_the_weights_load(demo_model):
    flags = ["--max-launch-tokens", "21400", "--max-launch-sequences", "21400"]
    command = [sys.executable, "-m", launch.WORKER_MODULE, "--model", str(demo_model), "--backend", "cuda", *flags]
    done = subprocess.run([*command, "--plaintext"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "over CUDA's 65535: lower --max-launch-tokens or --max-launch-sequences" in done.stderr
    assert "Traceback" not in done.stderr  # main's check, not the runner's after the load
