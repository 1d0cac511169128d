"""A run resolves ``model.path`` once on the controller (`packrl.models.loading.resolve_policy`):
the tokenizer, the model context, the prompt encoder, the checkpoint size and the in-process
worker's weights all come from that one `ResolvedPolicy`, for RL and for `packrl sft`."""

from __future__ import annotations

import pytest

import packrl.models.resolve as resolve
from packrl.config import load_config
from packrl.config.schema import ModelConfig, RopeScalingConfig
from packrl.models.loading import resolve_policy
from packrl.trainer.loop import train
from packrl.trainer.sft import sft
from tests.diagnostics.tiny_run import BASE
from tests.invariance.test_sft_invariance import SFT


@pytest.fixture
def resolutions(monkeypatch):
    """Every resolution of a local ``model.path`` (`resolve_model`'s local branch), by path."""
    seen: list[str] = []
    real = resolve._resolve_local

    def counted(p, root, *, weights, tried):
        seen.append(str(p))
        return real(p, root, weights=weights, tried=tried)

    monkeypatch.setattr(resolve, "_resolve_local", counted)
    return seen


def test_the_record_holds_where_the_model_is_its_config_tokenizer_and_context(model_dir, resolutions):
    policy = resolve_policy(ModelConfig(path=str(model_dir)))
    assert resolutions == [str(model_dir)]
    assert (policy.path, policy.where.model_dir, policy.where.gguf_file, policy.where.tokenizer_dir) == (
        str(model_dir), model_dir, None, model_dir)
    assert policy.config.num_hidden_layers == 2 and policy.max_context_tokens == 512  # the tiny model's config
    assert policy.tokenizer.padding_side == "left" and policy.tokenizer.pad_token is not None
    assert policy.prompt_encoder() is policy.tokenizer  # a text model renders with its tokenizer
    scaled = resolve_policy(ModelConfig(path=str(model_dir), rope_scaling=RopeScalingConfig(type="linear", factor=2.0)))
    assert scaled.max_context_tokens == 1024 and scaled.config.max_position_embeddings == 512  # the config as its files state it


def test_a_context_the_rope_scaling_cannot_give_is_left_to_the_workers(model_dir):
    """``model.rope_scaling`` that cannot apply leaves the context unknown on the controller (the
    workers raise it when they load the model), as the data errors' hints did before."""
    policy = resolve_policy(ModelConfig(path=str(model_dir), rope_scaling=RopeScalingConfig(type="linear", factor=1.0)))
    assert policy.max_context_tokens is None


def test_an_rl_run_resolves_the_model_path_once(tmp_path, model_dir, resolutions):
    train(load_config("demo", [f"model.path={model_dir}", f"train.out_dir={tmp_path / 'rl'}", *BASE, "train.total_steps=1"]))
    assert resolutions == [str(model_dir)], "tokenizer, context, prompt encoder, checkpoint size and worker: one resolution"


def test_an_sft_run_resolves_the_model_path_once(tmp_path, model_dir, resolutions):
    sft(load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={tmp_path / 'sft'}", *SFT, "sft.total_steps=1",
                                        "train.max_tokens_per_microbatch=256"]))
    assert resolutions == [str(model_dir)]
