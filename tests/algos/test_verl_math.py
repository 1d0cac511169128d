"""The math where verl 0.9.1 is right, against independent oracles written here from the formulas
(never from packrl's own functions): the in-reward KL as a per-token reward under GAE, dual-clip
PPO, verl's whitening on a near-constant batch, REINFORCE++ (through a multi-turn trajectory's tool
answers as verl 0.9.1 carries it) and REINFORCE++-baseline."""

from __future__ import annotations

import math

import pytest
import torch

from packrl.algos.gae import whiten
from packrl.algos.losses import dual_clip, ppo_clip_loss
from packrl.algos.policy_losses import PolicyLossInputs, PpoClipOptions, loss_options, ppo_clip
from packrl.config import ConfigError, load_config
from packrl.config.schema import AlgorithmConfig
from packrl.seqlen.denominators import LossDenominators
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, ValueEstimates


def _scored(rewards: list[float], responses: list[Response], group_size: int) -> ScoredBatch:
    num_prompts = len(responses) // group_size
    prompts = PromptBatch(tuple((5, 6) for _ in range(num_prompts)), ("1",) * num_prompts, ("t",) * num_prompts,
                          tuple(range(num_prompts)), (False,) * num_prompts)
    r = torch.tensor(rewards)
    return ScoredBatch(RolloutBatch(prompts, group_size, tuple(responses)), r, r)


