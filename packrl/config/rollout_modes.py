"""What each built-in rollout mode (``trainer.rollout_mode``, `packrl.registry.ROLLOUT_MODES`)
declares about itself and the config checks it registers, from the config alone (no torch).

A mode is a sampling stage registered by name (`packrl.trainer.stages`). What the rest of the
house must know about a mode without building it (whether its responses are generated across
steps, whether it runs rollout workers of its own) is its `RolloutModeInfo`
(`packrl.capabilities`, re-exported here with the built-ins' `SYNC`, `COLOCATE_ASYNC` and
`SEPARATE_ASYNC`); its settings are checked by its own registered check, so a new mode is one
module plus its registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from packrl.capabilities import COLOCATE_ASYNC, SEPARATE_ASYNC, SYNC, RolloutModeInfo  # noqa: F401 (re-exported)
from packrl.errors import ConfigProblem
from packrl.registry import ROLLOUT_ENGINES, ROLLOUT_MODES

if TYPE_CHECKING:
    from packrl.config.schema import AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig

ASYNC_KEYS = ("over_provision", "max_staleness", "stale_groups", "partial_chunk_tokens")
"""The ``rollout`` keys of the partial-rollout modes: prompt groups carried across steps."""


def mode_info(name: str) -> RolloutModeInfo:
    """The `RolloutModeInfo` of ``trainer.rollout_mode=name`` (`packrl.capabilities`; a mode that
    declared none: the defaults, `SYNC`'s).

    Raises:
        ValueError: ``name`` is not a registered rollout mode.
    """
    return ROLLOUT_MODES.info(name)


def sync_problems(rollout: RolloutConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """``trainer.rollout_mode=sync``: the partial-rollout keys and the behaviour-weight cap have no effect."""
    r, defaults = rollout, type(rollout)()
    out = _rollout_workers(trainer)
    rc = algorithm.rollout_correction
    if rc.rollout_is is None and rc.rollout_is_threshold != 2.0:
        key = "algorithm.rollout_correction.rollout_is_threshold"
        out.append(ConfigProblem(key, rc.rollout_is_threshold, "has no effect: algorithm.rollout_correction.rollout_is is null "
                                 "(it also caps the behaviour weights of carried tokens under trainer.rollout_mode=colocate_async)",
                                 f"set algorithm.rollout_correction.rollout_is=token or remove {key}",
                                 keys=(key, "algorithm.rollout_correction.rollout_is", "trainer.rollout_mode")))
    return out + [ConfigProblem(f"rollout.{k}", getattr(r, k), "has no effect: trainer.rollout_mode=sync",
                                f"set trainer.rollout_mode=colocate_async (or separate_async), or remove rollout.{k}",
                                keys=(f"rollout.{k}", "trainer.rollout_mode"))
                  for k in ASYNC_KEYS if getattr(r, k) != getattr(defaults, k)]


def colocate_async_problems(rollout: RolloutConfig, trainer: TrainerConfig, data: DataConfig,
                            algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """``trainer.rollout_mode=colocate_async``: over-provisioning to cut the tail with (at most a
    batch, so the groups at the staleness bound always fit the next batch), one-turn rollouts and
    no dynamic sampling (not built for carried groups)."""
    out = _rollout_workers(trainer) + _partial_problems(data, rollout, algorithm, trainer)
    r = rollout
    if trainer.num_workers == 1 and r.partial_chunk_tokens != 64 and _stops_on_condition(r.engine):
        out.append(ConfigProblem("rollout.partial_chunk_tokens", r.partial_chunk_tokens,
                                 f"has no effect: rollout.engine={r.engine} on one rank generates a step in one call stopped "
                                 "between decode rounds (its EngineCapabilities declare stop_on_condition; chunks serve other "
                                 "engines, several ranks and separate_async)", "remove rollout.partial_chunk_tokens",
                                 keys=("rollout.partial_chunk_tokens", "rollout.engine", "trainer.num_workers", "trainer.rollout_mode")))
    return out


def separate_async_problems(rollout: RolloutConfig, trainer: TrainerConfig, data: DataConfig,
                            algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """``trainer.rollout_mode=separate_async``: the partial-rollout rules, rollout workers to run
    and a staleness bound of at least 2 (every token is already one update old)."""
    out = _partial_problems(data, rollout, algorithm, trainer)
    if trainer.num_rollout_workers < 1:
        out.append(ConfigProblem("trainer.num_rollout_workers", trainer.num_rollout_workers, "must be >= 1",
                                 "set trainer.num_rollout_workers=1"))
    if rollout.max_staleness < 2:
        out.append(ConfigProblem("rollout.max_staleness", rollout.max_staleness,
                                 "must be >= 2 under trainer.rollout_mode=separate_async: every token is already one update old "
                                 "(generated during the previous update), so a carried group needs one step more",
                                 "set rollout.max_staleness=2", keys=("rollout.max_staleness", "trainer.rollout_mode")))
    return out


def _stops_on_condition(engine: str) -> bool:
    """Whether ``rollout.engine=engine`` declares ``stop_on_condition`` with its registration
    (`packrl.capabilities.EngineCapabilities`); False for a name not registered (the registry's
    check reports it) or an engine that declared nothing."""
    return ROLLOUT_ENGINES.problem(engine) is None and ROLLOUT_ENGINES.info(engine).stop_on_condition


def _rollout_workers(trainer: TrainerConfig) -> list[ConfigProblem]:
    """``trainer.num_rollout_workers`` in a mode without rollout workers of its own (the ``trainer`` section)."""
    if trainer.num_rollout_workers == 1:
        return []
    mode = trainer.rollout_mode
    return [ConfigProblem("trainer.num_rollout_workers", trainer.num_rollout_workers, f"has no effect: trainer.rollout_mode={mode} "
                          "runs no rollout workers of its own", "set trainer.rollout_mode=separate_async or remove it",
                          keys=("trainer.num_rollout_workers", "trainer.rollout_mode"))]


def _partial_problems(data: DataConfig, rollout: RolloutConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """What the partial-rollout modes share: over-provisioning within a batch, one-turn rollouts
    (a filter that cannot run in a mode says so itself: `packrl.capabilities.FilterInfo.modes`)."""
    r, mode, out = rollout, trainer.rollout_mode, []
    if r.over_provision is not None and not 1 <= r.over_provision <= data.batch_size:
        out.append(ConfigProblem("rollout.over_provision", r.over_provision,
                                 f"must be in [1, data.batch_size={data.batch_size}] under trainer.rollout_mode={mode} "
                                 "(0 cuts nothing; more than a batch could leave groups at the staleness bound that no batch holds)",
                                 f"set rollout.over_provision={default_over_provision(data.batch_size)}, null (a quarter of the "
                                 "batch) or trainer.rollout_mode=sync",
                                 keys=("rollout.over_provision", "data.batch_size", "trainer.rollout_mode")))
    if r.multi_turn.tools:
        out.append(ConfigProblem("trainer.rollout_mode", mode, "does not carry multi-turn trajectories across steps yet",
                                 "set trainer.rollout_mode=sync or rollout.multi_turn.tools=[]",
                                 keys=("trainer.rollout_mode", "rollout.multi_turn.tools")))
    return out


def default_over_provision(batch_size: int) -> int:
    """``rollout.over_provision=null``: a quarter of the batch, at least one group."""
    return max(1, batch_size // 4)
