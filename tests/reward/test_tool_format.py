"""The tool-call format reward (the tool_format shaping part, reward.shaping.tool_format.weight): each part per response from the trajectory
the multi-turn engine built, added to rewards and not to scores, kept through group selection and
concatenation, reported per part; refused where it would have no effect."""

from __future__ import annotations

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.config.schema import RewardConfig
from packrl.diagnostics.metrics import score_metrics
from packrl.reward import score_rollout
from packrl.reward.tool_format import format_parts
from packrl.rollout.engine import SamplingParams
from packrl.trainer.stages.rounds import concat_scored, select_groups
from packrl.types import PromptBatch, RolloutBatch, TrainBatch
from tests.builders import CALL, calculator_prompt_ids, scripted_engine

PARAMS = SamplingParams(n=1, max_response_tokens=400, stop=("</tool_call>",))
BAD_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>'  # one brace short


def _trajectory(tok, turns, **limits):
    engine, _ = scripted_engine(tok, turns, **limits)
    [[response]] = engine.generate([calculator_prompt_ids(tok)], PARAMS, [0])
    return response


@pytest.fixture
def responses(smollm_tokenizer):
    tok = smollm_tokenizer
    return [
        _trajectory(tok, [CALL % "12 * 34", "#### 408"]),            # call, answer used
        _trajectory(tok, [CALL % "12 * 34", "#### 400"]),            # call, answer not used
        _trajectory(tok, [BAD_CALL, CALL % "12 * 34", "#### 408"]),  # a malformed call first, then right
        _trajectory(tok, ["#### 408"]),                              # no call
        _trajectory(tok, [CALL % "12 * 34"] * 4, max_turns=2),       # still calling when the turns ran out
    ]


def test_each_part_per_response(smollm_tokenizer, responses):
    assert responses[0].trajectory.tool_answers == ("408",)
    assert responses[2].trajectory.num_malformed_calls == 1 and responses[2].trajectory.tool_answers == ("408",)
    parts = format_parts(responses, smollm_tokenizer, 0.4)
    assert set(parts) == {"call", "answer_used", "malformed"}
    assert all(v.dtype == torch.float32 and v.shape == (5,) for v in parts.values())
    assert parts["call"].tolist() == pytest.approx([0.2, 0.2, 0.2, 0.0, 0.2])
    assert parts["answer_used"].tolist() == pytest.approx([0.2, 0.0, 0.2, 0.0, 0.0])  # max_turns: no answer turn
    assert parts["malformed"].tolist() == pytest.approx([0.0, 0.0, -0.4, 0.0, 0.0])


def test_a_tool_error_is_no_answer_to_use(smollm_tokenizer):
    response = _trajectory(smollm_tokenizer, [CALL % "1 / 0", "#### Error: division by zero"])
    assert response.trajectory.num_tool_errors == 1 and response.trajectory.tool_answers == ()
    parts = format_parts([response], smollm_tokenizer, 1.0)
    assert parts["call"].tolist() == [0.5] and parts["answer_used"].tolist() == [0.0]


def _rollout(responses):
    n = len(responses)
    prompts = PromptBatch(prompt_ids=((1, 2),) * n, ground_truths=("408",) * n, data_sources=("arithmetic",) * n,
                          rows=tuple(range(n)), prompt_truncated=(False,) * n)
    return RolloutBatch(prompts=prompts, group_size=1, responses=tuple(responses))


def test_rewards_carry_the_parts_and_scores_do_not(smollm_tokenizer, responses):
    rollout = _rollout(responses)
    plain = score_rollout(rollout, smollm_tokenizer, RewardConfig(extraction="flexible"), max_response_tokens=400)
    shaped = score_rollout(rollout, smollm_tokenizer, RewardConfig(extraction="flexible", shaping={"tool_format": {"weight": 0.4}}),
                           max_response_tokens=400)
    assert plain.parts == {} and torch.equal(plain.scores, shaped.scores)
    assert shaped.scores.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert shaped.rewards.tolist() == pytest.approx([1.4, 0.2, 1.0, 1.0, 0.2])
    assert torch.allclose(shaped.rewards, plain.rewards + shaped.parts["tool_format"])
    assert torch.allclose(shaped.parts["tool_format"], sum(shaped.parts[f"tool_format/{t}"] for t in ("call", "answer_used", "malformed")))
    # dynamic sampling selects and concatenates groups: each part follows its response
    picked = concat_scored([select_groups(shaped, [2, 0]), select_groups(shaped, [4])])
    assert picked.parts["tool_format/malformed"].tolist() == pytest.approx([-0.4, 0.0, 0.0])
    assert picked.parts["tool_format/call"].tolist() == pytest.approx([0.2, 0.2, 0.2])
    zeros = tuple(torch.zeros(len(r.response_ids)) for r in responses)
    masks = tuple(torch.ones(len(r.response_ids), dtype=torch.bool) for r in responses)
    metrics = score_metrics(TrainBatch(shaped, zeros, masks, None, None))
    assert metrics["reward/tool_format/call/mean"] == pytest.approx(0.16)
    assert metrics["reward/tool_format/malformed/mean"] == pytest.approx(-0.08)
    assert metrics["reward/tool_format/answer_used/mean"] == pytest.approx(0.08)
    assert metrics["reward/tool_format/mean"] == pytest.approx(0.16)


def test_the_format_reward_is_refused_without_tools_or_below_zero():
    key = "reward.shaping.tool_format"
    with pytest.raises(ConfigError, match=f"{key}=.*has no effect: multi-turn is off"):
        load_config("demo", [f"{key}.weight=0.2"])
    with pytest.raises(ConfigError, match=f"{key}.weight=-1.0: must be a finite number > 0"):
        load_config("arithmetic_tool", [f"{key}.weight=-1"])
    assert load_config("arithmetic_tool", [f"{key}.weight=0.3"]).reward.shaping == {"tool_format": {"weight": 0.3}}
    with pytest.raises(ConfigError, match=r"reward.format_weight=0.2: unknown key; fix: reward.format_weight moved: write "
                                          r"reward.shaping.tool_format.weight"):
        load_config("arithmetic_tool", ["reward.format_weight=0.2"])