def _gae_by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Schulman et al. 2016 over one finished episode: delta_t = r_t + gamma V_{t+1} - V_t (V after the last step 0),
    A_t = sum_l (gamma lam)^l delta_{t+l}, returns = A + V."""
    n = len(rewards)
    nxt = values[1:] + [0.0]
    delta = [rewards[t] + gamma * nxt[t] - values[t] for t in range(n)]
    adv = [sum((gamma * lam) ** (k - t) * delta[k] for k in range(t, n)) for t in range(n)]
    return adv, [a + v for a, v in zip(adv, values)]


def test_in_reward_kl_is_a_reward_on_every_policy_token_under_gae():
    # one response of 4 tokens, the third a tool answer (not the policy's): its KL and value are not a step
    response = Response((3, 4, 5, 6), "eos", response_mask=(True, True, False, True))
    old = (torch.tensor([-1.0, -2.0, -9.0, -0.5]),)
    ref = (torch.tensor([-1.5, -1.0, -1.0, -0.5]),)  # k1 = old - ref = 0.5, -1.0, (tool), 0.0
    values = ValueEstimates((torch.tensor([0.2, 0.4, 7.0, 0.6]),), torch.zeros(1))
    cfg = AlgorithmConfig(adv_estimator="gae", kl_in_reward=True, kl_coef=0.1, kl_estimator="k1", gamma=0.9, lam=0.8)
    batch, metrics = build_train_batch(_scored([1.0], [response], 1), old, ref, cfg, values)
    # verl's apply_kl_penalty: r_t = score_t - beta * KL_t, the score on the last token
    token_rewards = [-0.1 * 0.5, -0.1 * -1.0, 1.0 - 0.1 * 0.0]
    _, returns = _gae_by_hand(token_rewards, [0.2, 0.4, 0.6], 0.9, 0.8)
    got = batch.returns[0]
    torch.testing.assert_close(torch.stack([got[0], got[1], got[3]]), torch.tensor(returns))
    assert got[2] == 0
    # the sum put on the last token (the old rule) gives other returns before it
    _, summed = _gae_by_hand([0.0, 0.0, 1.0 - 0.1 * (0.5 - 1.0)], [0.2, 0.4, 0.6], 0.9, 0.8)
    assert abs(float(got[0]) - summed[0]) > 1e-3  # 0.0039 here, 400x the tolerance above
    # the response's reward, as outcome estimators read it, is the score minus kl_coef x the summed KL
    assert float(batch.scored.rewards[0]) == pytest.approx(1.0 - 0.1 * (0.5 - 1.0))
    assert metrics["critic/kl_in_reward/mean"] == pytest.approx(-0.5)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(-0.5 / 3)


def test_outcome_estimators_see_the_summed_kl_as_before():
    responses = [Response((3, 4), "eos"), Response((3, 4, 5), "eos")]
    old = (torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0]))
    ref = (torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -1.0, -1.0]))  # k1 sums: 1.0 and 0.0
    cfg = AlgorithmConfig(adv_estimator="grpo", kl_in_reward=True, kl_coef=0.5, kl_estimator="k1")
    batch, _ = build_train_batch(_scored([1.0, 1.0], responses, 2), old, ref, cfg)
    shaped = [1.0 - 0.5, 1.0]
    mean, std = sum(shaped) / 2, math.sqrt(sum((x - 0.75) ** 2 for x in shaped))  # unbiased std of two
    for adv, r in zip(batch.advantages, shaped):
        torch.testing.assert_close(adv, torch.full_like(adv, (r - mean) / (std + 1e-6)))


def test_dual_clip_binds_only_on_negative_advantages_with_a_ratio_above_c():
    ratio = torch.tensor([5.0, 2.0, 5.0, 0.5, 3.5])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -2.0])
    logp = torch.log(ratio).requires_grad_()
    loss, clipped = ppo_clip_loss(logp, torch.zeros(5), adv, clip_ratio_low=0.2, clip_ratio_high=0.2)
    dual, bound = dual_clip(loss, adv, 3.0)
    # by hand, Ye et al. 2020: A<0, r=5 -> min(max(5, 1.2), 3) = 3; A<0, r=2 -> 2; A>0, r=5 -> -1.2 (PPO clip);
    # A<0, r=0.5 -> max(0.5, 0.8) = 0.8; A=-2, r=3.5 -> min(7, 6) = 6
    torch.testing.assert_close(dual, torch.tensor([3.0, 2.0, -1.2, 0.8, 6.0]))
    assert bound.tolist() == [True, False, False, False, True]
    dual.sum().backward()
    assert logp.grad is not None and logp.grad[0] == 0 and logp.grad[4] == 0 and logp.grad[1] == pytest.approx(2.0)
    # identity wherever it does not bind
    assert torch.equal(dual[~bound], loss[~bound])


def test_the_registered_ppo_clip_applies_the_dual_clip_and_reports_verls_metric():
    ratio = torch.tensor([5.0, 2.0, 5.0, 0.5])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    den = LossDenominators(num_tokens=4, num_sequences=1, loss_scale_factor=4)
    common = dict(logprobs=torch.log(ratio), old_logprobs=torch.zeros(4), advantages=adv, loss_mask=mask,
                  sequence_ids=torch.zeros(4, dtype=torch.long), denominators=den)
    algo = AlgorithmConfig(policy_loss_args={"clip_ratio_c": 3.0})
    on = ppo_clip(PolicyLossInputs(cfg=algo, options=loss_options(algo), **common))
    off = ppo_clip(PolicyLossInputs(cfg=AlgorithmConfig(), options=loss_options(AlgorithmConfig()), **common))
    bare = ppo_clip(PolicyLossInputs(cfg=AlgorithmConfig(), **common))  # a plugin loss calling ppo_clip: its defaults
    torch.testing.assert_close(on.token_loss, torch.tensor([3.0, 2.0, -1.2, 0.8]))
    torch.testing.assert_close(off.token_loss, torch.tensor([5.0, 2.0, -1.2, 0.8]))
    torch.testing.assert_close(bare.token_loss, off.token_loss)
    assert float(on.metrics["actor/pg_clipfrac_lower"]) == pytest.approx(0.25)
    assert "actor/pg_clipfrac_lower" not in off.metrics and "actor/pg_clipfrac_lower" not in bare.metrics


def test_dual_clip_config_checks():
    key = "algorithm.policy_loss_args.clip_ratio_c"
    cfg = load_config("demo", [f"{key}=3.0"])
    assert loss_options(cfg.algorithm) == PpoClipOptions(clip_ratio_c=3.0) and loss_options(AlgorithmConfig()) == PpoClipOptions()
    with pytest.raises(ConfigError, match=rf"{key}=1.0: must be a finite number > 1.*set {key}=3.0"):
        load_config("demo", [f"{key}=1.0"])
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss_args=\{'clip_ratio_c': 3.0\}: has no effect: "
                                          r"algorithm.policy_loss=gspo reads no options"):
        load_config("demo", [f"{key}=3.0", "algorithm.policy_loss=gspo"])
    with pytest.raises(ConfigError, match=rf"{key}=3.0: unknown key: algorithm.policy_loss=clip_cov does not read it, ppo_clip does; "
                                          rf"fix: set algorithm.policy_loss=ppo_clip, or remove {key}"):
        load_config("demo", [f"{key}=3.0", "algorithm.policy_loss=clip_cov"])


def test_the_old_dual_clip_key_names_where_it_moved():
    with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_c=3.0: unknown key; fix: algorithm.clip_ratio_c moved: write "
                                          r"algorithm.policy_loss_args.clip_ratio_c=C \(the dual clip is an option of the ppo_clip"):
        load_config("demo", ["algorithm.clip_ratio_c=3.0"])


def test_whitening_a_near_constant_batch_keeps_its_spread_small():
    x = [1e-6 * v for v in (-1.0, 0.0, 1.0, 2.0)]
    out = whiten((torch.tensor(x[:3]), torch.tensor(x[3:])), (torch.ones(3, dtype=torch.bool), torch.ones(1, dtype=torch.bool)))
    mean = sum(x) / 4
    var = sum((v - mean) ** 2 for v in x) / 3
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in x]  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)
    got = torch.cat(out)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-9, rtol=1e-4)
    assert float(got.std()) < 0.02  # (x - mean) / (std + 1e-8) would have made it 1
    # a spread far above the epsilon is whitened to std 1 as before
    wide = whiten((torch.tensor([1.0, 3.0, 7.0]),), (torch.ones(3, dtype=torch.bool),))[0]
    assert float(wide.std()) == pytest.approx(1.0, abs=1e-6)


def test_reinforce_plus_plus_by_hand():
    responses = [Response((3, 4, 5), "eos"), Response((3, 4), "eos")]
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    batch, _ = build_train_batch(_scored([1.0, 0.0], responses, 1), None, None, cfg)
    returns = [0.25, 0.5, 1.0, 0.0, 0.0]  # G_t = gamma^(T-t) r on the last token
    mean = sum(returns) / 5
    var = sum((g - mean) ** 2 for g in returns) / 4  # 0.175
    expected = [(g - mean) / math.sqrt(var + 1e-8) for g in returns]
    torch.testing.assert_close(torch.cat(batch.advantages), torch.tensor(expected))


def test_reinforce_plus_plus_reads_the_per_token_kl_and_looks_through_tool_answers():
    responses = [Response((3, 4, 5), "eos", response_mask=(True, False, True)), Response((3,), "eos")]
    old = (torch.tensor([-1.0, -5.0, -1.0]), torch.tensor([-1.0]))
    ref = (torch.tensor([-2.0, -1.0, -1.0]), torch.tensor([-1.0]))  # k1 = 1.0, (tool), 0.0 ; 0.0
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", kl_in_reward=True, kl_coef=0.5, kl_estimator="k1", gamma=1.0)
    batch, _ = build_train_batch(_scored([2.0, 0.0], responses, 1), old, ref, cfg)
    # returns over the policy's tokens: token 0: -0.5 + 2.0 = 1.5 (through the tool answer); token 2: 2.0; B: 0.0
    returns = [1.5, 2.0, 0.0]
    mean = sum(returns) / 3
    var = sum((g - mean) ** 2 for g in returns) / 2
    a, b = batch.advantages
    torch.testing.assert_close(torch.stack([a[0], a[2], b[0]]), torch.tensor([(g - mean) / math.sqrt(var + 1e-8) for g in returns]))
    assert a[1] == 0


def test_reinforce_plus_plus_discounts_per_policy_token_through_tool_answers():
    """verl 0.9.1 carries its running return through a masked token unchanged
    (verl/trainer/ppo/core_algos.py:721-726): a tool answer neither resets nor discounts it, so
    gamma acts once per policy token. A reset would give token 0 a return of 0; a discount per
    token of the answer, 0.5^3 x 2.0 = 0.25."""
    responses = [Response((3, 4, 5, 6, 7), "eos", response_mask=(True, False, False, True, True)), Response((3,), "eos")]
    cfg = AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.5)
    batch, _ = build_train_batch(_scored([4.0, 0.0], responses, 1), None, None, cfg)
    returns = [0.5 * 0.5 * 4.0, 0.5 * 4.0, 4.0, 0.0]  # policy tokens 0, 3, 4 of A (answer at 1-2), then B's one token
    mean = sum(returns) / 4
    var = sum((g - mean) ** 2 for g in returns) / 3  # unbiased, as masked_whiten
    a, b = batch.advantages
    torch.testing.assert_close(torch.stack([a[0], a[3], a[4], b[0]]), torch.tensor([(g - mean) / math.sqrt(var + 1e-8) for g in returns]))
    assert a[1] == 0 and a[2] == 0


def test_reinforce_plus_plus_baseline_by_hand():
    responses = [Response((3, 4, 5), "eos"), Response((3, 4), "eos"), Response((3,), "eos"), Response((3,), "eos")]
    batch, _ = build_train_batch(_scored([1.0, 0.0, 0.5, 0.5], responses, 2), None, None,
                                 AlgorithmConfig(adv_estimator="reinforce_plus_plus_baseline"))
    centred = [0.5] * 3 + [-0.5] * 2 + [0.0, 0.0]  # reward - group mean, on every token
    mean = sum(centred) / 7
    var = sum((c - mean) ** 2 for c in centred) / 6
    torch.testing.assert_close(torch.cat(batch.advantages), torch.tensor([(c - mean) / math.sqrt(var + 1e-8) for c in centred]))


def test_reinforce_plus_plus_config_checks():
    load_config("demo", ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"])
    with pytest.raises(ConfigError, match=r"rollout.n=1: gives every response advantage 0 under reinforce_plus_plus_baseline"):
        load_config("demo", ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "rollout.n=1"])
    with pytest.raises(ConfigError, match=r"algorithm.gamma=0.9: has no effect with algorithm.adv_estimator=reinforce_plus_plus_baseline"):
        load_config("demo", ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "algorithm.gamma=0.9"])
    with pytest.raises(ConfigError, match=r"algorithm.lam=0.9: has no effect with algorithm.adv_estimator=reinforce_plus_plus \("):
        load_config("demo", ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.lam=0.9"])


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_a_tiny_run_trains_with_the_new_options(tmp_path, smollm_tokenizer, estimator):
    """REINFORCE++ with the KL as a per-token reward and dual-clip PPO over two mini-batches (so the
    second is off-policy and the bound can bind) through the whole loop."""
    import json

    from tests.diagnostics.tiny_run import tiny_run

    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=2", "reward.name=test_letter_e", f"algorithm.adv_estimator={estimator}", "algorithm.kl_coef=0.05",
        "algorithm.kl_in_reward=true", "algorithm.policy_loss_args.clip_ratio_c=3.0", "train.mini_batch_size=1", "train.lr=1e-2"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["actor/pg_loss"]) and 0 <= line["actor/pg_clipfrac_lower"] <= 1 for line in lines)
    assert lines[1]["actor/reward_kl_penalty"] != 0  # the policy moved away from the reference after step 1
