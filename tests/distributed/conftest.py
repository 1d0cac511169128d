"""Fixtures of the data-parallel and sequence-parallel tests."""

from __future__ import annotations

import pytest

from tests.diagnostics.tiny_run import tiny_policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer):
    """The tiny random policy saved as an HF model folder, as the workers load it."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_policy(smollm_tokenizer).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path
