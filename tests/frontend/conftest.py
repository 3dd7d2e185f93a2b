"""The frontend's batching tests name the shared Qwen3.5 prompt tokenizer `tokenizer`."""

from __future__ import annotations

import pytest

from openjev.tokenizer import PromptTokenizer


@pytest.fixture(scope="session")
def tokenizer(prompt_tokenizer) -> PromptTokenizer:
    return prompt_tokenizer
