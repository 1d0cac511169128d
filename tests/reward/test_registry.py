"""Reward registry: lookup, registration, and the optional math-verify reward."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from packrl.config.schema import RewardConfig
from packrl.reward import REWARDS, get_reward, gsm8k_reward, math_verify_reward, register_reward


def test_builtin_rewards_are_registered():
    assert get_reward("gsm8k") is gsm8k_reward
    assert get_reward("math_verify") is math_verify_reward


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"reward.name='gsm9k' is not a registered reward; did you mean reward.name=gsm8k\? "
                                         r"registered: .*gsm8k, math_verify"):
        get_reward("gsm9k")


def test_register_a_reward(monkeypatch):
    monkeypatch.setattr(REWARDS, "_parts", dict(REWARDS._parts))  # forget the registration after the test

    @register_reward("exact")
    def exact(response_text, ground_truth, *, data_source, cfg):
        return float(response_text == ground_truth)

    assert get_reward("exact") is exact
    assert exact("1", "1", data_source="s", cfg=RewardConfig()) == 1.0
    with pytest.raises(ValueError, match="reward 'exact' is already registered"):
        register_reward("exact")(lambda *a, **k: 0.0)


def test_math_verify_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import -> ImportError
    with pytest.raises(ValueError, match=r"reward.name=math_verify needs the math-verify package.*pip install math-verify"):
        math_verify_reward("\\boxed{2}", "2", data_source="s", cfg=RewardConfig(name="math_verify"))


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify is not installed (optional)")
@pytest.mark.parametrize(
    "response, truth, score",
    [("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0), ("the answer is $\\boxed{3}$", "2", 0.25), ("no answer", "2", 0.0)],
)
def test_math_verify_scores(response, truth, score):
    assert math_verify_reward(response, truth, data_source="s", cfg=RewardConfig(name="math_verify", format_score=0.25)) == score


def test_math_verify_without_the_package_fails_at_config_load(monkeypatch):
    from packrl.config import ConfigError, load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match=r"reward.name='math_verify': needs the math-verify package.*pip install math-verify"):
        load_config("demo", ["reward.name=math_verify"])
