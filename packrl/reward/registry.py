"""Reward functions by name (``reward.name``): the `packrl.registry.REWARDS` registry.

A reward function scores one decoded response against its prompt's ground truth. Adding one
is one decorated function in a file named in ``trainer.plugins`` (or any module imported
before the run starts)::

    from packrl.config.schema import RewardConfig
    from packrl.reward import register_reward

    @register_reward("exact_match")
    def exact_match(response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
        return 1.0 if response_text.strip() == ground_truth.strip() else 0.0

and ``reward.name=exact_match`` selects it. Shaping that depends on token counts (the
overlong penalty) is added by `packrl.reward.score_rollout`, not by reward functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from packrl.capabilities import RewardInfo
from packrl.config.schema import RewardConfig
from packrl.registry import REWARDS


class RewardFn(Protocol):
    def __call__(self, response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
        """Score of ``response_text`` (decoded, special tokens skipped) against ``ground_truth``."""
        ...


def register_reward(name: str, *, scores_truncated: bool = False, correct_score: float | None = None,
                    ground_truth_problem: Callable[[str], str | None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Register the decorated function as reward ``name`` (`packrl.registry.Registry.register`),
    with what it declares (`RewardInfo`).

    Raises:
        ValueError: ``name`` is already registered to another function.
    """
    def decorate(fn: RewardFn) -> RewardFn:
        info = RewardInfo(scores_truncated=scores_truncated, correct_score=correct_score, ground_truth_problem=ground_truth_problem)
        return REWARDS.register(name, info=info)(fn)

    return decorate


def reward_info(name: str) -> RewardInfo:
    """What reward ``name`` declared (`packrl.capabilities.RewardInfo`; a function registered without
    `register_reward`: the defaults).

    Raises:
        ValueError: ``name`` is not registered.
    """
    return REWARDS.info(name)


def scores_truncated(cfg: RewardConfig) -> bool:
    """Whether responses a budget cut are scored by ``reward.name``: ``reward.score_truncated`` when
    set, else the reward's own rule (`RewardInfo.scores_truncated`)."""
    return cfg.score_truncated if cfg.score_truncated is not None else reward_info(cfg.name).scores_truncated


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message names the nearest and every registered name.
    """
    return REWARDS.lookup(name)
