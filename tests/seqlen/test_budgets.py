"""Budgets: model context from the model config (RoPE included), relations, and the plan."""

from __future__ import annotations

import json

import pytest

from packrl.config import ConfigError
from packrl.config.budgets import budget_problems, budgets_of_model, budgets_table, validate_budgets
from packrl.config.schema import RunConfig
from packrl.seqlen.budgets import Budgets, model_context_tokens
from tests.conftest import SMOLLM_DIR, skip_without_shared


def _budgets(**kw):
    base = dict(max_prompt_tokens=512, max_response_tokens=512, max_context_tokens=8192,
                max_tokens_per_microbatch=4096, max_tokens_per_logprob_microbatch=8192)
    return Budgets(**(base | kw))


@pytest.mark.parametrize(
    ("config", "context", "factor"),
    [
        ({"max_position_embeddings": 8192}, 8192, 1.0),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192, 2.0),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 4}}, 16384, 4.0),
        ({"max_position_embeddings": 40960, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
          "original_max_position_embeddings": 32768}}, 131072, 4.0),
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
          "original_max_position_embeddings": 8192}}, 131072, 1.0),
        ({"max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 2048, 1.0),
    ],
)
def test_model_context_includes_rope_scaling(config, context, factor):
    assert model_context_tokens(config) == (context, factor)


def test_model_context_from_the_real_smollm_config():
    skip_without_shared(SMOLLM_DIR / "config.json")
    from transformers import AutoConfig

    assert model_context_tokens(json.loads((SMOLLM_DIR / "config.json").read_text())) == (8192, 1.0)
    assert model_context_tokens(AutoConfig.from_pretrained(SMOLLM_DIR)) == (8192, 1.0)


@pytest.mark.parametrize("bad", [{}, {"max_position_embeddings": 0}, {"max_position_embeddings": "8k"}])
def test_missing_context_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model_context_tokens(bad)


def test_valid_budgets_and_plan():
    b = validate_budgets(_budgets())
    plan = budgets_table(b)
    assert b.max_sequence_tokens == 1024
    for text in ("data.max_prompt_tokens", "rollout.max_response_tokens", "train.max_tokens_per_microbatch",
                 "8,192", "holds 4 x the longest sequence", "all relations hold"):
        assert text in plan


def test_every_broken_relation_is_reported():
    b = _budgets(max_context_tokens=1000, max_tokens_per_microbatch=900, max_tokens_per_logprob_microbatch=1000)
    keys = [p.key for p in budget_problems(b)]
    assert keys == ["rollout.max_response_tokens", "train.max_tokens_per_microbatch", "train.max_tokens_per_logprob_microbatch"]
    with pytest.raises(ConfigError) as err:
        validate_budgets(b)
    assert "1,024 > model context 1,000" in str(err.value)
    assert "PROBLEM" in budgets_table(b)


@pytest.mark.parametrize("field", ["max_prompt_tokens", "max_response_tokens", "max_tokens_per_microbatch"])
@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_budgets(field, value):
    problems = budget_problems(_budgets(**{field: value}))
    assert len(problems) == 1 and problems[0].value == value and "must be >= 1" in problems[0].message


def test_from_model_config():
    cfg = RunConfig()
    b = budgets_of_model(cfg, {"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2}})
    assert (b.max_context_tokens, b.rope_factor) == (4096, 2.0)
    assert b.max_prompt_tokens == cfg.data.max_prompt_tokens


def test_a_prompt_budget_fix_stays_within_the_model_context():
    """8,192-token context, 512-token responses: 7,680 tokens of room for a prompt."""
    from packrl.config.budgets import PromptRoom, prompt_budget_fix

    room = PromptRoom(max_context_tokens=8192, max_response_tokens=512)
    assert prompt_budget_fix(7000, None) == "raise data.max_prompt_tokens to >= 7,000"
    assert prompt_budget_fix(7000, room) == ("raise data.max_prompt_tokens to >= 7,000 (the model context 8,192 - "
                                             "rollout.max_response_tokens=512 leaves 7,680)")
    assert prompt_budget_fix(8000, room) == (
        "no data.max_prompt_tokens fits a 8,000-token prompt (the model context 8,192 - rollout.max_response_tokens=512 "
        "leaves 7,680): set data.max_prompt_tokens <= 7,680 with data.overlong_prompt=filter (drop the longer prompts) or "
        "left/right/middle (cut them to the budget), or lower rollout.max_response_tokens to <= 192 to make room, or use a "
        "model whose context holds 8,512 tokens")
    assert prompt_budget_fix(20050, room) == (
        "no data.max_prompt_tokens fits a 20,050-token prompt (the model context 8,192 - rollout.max_response_tokens=512 "
        "leaves 7,680): set data.max_prompt_tokens <= 7,680 with data.overlong_prompt=filter (drop the longer prompts) or "
        "left/right/middle (cut them to the budget), or use a model whose context holds 20,562 tokens")


def test_a_micro_batch_fix_never_asks_for_more_than_the_model_context():
    from dataclasses import replace

    budgets = replace(budgets_of_model(RunConfig(), {"max_position_embeddings": 8192}), max_response_tokens=100_000_000)
    by_key = {p.key: p for p in budget_problems(budgets)}
    assert by_key["train.max_tokens_per_microbatch"].fix == (
        "first fit data.max_prompt_tokens + rollout.max_response_tokens into the model context 8,192 (the "
        "rollout.max_response_tokens problem), then raise train.max_tokens_per_microbatch to >= their sum (8,192 always "
        "suffices)")
    assert "so their sum is <= 8,192" in by_key["rollout.max_response_tokens"].fix
