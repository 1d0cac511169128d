"""The in-process transport: one `PolicyWorker` in the controller's process (``trainer.num_workers=1``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import RunConfig
from packrl.distributed.group import WorkerGroup
from packrl.models.loading import ResolvedPolicy
from packrl.worker.policy import PolicyWorker


class InProcess:
    """Calls are method calls on the one worker."""

    num_ranks = 1
    in_process = True

    def __init__(self, worker: PolicyWorker):
        self.worker = worker

    def call(self, method: str, args_per_rank: Sequence[tuple], ranks: Sequence[int] | None = None) -> list[Any]:
        assert len(args_per_rank) <= 1 and ranks in (None, [0]), "one rank"
        return [getattr(self.worker, method)(*args) for args in args_per_rank]

    def share(self, obj: Any) -> Any:
        return obj

    def trace_links(self) -> dict[str, str]:
        return {}

    def checkpoint_written(self) -> None:
        pass

    def close(self, graceful: bool = True) -> None:
        self.worker.close()


def local_group(cfg: RunConfig, model: torch.nn.Module | None = None, tokenizer: Any = None, plan: BatchPlan | None = None,
                policy: ResolvedPolicy | None = None) -> WorkerGroup:
    """A `WorkerGroup` over one `PolicyWorker` in this process.

    Args:
        model / tokenizer: the policy as `packrl.models.loading.load_policy` returns it; None
            loads ``model.path``.
        plan: the recipe's plan (`BatchPlan.supervised` for `packrl sft`); None: RL's, `BatchPlan.from_config`.
        policy: ``model.path`` as the controller resolved it (`packrl.models.loading.resolve_policy`):
            the worker loads from there; None: the worker resolves it.

    Raises:
        ValueError: any error of loading the policy or building the worker.
    """
    plan = plan or BatchPlan.from_config(cfg)
    worker = PolicyWorker(cfg, plan)
    info = worker.setup(model=model, tokenizer=tokenizer, resolved=None if policy is None else policy.where)
    return WorkerGroup(plan=plan, tokenizer=worker.tokenizer, transport=InProcess(worker), info=info)
