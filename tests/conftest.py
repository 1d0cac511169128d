"""Shared fixtures: a tiny random Llama (float32) and the SmolLM2 tokenizer from ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.models.attention import use_packed_attention

SHARED = Path(os.environ.get("PACKRL_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SMOLLM_DIR = SHARED / "models" / "smollm2-135m-instruct"


def tiny_llama(*, attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 97) -> LlamaForCausalLM:
    """A 2-layer random Llama with GQA. Its config keeps transformers' default use_cache=True,
    the setting under which naive packing leaks across sequences."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype)
    if attn == "sdpa":
        use_packed_attention(model)
    return model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    if not (SMOLLM_DIR / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 tokenizer not found under {SMOLLM_DIR} (set PACKRL_SHARED to the shared/ folder)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM_DIR)
