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

from packrl.config.schema import RewardConfig
from packrl.registry import REWARDS


class RewardFn(Protocol):
    def __call__(self, response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
        """Score of ``response_text`` (decoded, special tokens skipped) against ``ground_truth``."""
        ...


def register_reward(name: str, *, scores_truncated: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Register the decorated function as reward ``name`` (`packrl.registry.Registry.register`).

    Args:
        scores_truncated: the reward's rule for responses a token budget cut (finish reason
            ``length`` or ``context``): False (the default, and the rule of a function registered
            without it) scores them 0 without calling the function, since an answer cut short must
            not be credited as if it had ended on its own; True scores them like any other (a
            reward that does not read an answer). ``reward.score_truncated`` overrides it per run.

    Raises:
        ValueError: ``name`` is already registered to another function.
    """
    def decorate(fn: RewardFn) -> RewardFn:
        fn.scores_truncated = scores_truncated  # type: ignore[attr-defined]
        return REWARDS.register(name)(fn)

    return decorate


def scores_truncated(fn: RewardFn, cfg: RewardConfig) -> bool:
    """Whether responses a budget cut are scored by ``fn``: ``reward.score_truncated`` when set,
    else the reward's own rule (`register_reward`), else False."""
    return cfg.score_truncated if cfg.score_truncated is not None else bool(getattr(fn, "scores_truncated", False))


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message names the nearest and every registered name.
    """
    return REWARDS.lookup(name)
