"""GAE against hand-computed values: a finished response does not bootstrap, a truncated one
does (the finish reason decides); tool tokens are not steps; the clipped value loss and the
explained variance against hand values; config checks of the critic."""

from __future__ import annotations

import pytest
import torch

from packrl.algos.gae import gae, whiten
from packrl.config import ConfigError, load_config
from packrl.trainer.batch import value_metrics
from packrl.worker.critic import value_loss

GAMMA, LAM = 0.9, 0.8


def test_gae_bootstraps_only_a_truncated_response():
    values = (torch.tensor([0.5, 0.2, 0.1]), torch.tensor([0.3, 9.9, 0.4]))  # B: a tool token (9.9) between two steps
    masks = (torch.tensor([True, True, True]), torch.tensor([True, False, True]))
    rewards, bootstrap = (torch.tensor([0.0, 0.0, 1.0]), torch.zeros(3)), torch.tensor([0.7, 0.6])  # each reward on its last policy token
    adv, ret = gae(rewards, values, bootstrap, [False, True], masks, gamma=GAMMA, lam=LAM)
    # A, finished: delta = r + gamma V' - V with V' = 0 after the last token (the 0.7 is not used)
    torch.testing.assert_close(adv[0], torch.tensor([-0.32 + 0.72 * 0.538, 0.538, 0.9]))
    torch.testing.assert_close(ret[0], adv[0] + values[0])
    # B, truncated: the last step bootstraps from 0.6; the tool token is skipped (0 there)
    torch.testing.assert_close(adv[1], torch.tensor([0.06 + 0.72 * 0.14, 0.0, 0.14]))
    torch.testing.assert_close(ret[1], torch.tensor([0.1608 + 0.3, 0.0, 0.54]))
    # the same B finished on its own: no bootstrap
    adv, _ = gae(rewards, values, bootstrap, [False, False], masks, gamma=GAMMA, lam=LAM)
    torch.testing.assert_close(adv[1], torch.tensor([0.06 + 0.72 * -0.4, 0.0, -0.4]))


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    values, masks = (torch.tensor([0.25, 0.5, 0.75]),), (torch.ones(3, dtype=torch.bool),)
    adv, ret = gae((torch.tensor([0.0, 0.0, 2.0]),), values, torch.zeros(1), [False], masks, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[0], 2.0 - values[0])
    torch.testing.assert_close(ret[0], torch.full((3,), 2.0))


def test_whitening_is_over_the_policy_tokens_of_the_batch():
    out = whiten((torch.tensor([1.0, 5.0, 3.0]), torch.tensor([7.0])), (torch.tensor([True, False, True]), torch.tensor([True])))
    chosen = torch.tensor([1.0, 3.0, 7.0])
    expected = (chosen - chosen.mean()) / chosen.std()
    torch.testing.assert_close(torch.stack([out[0][0], out[0][2], out[1][0]]), expected, atol=1e-6, rtol=0)
    assert out[0][1] == 0


def test_the_clipped_value_loss_against_hand_values():
    vpred = torch.tensor([1.0, -0.5, 2.0])
    old = torch.tensor([0.4, 0.4, 1.0])
    returns = torch.tensor([0.9, 1.0, 2.0])
    loss, clipped = value_loss(vpred, old, returns, 0.5)
    # 1: V_clip = 0.9, max(0.01, 0) ; 2: V_clip = -0.1, max(2.25, 1.21) ; 3: V_clip = 1.5, max(0, 0.25): the clip binds
    torch.testing.assert_close(loss, torch.tensor([0.005, 1.125, 0.125]))
    assert clipped.tolist() == [False, False, True]


def test_explained_variance_against_hand_values():
    masks = (torch.ones(3, dtype=torch.bool),)
    out = value_metrics((torch.tensor([1.0, 2.0, 3.0]),), (torch.tensor([2.0, 4.0, 6.0]),), masks)
    assert out["critic/vf_explained_var"] == pytest.approx(1 - 1 / (4 + 1e-5))
    assert out["critic/values/mean"] == 2.0 and out["critic/returns/max"] == 6.0


def test_critic_config_checks():
    cfg = load_config("demo", ["algorithm.adv_estimator=gae"])
    assert cfg.critic.enabled(cfg.algorithm.adv_estimator)
    with pytest.raises(ConfigError, match="critic.enable"):
        load_config("demo", ["algorithm.adv_estimator=gae", "critic.enable=false"])
    with pytest.raises(ConfigError, match="has no effect"):
        load_config("demo", ["critic.cliprange_value=0.2"])
    with pytest.raises(ConfigError, match="critic.warmup_steps"):
        load_config("demo", ["algorithm.adv_estimator=gae", "critic.warmup_steps=100", "train.total_steps=5"])
    with pytest.raises(ConfigError, match="critic.max_tokens_per_microbatch"):
        load_config("demo", ["algorithm.adv_estimator=gae", "critic.max_tokens_per_microbatch=16"])
    with pytest.raises(ConfigError, match="algorithm.lam"):
        load_config("demo", ["algorithm.adv_estimator=gae", "algorithm.lam=1.5"])


def test_the_memory_estimate_counts_the_critic():
    from packrl.inspect.memory import ModelShape, estimate_memory
    from packrl.testing import tiny_llama_config

    shape = ModelShape.from_config(tiny_llama_config(1000, hidden_size=64, intermediate_size=128, max_position_embeddings=2048))
    plain = estimate_memory(load_config("demo", []), shape)
    with_critic = estimate_memory(load_config("demo", ["algorithm.adv_estimator=gae"]), shape)
    part = "critic (weights + AdamW states)"
    assert plain.parts[part] == 0 and with_critic.parts[part] == 12 * shape.num_params
    assert with_critic.phases["update"] - plain.phases["update"] == 12 * shape.num_params


def test_settings_without_effect_are_refused():
    with pytest.raises(ConfigError, match=r"critic.model.path='/x': has no effect"):
        load_config("demo", ["critic.model.path=/x"])
    with pytest.raises(ConfigError, match="algorithm.gamma"):
        load_config("demo", ["algorithm.gamma=0.9"])
    with pytest.raises(ConfigError, match="train.share_prompts"):
        load_config("demo", ["train.share_prompts=true", "model.packed_attention=position_ids"])
    load_config("demo", ["train.share_prompts=true"])


def test_preflight_names_a_critic_path_that_does_not_resolve(tmp_path):
    from packrl.inspect.preflight import preflight

    report = preflight("demo", ["algorithm.adv_estimator=gae", f"critic.model.path={tmp_path / 'missing'}"])
    assert any(p.key == "critic.model.path" for p in report.problems)
