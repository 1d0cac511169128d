"""Rollout workers on their own Ray processes (``trainer.rollout_mode=separate_async``).

Each `RolloutWorker` is a Ray actor holding the configured rollout engine (``rollout.engine``) on
its own copy of the policy; `RolloutPool` splits a generation call over them by cost, as the
worker group splits one over its ranks, and pushes the trainer's weights to every one of them
(`RolloutPool.sync_weights`: one object in Ray's store, loaded by each engine, whose prefix cache
is reset with it, so no cached block crosses versions). A sync happens between engine calls,
never during one, so no engine is ever left paused by a failed sync.

The workers are placed by their own resources (one GPU, or ``trainer.num_cpus_per_worker``
CPUs each), named ``packrl-rollout<i>-<token>``, and where each landed is written to
``RUN_DIR/rollout_workers.json``; every call to them is waited on by
`packrl.distributed.health.wait_all`, so a lost worker or node is `WorkerLost`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import ModelConfig, RolloutConfig, RunConfig
from packrl.distributed.group import generate_split
from packrl.distributed.health import ActorRecord, Located, locate, wait_all
from packrl.distributed.ray_group import actor_bundle, release_actors, start_ray, write_records
from packrl.hardware import ComputeDtype
from packrl.models.loading import load_policy
from packrl.registry import import_plugins
from packrl.rollout.engine import EngineCapabilities, EngineOptions, SamplingParams, awake
from packrl.types import ExtraInputs, Response
from packrl.worker.parts import build_engine

logger = logging.getLogger(__name__)


ROLLOUT_WORKERS_FILE = "rollout_workers.json"


@dataclass(frozen=True)
class RolloutWorkerSpec:
    """What a `RolloutWorker` builds its engine from, made once by `rollout_pool` and shipped to
    every worker (not the run's whole config).

    Attributes:
        model: the ``model`` section (the policy copy it loads).
        rollout: the ``rollout`` section (the engine and its multi-turn and thinking wrappers).
        engine: the engine's settings (`packrl.rollout.engine.EngineOptions.of_sections`).
        plugins: ``trainer.plugins``, imported in the worker's process.
        num_threads: ``trainer.num_cpus_per_worker``, torch's threads there.
        compute_dtype: the run's compute dtype (`BatchPlan.compute_dtype`).
        max_context_tokens: the model context the trainer found (`packrl.seqlen.Budgets`).
    """

    model: ModelConfig
    rollout: RolloutConfig
    engine: EngineOptions
    plugins: tuple[str, ...]
    num_threads: int
    compute_dtype: ComputeDtype
    max_context_tokens: int


class RolloutWorker(Located):
    """A rollout engine on its own copy of the policy, in its own process (`Located`: it says where).

    Args:
        spec: what it builds the engine from (`RolloutWorkerSpec`).
    """

    def __init__(self, spec: RolloutWorkerSpec) -> None:
        import_plugins(list(spec.plugins))
        torch.set_num_threads(spec.num_threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        policy, tokenizer = load_policy(spec.model, device=device, compute_dtype=spec.compute_dtype)
        self.engine, _, _ = build_engine(spec.rollout, spec.engine, policy, tokenizer, max_context_tokens=spec.max_context_tokens,
                                         may_share_policy=False, compute_dtype=spec.compute_dtype)

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
    """The rollout workers as the controller sees them (`rollout_pool` builds it); ``records``:
    where each runs. A lost worker or node raises `packrl.distributed.health.WorkerLost`.

    A `packrl.trainer.stages.base.Generator`: it takes no extra inputs (a vision-language run is
    refused with this mode, `packrl.models.vision.vision_run_problems`) and cannot stop a call on a condition
    of the whole call (each worker generates its share in its own process)."""

    capabilities = EngineCapabilities()

    def __init__(self, actors: list, owns_ray: bool, records: Sequence[ActorRecord]) -> None:
        self.actors, self.owns_ray, self.records = actors, owns_ray, list(records)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                     rows: Sequence[int] = (), extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
        """``[B][G]`` responses, the prompts split over the workers by cost (prompt + budget);
        retried once as `packrl.distributed.group.WorkerGroup.generate_ids`."""
        assert extra_inputs is None or all(x is None for x in extra_inputs), "the modality's rules refuse rollout workers"
        return generate_split(prompt_ids, params, seeds, rows, len(self.actors),
                              lambda calls: wait_all([a.generate.remote(*args) for a, args in zip(self.actors, calls)],
                                                     self.records[:len(calls)], "generate"))

    def sync_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Every worker loads ``weights`` before its next call."""
        import ray

        ref = ray.put(weights)
        wait_all([actor.load_weights.remote(ref) for actor in self.actors], self.records, "weight sync")

    def close(self) -> None:
        release_actors(self.actors, self.owns_ray, "rollout workers")


def rollout_pool(cfg: RunConfig, run_dir: Path, plan: BatchPlan, max_context_tokens: int) -> RolloutPool:
    """``trainer.num_rollout_workers`` `RolloutWorker` actors (one GPU each on CUDA), on the Ray the
    trainer's ranks use, or on a private local Ray started here; each gets the `RolloutWorkerSpec`
    made here from ``cfg``, ``plan`` (its compute dtype) and ``max_context_tokens``.

    Raises:
        ValueError: see `packrl.distributed.ray_group.start_ray`; a worker's set-up error.
    """
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("trainer.rollout_mode=separate_async runs its rollout workers on Ray: pip install 'packrl[ray]'")
    import ray

    owns_ray = False if ray.is_initialized() else start_ray(cfg.trainer, run_dir)
    bundle = actor_bundle(cfg.trainer)
    remote = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0))(RolloutWorker)
    count = cfg.trainer.num_rollout_workers
    names = [f"packrl-rollout{i}-{secrets.token_hex(3)}" for i in range(count)]
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    spec = RolloutWorkerSpec(model=cfg.model, rollout=cfg.rollout, engine=options,
                             plugins=tuple(cfg.trainer.plugins), num_threads=cfg.trainer.num_cpus_per_worker,
                             compute_dtype=plan.compute_dtype, max_context_tokens=max_context_tokens)
    actors: list = [remote.options(name=name).remote(spec) for name in names]
    try:
        records = locate(actors, [f"rollout worker {i}" for i in range(count)], names)
        write_records(run_dir / ROLLOUT_WORKERS_FILE, records)
        wait_all([actor.ready.remote() for actor in actors], records, "start")
    except BaseException:
        release_actors(actors, owns_ray, "rollout workers", graceful=False)
        raise
    return RolloutPool(actors, owns_ray, records)
