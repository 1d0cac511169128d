"""RL algorithms: loss aggregation (more estimators and losses arrive with the trainer)."""

from packrl.algos.loss_agg import LOSS_AGG_MODES, LossDenominators, aggregate_loss

__all__ = ["LOSS_AGG_MODES", "LossDenominators", "aggregate_loss"]
