"""RL algorithms as registered pure functions: advantage estimators, policy losses, KL estimators
and loss aggregation. Estimators and losses are looked up by name in `packrl.registry`."""

from packrl.algos.advantages import AdvantageInputs, grpo_advantages, per_token, rloo_advantages
from packrl.algos.loss_agg import LOSS_AGG_MODES, aggregate_loss
from packrl.algos.losses import KL_ESTIMATORS, kl_penalty, ppo_clip_loss
from packrl.algos.policy_losses import PolicyLossInputs, PolicyLossOutput
from packrl.seqlen.denominators import LossDenominators

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdvantageInputs",
    "LossDenominators",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "aggregate_loss",
    "grpo_advantages",
    "kl_penalty",
    "per_token",
    "ppo_clip_loss",
    "rloo_advantages",
]
