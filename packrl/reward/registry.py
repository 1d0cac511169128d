"""Reward functions by name (`reward.name`).

A reward function scores one decoded response against its prompt's ground truth. Adding one
is one decorated function in any module imported before the run starts::

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

from packrl.config.schema import RewardConfig


class RewardFn(Protocol):
    def __call__(self, response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
        """Score of ``response_text`` (decoded, special tokens skipped) against ``ground_truth``."""
        ...


REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register the decorated function as reward ``name``.

    Raises:
        ValueError: ``name`` is already registered to another function.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered ({REWARDS[name]!r}); pick another name for {fn!r}")
        REWARDS[name] = fn
        return fn

    return decorate


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the registered names.
    """
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"reward.name={name!r} is not a registered reward; registered: {', '.join(sorted(REWARDS))}. "
            "Set reward.name to one of them, or register one with @register_reward"
        ) from None
