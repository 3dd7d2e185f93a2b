"""Shared fixtures: the demo export on disk and a real worker + frontend pair on loopback."""

from __future__ import annotations

import gc
import importlib.util
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / ".openjev" / "demo-model"


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """No collections while collecting (they were ~40% of its CPU, walking the modules it imports),
    then what it imported (torch, transformers, the tests) frozen: it lives as long as the process,
    and later collections no longer walk it."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(config, items):
    has_gpu = importlib.util.find_spec("cupy") is not None
    if has_gpu:
        import torch

        has_gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_server_outlives_the_tests():
    """Servers run in sessions of their own: one a failing test left behind would outlive pytest."""
    yield
    from openjev.tools import launch

    if left := launch.stop_leftovers():
        warnings.warn(f"servers left running by the tests, now killed: {left}", stacklevel=1)


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    """The Qwen3.5 tokenizer.json the tokenizer and batching tests encode with."""
    from openjev.tokenizer import write_tokenizer_json

    path = tmp_path_factory.mktemp("qwen3_5") / "tokenizer.json"
    write_tokenizer_json(path)  # built once per process (tokenizer_json_bytes is cached)
    return path


@pytest.fixture(scope="session")
def prompt_tokenizer(tokenizer_json):
    from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX
    from openjev.tokenizer import PromptTokenizer

    return PromptTokenizer(tokenizer_json, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The embedded demo export, built once (the builder skips an identical existing build)."""
    from openjev.tools.demo_model import build_demo_model

    build_demo_model(DEMO_DIR, seed=0)
    return DEMO_DIR


@pytest.fixture(scope="session")
def pair(demo_model, tmp_path_factory):
    """One worker and one frontend as subprocesses, shared by the end-to-end tests."""
    from openjev.tools import launch

    started = launch.start_pair(demo_model, tmp_path_factory.mktemp("pair"))
    yield started
    started.stop()


@pytest.fixture(scope="session")
def client(pair):
    from openjev.client import Client

    with Client(pair.frontend.address) as c:
        yield c
