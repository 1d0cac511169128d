"""Rollout workers on their own Ray processes (``trainer.rollout_mode=separate_async``).

Each `RolloutWorker` is a Ray actor holding the configured rollout engine (``rollout.engine``) on
its own copy of the policy; `RolloutPool` splits a generation call over them by cost, as the
worker group splits one over its ranks, and pushes the trainer's weights to every one of them
(`RolloutPool.sync_weights`: one object in Ray's store, loaded by each engine, whose prefix cache
is reset with it, so no cached block crosses versions). A sync happens between engine calls,
never during one, so no engine is ever left paused by a failed sync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import RunConfig
from packrl.distributed.group import generate_split
from packrl.distributed.ray_group import release_actors, start_ray
from packrl.models.loading import load_policy
from packrl.registry import import_plugins
from packrl.rollout.engine import SamplingParams, awake
from packrl.types import Response
from packrl.worker.parts import build_engine

logger = logging.getLogger(__name__)


class RolloutWorker:
    """A rollout engine on its own copy of the policy, in its own process.

    Args:
        cfg: the run's config (``model``, ``rollout``, ``trainer.plugins``).
        plan: the run's `BatchPlan` (its compute dtype).
        max_context_tokens: the model context the trainer found (`packrl.seqlen.Budgets`).
    """

    def __init__(self, cfg: RunConfig, plan: BatchPlan, max_context_tokens: int) -> None:
        import_plugins(cfg.trainer.plugins)
        torch.set_num_threads(cfg.trainer.num_cpus_per_worker)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        policy, tokenizer = load_policy(cfg.model, device=device, compute_dtype=plan.compute_dtype)
        self.engine, _, _ = build_engine(cfg, policy, tokenizer, max_context_tokens=max_context_tokens, may_share_policy=False,
                                         compute_dtype=plan.compute_dtype)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[list[Response]]:
        return awake(self.engine, self.engine.generate, prompt_ids, params, seeds)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the trainer's weights."""
        self.engine.load_weights(weights.items())

    def ready(self) -> bool:
        """True once the engine is built (the controller waits for it)."""
        return True

    def close(self) -> None:
        self.engine.close()


class RolloutPool:
    """The rollout workers as the controller sees them (`rollout_pool` builds it)."""

    def __init__(self, actors: list, owns_ray: bool) -> None:
        self.actors, self.owns_ray = actors, owns_ray

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                     rows: Sequence[int] = ()) -> list[list[Response]]:
        """``[B][G]`` responses, the prompts split over the workers by cost (prompt + budget);
        retried once as `packrl.distributed.group.WorkerGroup.generate_ids`."""
        import ray

        return generate_split(prompt_ids, params, seeds, rows, len(self.actors),
                              lambda calls: ray.get([a.generate.remote(*args) for a, args in zip(self.actors, calls)]))

    def sync_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Every worker loads ``weights`` before its next call."""
        import ray

        ref = ray.put(weights)
        ray.get([actor.load_weights.remote(ref) for actor in self.actors])

    def close(self) -> None:
        release_actors(self.actors, self.owns_ray, "rollout workers")


def rollout_pool(cfg: RunConfig, run_dir: Path, plan: BatchPlan, max_context_tokens: int) -> RolloutPool:
    """``trainer.num_rollout_workers`` `RolloutWorker` actors (one GPU each on CUDA), on the Ray the
    trainer's ranks use, or on a private local Ray started here.

    Raises:
        ValueError: see `packrl.distributed.ray_group.start_ray`; a worker's set-up error.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("trainer.rollout_mode=separate_async runs its rollout workers on Ray: pip install 'packrl[ray]'")
    import ray

    owns_ray = False if ray.is_initialized() else start_ray(cfg, run_dir)
    remote = ray.remote(num_cpus=cfg.trainer.num_cpus_per_worker, num_gpus=1 if torch.cuda.is_available() else 0)(RolloutWorker)
    actors: list = [remote.remote(cfg, plan, max_context_tokens) for _ in range(cfg.trainer.num_rollout_workers)]
    pool = RolloutPool(actors, owns_ray)
    try:
        ray.get([actor.ready.remote() for actor in actors])
    except BaseException:
        pool.close()
        raise
    return pool
