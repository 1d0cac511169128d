"""Fixtures of the end-to-end runs."""

from __future__ import annotations

import pytest


@pytest.fixture
def tokenizer(smollm_tokenizer):
    """SmolLM2's tokenizer padding on the left, as generation needs."""
    smollm_tokenizer.padding_side = "left"
    return smollm_tokenizer
