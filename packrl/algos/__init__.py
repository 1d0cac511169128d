"""RL algorithms as registered pure functions: advantages, token losses, KL, loss aggregation."""

from packrl.algos.advantages import ADVANTAGES, get_advantage, register_advantage
from packrl.algos.loss_agg import LOSS_AGG_MODES, LossDenominators, aggregate_loss
from packrl.algos.losses import KL_ESTIMATORS, kl_penalty, ppo_clip_loss

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossDenominators",
    "aggregate_loss",
    "get_advantage",
    "kl_penalty",
    "ppo_clip_loss",
    "register_advantage",
]
