"""score_rollout: decode, score by the registered reward, add the overlong penalty, float32."""

from __future__ import annotations

import pytest
import torch

from packrl.config.schema import RewardConfig
from packrl.reward import score_rollout
from packrl.reward.registry import REWARDS
from packrl.types import PromptBatch, Response, RolloutBatch


def _rollout(tok, texts: list[str], truths: tuple[str, ...], *, eos: bool = True) -> RolloutBatch:
    group = len(texts) // len(truths)
    prompts = PromptBatch(
        prompt_ids=tuple((1, 2, 3) for _ in truths), ground_truths=truths, data_sources=("openai/gsm8k",) * len(truths),
        rows=tuple(range(len(truths))), prompt_truncated=(False,) * len(truths),
    )
    responses = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        responses.append(Response(tuple(ids), "eos" if eos else "length"))
    return RolloutBatch(prompts=prompts, group_size=group, responses=tuple(responses))


def test_scores_and_rewards(smollm_tokenizer):
    tok = smollm_tokenizer
    texts = ["2 + 2 = 4\n#### 4", "#### 5", "#### 10", "I am not sure"]
    rollout = _rollout(tok, texts, ("4", "10"))  # responses 0-1 answer prompt 0, 2-3 prompt 1
    scored = score_rollout(rollout, tok, RewardConfig(format_score=0.1), max_response_tokens=512)
    assert scored.scores.dtype == torch.float32 and scored.rewards.dtype == torch.float32
    assert scored.scores.tolist() == pytest.approx([1.0, 0.1, 1.0, 0.0])
    assert torch.equal(scored.rewards, scored.scores)
    assert scored.rollout is rollout


def test_overlong_penalty_is_added_to_rewards_not_scores(smollm_tokenizer):
    tok = smollm_tokenizer
    rollout = _rollout(tok, ["#### 4", "word " * 40 + "#### 4"], ("4",), eos=False)
    lengths = [len(r.response_ids) for r in rollout.responses]
    max_tokens = lengths[1]
    cfg = RewardConfig(shaping={"overlong": {"buffer_tokens": max_tokens - lengths[0], "penalty_factor": 0.5}}, score_truncated=True)
    scored = score_rollout(rollout, tok, cfg, max_response_tokens=max_tokens)
    assert scored.scores.tolist() == [1.0, 1.0]
    assert scored.rewards.tolist() == pytest.approx([1.0, 0.5])  # at the ramp start: 0; at the budget: -0.5
    assert scored.parts["overlong"].tolist() == pytest.approx([0.0, -0.5])  # reported as a part


def test_a_response_a_budget_cut_gets_no_answer_credit_unless_configured(smollm_tokenizer):
    tok = smollm_tokenizer
    cut = _rollout(tok, ["#### 4"], ("4",), eos=False)  # finish reason length: the budget ended it
    assert score_rollout(cut, tok, RewardConfig(format_score=0.1), max_response_tokens=512).scores.tolist() == [0.0]
    assert score_rollout(cut, tok, RewardConfig(score_truncated=True), max_response_tokens=512).scores.tolist() == [1.0]
    ended = _rollout(tok, ["#### 4"], ("4",))
    assert score_rollout(ended, tok, RewardConfig(), max_response_tokens=512).scores.tolist() == [1.0]


def test_special_tokens_are_skipped(smollm_tokenizer):
    seen = []
    REWARDS.register("test_echo")(lambda text, truth, *, data_source, cfg: seen.append((text, truth, data_source)) or 0.0)
    score_rollout(_rollout(smollm_tokenizer, ["#### 4"], ("4",)), smollm_tokenizer, RewardConfig(name="test_echo"), 512)
    assert seen == [("#### 4", "4", "openai/gsm8k")]


def test_a_failing_reward_names_the_response(smollm_tokenizer):
    @REWARDS.register("test_broken")
    def broken(text, truth, *, data_source, cfg):
        if "boom" in text:
            raise KeyError("missing table")
        return 1.0

    rollout = _rollout(smollm_tokenizer, ["fine", "boom"], ("4",))
    failed = r"reward 'test_broken' failed twice on response 1 \(data_source='openai/gsm8k', ground truth '4'\): KeyError"
    with pytest.raises(RuntimeError, match=failed) as err:
        score_rollout(rollout, smollm_tokenizer, RewardConfig(name="test_broken"), 512)
    assert isinstance(err.value.__cause__, KeyError)


def test_unknown_reward_name(smollm_tokenizer):
    with pytest.raises(ValueError, match="reward.name='nope'"):
        score_rollout(_rollout(smollm_tokenizer, ["x"], ("1",)), smollm_tokenizer, RewardConfig(name="nope"), 512)
