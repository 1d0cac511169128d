"""What a reward-shaping part's config check reads (``REWARD_SHAPING.register_check``,
`packrl.registry.Registry.config_problems`): the sections that make the responses it scores, not
the whole `RunConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from packrl.config.schema import DataConfig, RewardConfig, RolloutConfig, RunConfig, TrainConfig


@dataclass(frozen=True, slots=True)
class ShapingCheckInputs:
    """The sections a reward-shaping part's config check may read, at config load.

    Attributes:
        reward: the ``reward`` section: the part's own settings as given
            (``reward.shaping.<part>``, a mapping not yet built into its options), the reward
            function (``reward.name``) and its scores.
        rollout: the ``rollout`` section: the response budget and its curriculum, multi-turn
            tools, thinking budgets.
        data: the ``data`` section: the prompts and what they ask for (``data.length_target``).
        train: the ``train`` section: the steps of the run.
    """

    reward: RewardConfig
    rollout: RolloutConfig
    data: DataConfig
    train: TrainConfig


def shaping_check_inputs(cfg: RunConfig) -> ShapingCheckInputs:
    """The sections of ``cfg`` a reward-shaping part's check gets (the registry's ``check_inputs``)."""
    return ShapingCheckInputs(reward=cfg.reward, rollout=cfg.rollout, data=cfg.data, train=cfg.train)
