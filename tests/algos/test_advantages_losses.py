"""Advantage estimators, the PPO clipped loss and KL estimators: small worked tables."""

from __future__ import annotations

import math

import pytest
import torch

from packrl.algos import grpo_advantages, kl_penalty, ppo_clip_loss, rloo_advantages
from packrl.config.schema import AlgorithmConfig
from packrl.registry import ADVANTAGE_ESTIMATORS
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch

OUTCOME = {"grpo": grpo_advantages, "rloo": rloo_advantages}


def test_grpo_normalises_within_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    first = adv[:4]
    assert first[0] > 0 and torch.allclose(first[1:], first[1].expand(3))
    torch.testing.assert_close(first.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(first.std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal rewards: no signal


def test_dr_grpo_only_centres():
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4, norm_by_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_rloo_is_leave_one_out():
    rewards = torch.tensor([3.0, 0.0, 0.0])
    adv = rloo_advantages(rewards, 3)
    assert adv.tolist() == pytest.approx([3.0, -1.5, -1.5])


@pytest.mark.parametrize("name", sorted(OUTCOME))
def test_single_response_groups_have_zero_advantage(name):
    assert torch.equal(OUTCOME[name](torch.tensor([1.0, 0.0]), 1), torch.zeros(2))


def _scored(rewards: list[float], lengths: list[int]) -> ScoredBatch:
    prompts = PromptBatch(((5, 6), (7,)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(tuple(range(3, 3 + n)), "eos") for n in lengths)
    r = torch.tensor(rewards)
    return ScoredBatch(RolloutBatch(prompts, 2, responses), r, r)


@pytest.mark.parametrize("name", sorted(OUTCOME))
def test_registered_outcome_estimators_give_every_token_the_response_advantage(name):
    assert name in ADVANTAGE_ESTIMATORS.names()
    scored = _scored([1.0, 0.0, 0.5, 0.25], [3, 1, 4, 2])
    batch, _ = build_train_batch(scored, None, None, AlgorithmConfig(adv_estimator=name))
    expected = OUTCOME[name](scored.rewards, 2)
    for adv, value, n in zip(batch.advantages, expected, [3, 1, 4, 2], strict=True):
        assert adv.shape == (n,) and torch.equal(adv, torch.full((n,), float(value)))


def test_advantage_errors():
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='gea' is not a registered advantage estimator.*gae, grpo, "
                                         r"reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"):
        ADVANTAGE_ESTIMATORS.lookup("gea")
    with pytest.raises(ValueError, match="rollout.n=4"):
        grpo_advantages(torch.zeros(6), 4)


def test_ppo_clip_table():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A>0, r=1.5 -> clipped at 1.28; A>0, r=0.5 -> unclipped 0.5; A<0, r=1.1 -> 1.1; A<0, r=0.5 -> clipped 0.8
    torch.testing.assert_close(loss, torch.tensor([-1.28, -0.5, 1.1, 0.8]))
    assert clipped.tolist() == [True, False, False, True]


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)
    assert kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        kl_penalty(logp, ref, "k4")
