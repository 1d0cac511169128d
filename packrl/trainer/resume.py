"""Resume, once for every recipe: the checkpoint ``train.resume`` names (newest first under
``auto``, falling back to older complete ones), the weights, optimizer, schedule and skip counter
restored on every rank, and the recipe's own parts (its data sampler, RL's carried rollouts)
restored from the checkpoint's trainer state.

A recipe hands its resumable parts by name (`Resumable`: ``state_dict`` / ``load_state_dict``);
`trainer_state` is what it saves with each checkpoint and `resume` puts each part back. RL's loop
(`packrl.trainer.loop`) passes its prompt sampler and sampling stage, `packrl sft` its trace
sampler, so both continue on exactly the data position they stopped at, and both refuse a resume
on other data (`packrl.data.sampler.EpochSampler.load_state_dict`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from packrl.config.schema import TrainConfig
from packrl.distributed.group import WorkerGroup
from packrl.trainer.run import Run
from packrl.worker.checkpoint import resume_candidates

logger = logging.getLogger(__name__)


class Resumable(Protocol):
    """A part of a recipe whose state a checkpoint holds."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError when it cannot (the message says why and the fix)."""
        ...


def trainer_state(parts: Mapping[str, Resumable]) -> dict[str, Any]:
    """The trainer state a checkpoint saves: each part's ``state_dict`` under its name."""
    return {name: part.state_dict() for name, part in parts.items()}


def resume(run: Run, workers: WorkerGroup, train: TrainConfig, parts: Mapping[str, Resumable], *, total_steps: int,
           total_key: str) -> int:
    """The last completed step: 0 for a fresh run, else the step of the checkpoint ``train.resume``
    names, with the model, optimizer, schedule and each of ``parts`` restored from it (a part
    absent from the checkpoint's trainer state gets ``{}``). RUN_DIR's metrics.jsonl is cut back to
    that step. Under ``auto`` a run dir without a complete checkpoint starts over at step 1 (its
    metrics.jsonl emptied), with a warning.

    Args:
        total_steps / total_key: the recipe's step count and its key (``train.total_steps``,
            ``sft.total_steps``): a checkpoint at or past it is warned about.

    Raises:
        ValueError: the checkpoint (every candidate under ``auto``: a checkpoint that cannot be read
            or whose parts refuse their state is skipped for the next older one, with a warning, and
            the oldest one's error is raised) cannot be loaded: a missing or mismatched file, or a
            part's refusal, e.g. a sampler state for other data.
    """
    candidates = resume_candidates(run.dir, train.resume)
    if not candidates:
        if train.resume == "auto":
            logger.warning("train.resume=auto: no complete checkpoint in %s; starting at step 1", run.dir / "checkpoints")
        run.truncate_metrics(0)
        return 0
    for path in candidates:
        try:
            state = workers.load_checkpoint(path)
            for name, part in parts.items():
                part.load_state_dict(state.get(name, {}))
            break
        except ValueError as err:
            if path == candidates[-1]:
                raise
            logger.warning("cannot resume from %s (%s); trying the next older checkpoint", path, err)
    step = int(state["step"])
    run.truncate_metrics(step)
    run.note("resumed.txt", f"resumed from {path} after step {step}")
    if step >= total_steps:
        logger.warning("the checkpoint is at step %d >= %s=%d: nothing to train; raise %s", step, total_key, total_steps, total_key)
    return step
