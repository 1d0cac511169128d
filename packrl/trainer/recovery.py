"""Automatic recovery from lost Ray actors and nodes (``trainer.max_restarts``).

Both recipes (`packrl.trainer.loop.train`, `packrl.trainer.sft.sft`) run their worker group and
steps as *attempts* (`run_attempts`) under `run_with_recovery`. The attempt's ``with`` blocks tear the group down when it fails (the Ray
actors killed, not asked: a survivor may sit in a collective). When the failure is a
`packrl.distributed.health.WorkerLost` (a rank, a rollout worker or a node gone; never a data,
config or model error, and never Ctrl-C) and restarts remain, the supervisor:

1. waits until the cluster can hold the run's actors again (``trainer.restart_wait_s``; a
   private local Ray starts afresh), else fails naming the resources missing;
2. records it, a `packrl.trainer.restarts.RestartRecord` appended to ``RUN_DIR/restarts.jsonl``
   by the run's `packrl.trainer.restarts.RestartLog`: what failed, where and why, the checkpoint
   resumed, the steps redone and the seconds lost;
3. runs a fresh attempt with ``train.resume=auto``: a new group loads the newest complete
   checkpoint with its sampler position, ledger and partial rollouts, metrics.jsonl is cut back
   to it, and the steps after it are trained again exactly as the first time (each step's seeds
   derive from ``train.seed`` and the step). Without a checkpoint yet, the run starts over at step 1.

The run's `Run` (its logs, loggers, metrics.jsonl) lives across attempts; ``train/restarts``
counts the lines of restarts.jsonl. With ``trainer.max_restarts=0`` (the default) the first
`WorkerLost` ends the run, naming what died and how to continue.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from packrl.config.schema import RunConfig, TrainerConfig
from packrl.distributed import open_worker_group
from packrl.distributed.health import WorkerLost
from packrl.trainer.restarts import RestartRecord
from packrl.trainer.run import Run
from packrl.worker.checkpoint import STATE_FILE, resume_candidates

if TYPE_CHECKING:
    from packrl.config.plan import BatchPlan
    from packrl.distributed.group import WorkerGroup
    from packrl.models.loading import ResolvedPolicy

logger = logging.getLogger(__name__)

RESTART_WAIT_S = 60.0
"""``trainer.restart_wait_s`` when unset."""


def run_attempts(cfg: RunConfig, run: Run, steps: Callable[[RunConfig, WorkerGroup], None], *, workers: WorkerGroup | None = None,
                 plan: BatchPlan | None = None, policy: ResolvedPolicy | None = None) -> None:
    """A recipe's worker group and steps, as attempts under `run_with_recovery`: each attempt
    opens a worker group (`packrl.distributed.open_worker_group`) for ``cfg`` with the
    ``train.resume`` it resumes from, logs the compute dtype's warning, notes ``model.txt`` and
    runs ``steps(config, group)``; a lost actor tears the group down and, while
    ``trainer.max_restarts`` allows, a fresh attempt resumes.

    Args:
        cfg: the run's config; each attempt's copy differs in ``train.resume`` only.
        steps: the recipe's part of an attempt (its own checks, notes and steps), given the
            attempt's config and its group.
        workers: a group the caller built and closes (every attempt uses it); None: one per attempt.
        plan: the recipe's `BatchPlan` (None: RL's). policy: ``model.path`` as the recipe resolved it.

    Raises:
        as `run_with_recovery`.
    """
    def attempt(resume_from: str | None) -> None:
        current = replace(cfg, train=replace(cfg.train, resume=resume_from))
        with open_worker_group(current, run.dir, workers, plan=plan, policy=policy) as group:
            if group.plan.compute_dtype.warning:
                logger.warning("%s", group.plan.compute_dtype.warning)
            run.note("model.txt", group.model_summary)
            steps(current, group)

    run_with_recovery(cfg.trainer, cfg.train.resume, run, attempt)


def run_with_recovery(trainer: TrainerConfig, resume: str | None, run: Run, attempt: Callable[[str | None], None]) -> None:
    """``attempt(resume)``, and after each `WorkerLost`, while ``trainer.max_restarts`` allows, a
    fresh ``attempt`` resumed from the newest complete checkpoint (see the module docstring).

    Args:
        trainer: the ``trainer`` section (``max_restarts``, ``restart_wait_s``, ``ray_address``).
        resume: the run's ``train.resume`` (None, ``auto`` or a checkpoint path).
        attempt: one attempt with the ``train.resume`` it resumes from: ``resume`` first, then
            ``auto`` (or ``resume``'s path again while RUN_DIR holds no checkpoint of its own).

    Raises:
        WorkerLost: with ``trainer.max_restarts`` spent (0: the first), naming what died, where,
            when and why, with a note on how to continue.
        RuntimeError: the cluster did not regain room for the run within ``trainer.restart_wait_s``.
        Exception: whatever else ``attempt`` raised, as it raised it.
    """
    current, restarts, started = resume, 0, time.time()
    while True:
        try:
            attempt(current)
            return
        except WorkerLost as lost:
            lost.at_step(_step_in_progress(run, lost.stage))
            limit = trainer.max_restarts
            if restarts >= limit:
                spent = f"after {restarts} restart(s), trainer.max_restarts={limit} is spent" if limit else \
                    "trainer.max_restarts=0: no automatic restart"
                lost.add_note(f"({spent}; continue from the newest checkpoint with train.resume=auto "
                              f"train.out_dir={run.dir}, or set trainer.max_restarts=N to restart on a lost actor)")
                raise
            restarts += 1
            logger.warning("%s; restarting from the newest checkpoint (restart %d of trainer.max_restarts=%d)", lost, restarts, limit)
            current = _restart(trainer, resume, run, lost, restarts, started)
            started = time.time()


def _step_in_progress(run: Run, stage: str) -> int:
    """The step a failure interrupted: the one after the last logged, or for a checkpoint write
    the step it saves (written after its step is logged)."""
    last = run.last_step or 0
    return last if stage == "save_checkpoint" else last + 1


def _restart(trainer: TrainerConfig, resume: str | None, run: Run, lost: WorkerLost, number: int, attempt_started: float) -> str:
    """Wait for room, record restart ``number`` in restarts.jsonl, and return the ``train.resume``
    of the next attempt (``auto``, or the run's own ``resume`` path while RUN_DIR holds no
    checkpoint of its own)."""
    from packrl.distributed.ray_group import wait_for_cluster

    torn_down = time.time()
    wait_s = trainer.restart_wait_s if trainer.restart_wait_s is not None else RESTART_WAIT_S
    waited = wait_for_cluster(trainer, wait_s)
    own = resume_candidates(run.dir, "auto")
    next_resume = "auto" if own or resume in (None, "auto") else resume
    checkpoint = own[0] if own else (Path(next_resume) if next_resume != "auto" else None)
    resumed_step, saved_at = _checkpoint_step(checkpoint)
    last_logged = run.last_step or 0
    record = RestartRecord(
        restart=number, detected_at=_iso(lost.detected_at), failed=lost.to_json(),
        resumed_from=None if checkpoint is None else str(checkpoint), resumed_step=resumed_step, last_logged_step=last_logged,
        steps_redone=max(0, last_logged - resumed_step), work_lost_s=round(lost.detected_at - max(saved_at, attempt_started), 3),
        teardown_s=round(torn_down - lost.detected_at, 3), waited_s=round(waited, 3))
    assert run.restarts is not None, "a Run keeps a restart log whenever trainer.max_restarts > 0"
    run.restarts.add(record, relaunched_at=time.time())
    return next_resume


def _checkpoint_step(checkpoint: Path | None) -> tuple[int, float]:
    """``(step, when it was written)`` of the checkpoint a restart resumes from; ``(0, 0.0)`` for
    none. A state file that cannot be read counts as step 0 here (the resume itself then skips it
    for an older checkpoint, or says why it cannot)."""
    if checkpoint is None:
        return 0, 0.0
    try:
        state = checkpoint / STATE_FILE
        return int(json.loads(state.read_text())["step"]), state.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0.0


def _iso(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix)) + f".{int(unix % 1 * 1000):03d}Z"
