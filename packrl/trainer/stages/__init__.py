"""Sampling stages: where a step's scored rollout comes from, one registered stage per
``trainer.rollout_mode`` (`packrl.registry.ROLLOUT_MODES`).

    sync            rounds.py     one generation round per step, or dynamic sampling's rounds
    colocate_async  partial.py    partial rollouts carried across steps, on the training workers
    separate_async  separate.py   the same pool on rollout workers of its own, the next batch prefetched

The contract (`SamplingStage`, `StageContext`, `Generator`) is in base.py; the pool's groups,
members and ledger in pool.py. A new mode is one module: a factory ``StageContext ->
SamplingStage`` registered with ``@ROLLOUT_MODES.register("name", info=RolloutModeInfo(...))``,
its config check with ``ROLLOUT_MODES.register_check("name")``, named in ``trainer.plugins``.
"""

from __future__ import annotations

from packrl.registry import ROLLOUT_MODES
from packrl.trainer.stages.base import SamplingStage, StageContext


def sampling_stage(context: StageContext) -> SamplingStage:
    """The stage of ``trainer.rollout_mode``, built by its registered factory.

    Raises:
        ValueError: the mode is not registered, or its factory returned no stage.
    """
    name = context.cfg.trainer.rollout_mode
    stage = ROLLOUT_MODES.lookup(name)(context)
    if not isinstance(stage, SamplingStage):
        raise ValueError(f"trainer.rollout_mode={name!r}: its factory returned a {type(stage).__name__}, not a sampling stage; "
                         "return an object with __call__, state_dict, load_state_dict and close (packrl.trainer.stages.SamplingStage)")
    return stage
