"""Worker groups: the controller's side of the policy workers (`group.WorkerGroup`) and its
transports, in process (`local`) and over Ray actors holding FSDP2 ranks (`ray_group`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packrl.config.plan import BatchPlan
    from packrl.config.schema import RunConfig
    from packrl.distributed.group import WorkerGroup
    from packrl.models.loading import ResolvedPolicy


@contextlib.contextmanager
def open_worker_group(cfg: RunConfig, run_dir: Path, given: WorkerGroup | None = None,
                      plan: BatchPlan | None = None, policy: ResolvedPolicy | None = None) -> Iterator[WorkerGroup]:
    """The run's worker group: ``given`` as is (its owner closes it), else (after checking from
    the model config alone that RUN_DIR's disk holds one checkpoint, `check_disk_space`) one worker in this
    process for ``trainer.num_workers=1`` (`packrl.distributed.local.local_group`) or Ray actors
    (`packrl.distributed.ray_group.ray_group`), closed when the block ends (also on errors).
    ``plan``: the recipe's `BatchPlan` (None: RL's, `BatchPlan.from_config`). ``policy``:
    ``model.path`` as the recipe resolved it (`packrl.models.loading.resolve_policy`; None:
    resolved here and by the worker)."""
    if given is not None:
        yield given
        return
    from packrl.worker.checkpoint import check_disk_space, checkpoint_bytes

    needed = checkpoint_bytes(cfg, None if policy is None else policy.config)
    check_disk_space(run_dir, needed, lora=cfg.model.lora.rank > 0)  # before any weight loads
    if cfg.trainer.num_workers == 1:
        from packrl.distributed.local import local_group

        group = local_group(cfg, plan=plan, policy=policy)
    else:
        from packrl.distributed.ray_group import ray_group

        group = ray_group(cfg, run_dir, plan, policy)
    try:
        yield group
    except BaseException:
        group.close(graceful=False)
        raise
    group.close()
