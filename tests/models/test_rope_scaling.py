"""``model.rope_scaling``: applied to a model config without weights, and at load before them."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.config.budgets import budget_problems, budgets_table
from packrl.config.schema import ModelConfig, RopeScalingConfig
from packrl.models.loading import load_policy
from packrl.models.logprobs import pack_logprobs
from packrl.models.model_config import apply_rope_scaling, load_model_config
from packrl.seqlen.budgets import Budgets, model_context_tokens
from packrl.seqlen.packing import pack_sequences
from packrl.testing import tiny_llama_config
from tests.conftest import SMOLLM_DIR, skip_without_shared


def _config(vocab_size: int = 97, **kw) -> LlamaConfig:
    return tiny_llama_config(vocab_size, max_position_embeddings=64, **kw)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_scaled_config_doubles_the_context_and_leaves_the_input_alone(rope_type):
    config = _config()
    scaled = apply_rope_scaling(config, RopeScalingConfig(type=rope_type, factor=2.0))
    assert model_context_tokens(scaled) == (128, 2.0)
    assert model_context_tokens(config) == (64, 1.0) and config.rope_parameters["rope_type"] == "default"
    assert scaled.rope_parameters["rope_type"] == rope_type and scaled.max_position_embeddings == 64
    assert scaled.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    if rope_type == "yarn":
        assert scaled.rope_parameters["original_max_position_embeddings"] == 64
    model = LlamaForCausalLM(scaled)
    assert model.model.rotary_emb.rope_type == rope_type


def test_none_returns_the_config_itself():
    config = _config()
    assert apply_rope_scaling(config, RopeScalingConfig()) is config


def test_configs_with_rope_scaling_only_are_handled():
    # transformers < 5 keeps the settings in `rope_scaling` (None when unscaled)
    config = SimpleNamespace(max_position_embeddings=4096, rope_scaling=None)
    scaled = apply_rope_scaling(config, RopeScalingConfig(type="yarn", factor=4.0))
    assert scaled.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert model_context_tokens(scaled) == (16384, 4.0) and config.rope_scaling is None


def test_an_already_scaled_model_is_not_rescaled_silently():
    config = _config(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"already scales RoPE \(rope_type='linear', factor=4.0\).*model.rope_scaling.type=none"):
        apply_rope_scaling(config, RopeScalingConfig(type="yarn", factor=2.0))


def test_a_config_without_max_position_embeddings_is_an_error():
    with pytest.raises(ValueError, match=r"max_position_embeddings, which is None.*model.rope_scaling.type=none"):
        apply_rope_scaling(SimpleNamespace(rope_scaling=None), RopeScalingConfig(type="linear", factor=2.0))


@pytest.fixture
def tiny_dir(tmp_path):
    skip_without_shared(SMOLLM_DIR / "tokenizer.json")
    torch.manual_seed(0)
    d = tmp_path / "tiny"
    LlamaForCausalLM(_config(vocab_size=49152)).save_pretrained(d)  # SmolLM2's vocabulary, context 64
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM_DIR / name, d / name)
    return d


def test_yarn_at_load_doubles_the_context_and_scores_past_the_original_one(tiny_dir):
    cfg = ModelConfig(path=str(tiny_dir), rope_scaling=RopeScalingConfig(type="yarn", factor=2.0))
    model, _ = load_policy(cfg)
    assert model_context_tokens(model.config) == (128, 2.0)
    assert model.model.rotary_emb.rope_type == "yarn" and model.model.rotary_emb.attention_scaling > 1.0
    # the same result without weights, as `packrl preflight` computes it
    assert model_context_tokens(apply_rope_scaling(load_model_config(str(tiny_dir)), cfg.rope_scaling)) == (128, 2.0)
    budgets = Budgets(max_prompt_tokens=60, max_response_tokens=60, max_context_tokens=128, max_tokens_per_microbatch=128,
                      max_tokens_per_logprob_microbatch=128, rope_factor=2.0)
    assert not budget_problems(budgets) and "(RoPE factor 2)" in budgets_table(budgets)
    g = torch.Generator().manual_seed(0)
    pack = pack_sequences([torch.randint(3, 49152, (120,), generator=g), torch.randint(3, 49152, (9,), generator=g)])
    with torch.no_grad():
        out = pack_logprobs(model, pack)
    assert out.has_logprob[64:120].all() and torch.isfinite(out.token_logprobs).all()
    assert (out.token_logprobs[64:120] < 0).all()  # positions 64..119 lie past the original context

    unscaled, _ = load_policy(ModelConfig(path=str(tiny_dir)))
    with torch.no_grad():
        plain = pack_logprobs(unscaled, pack).token_logprobs
    assert (plain[1:120] - out.token_logprobs[1:120]).abs().max() > 1e-6  # the scaling changed the model
