"""The Qwen3.5 tokenizer the frontend's batching tests encode with, built once per process."""

from __future__ import annotations

from pathlib import Path

import pytest

from openjev.contract.render import DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX
from openjev.tokenizer import PromptTokenizer, write_tokenizer_json


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5_batches") / "tokenizer.json"
    write_tokenizer_json(path)  # built once per process (tokenizer_json_bytes is cached)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_json) -> PromptTokenizer:
    return PromptTokenizer(tokenizer_json, DEFAULT_CHAT_PREFIX, DEFAULT_CHAT_SUFFIX)
