"""The Ray transport: ``trainer.num_workers`` Ray actors, each a `PolicyWorker` holding one FSDP2
rank (`packrl.worker.strategy.FSDP2`; one GPU each on CUDA). The controller's `WorkerGroup`
plans every pass and sends each rank its part through `RayActors`.

Local Ray (no ``trainer.ray_address``) listens on the loopback interface only (Ray's own
processes and torch.distributed's rendezvous and collectives), keeps its temp dir in
``RUN_DIR/ray`` (a link to a short path under the system temp dir when RUN_DIR is too deep for
the Unix socket paths Ray makes) and starts no dashboard. Ray's task timeline is written to
``RUN_DIR/ray_timeline.json`` at each checkpoint and at the end, and named in trace.json.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import RunConfig
from packrl.distributed.group import WorkerGroup
from packrl.models.loading import load_policy_tokenizer
from packrl.worker.policy import PolicyWorker

logger = logging.getLogger(__name__)

RAY_TIMELINE_FILE = "ray_timeline.json"
# Batches travel through Ray's object store: a 512-sequence batch of 4k-token sequences is ~16 MB of ids,
# so a small store is plenty (Ray's default reserves 30% of the machine's memory in /dev/shm).
_OBJECT_STORE_BYTES = 512 << 20
_MAX_TEMP_DIR_CHARS = 40  # Ray adds ~66 characters of session and socket names; Unix sockets allow 107


def _ray_temp_dir(run_dir: Path) -> Path:
    """``RUN_DIR/ray``, or a short temp folder linked from there when that path is too long."""
    wanted = (run_dir / "ray").absolute()
    if len(str(wanted)) <= _MAX_TEMP_DIR_CHARS:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted
    short = Path(tempfile.mkdtemp(prefix="packrl-ray-"))
    if not wanted.exists():
        wanted.symlink_to(short, target_is_directory=True)
    return short


def start_ray(cfg: RunConfig, run_dir: Path) -> bool:
    """Join ``trainer.ray_address`` or start a private local Ray; True when this call started it.

    Raises:
        ValueError: Ray is not installed; the cluster cannot be reached; it lacks the CPUs/GPUs
            for ``trainer.num_workers``; or a local Ray would not bind to loopback.
    """
    local = cfg.trainer.ray_address is None
    if local:  # Ray's single-machine mode: this node's address is 127.0.0.1, so every server binds there
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
    except ImportError as err:
        raise ValueError("trainer.num_workers > 1 needs Ray: pip install 'packrl[ray]' (or set trainer.num_workers=1)") from err
    if local:
        _single_machine_mode()
    if ray.is_initialized():
        raise ValueError("Ray is already initialised in this process; call ray.shutdown() first or set trainer.ray_address")
    if local:
        num_rollout = cfg.trainer.num_rollout_workers if cfg.trainer.rollout_mode == "separate_async" else 0
        num_cpus = max(os.cpu_count() or 1, (cfg.trainer.num_workers + num_rollout) * cfg.trainer.num_cpus_per_worker)
        try:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=torch.cuda.device_count(), include_dashboard=False,
                     object_store_memory=_OBJECT_STORE_BYTES, _temp_dir=str(_ray_temp_dir(run_dir)), log_to_driver=False,
                     configure_logging=False)
        except BaseException:  # Ctrl-C or a failure half-way: stop what already started
            ray.shutdown()
            raise
        if ray.util.get_node_ip_address() != "127.0.0.1":
            ray.shutdown()
            raise ValueError("this Ray release would listen beyond loopback for a local run; "
                             "start Ray yourself and set trainer.ray_address, or use trainer.num_workers=1")
    else:
        try:
            ray.init(address=cfg.trainer.ray_address, log_to_driver=False, configure_logging=False)
        except Exception as err:  # connection and address errors
            raise ValueError(f"cannot join the Ray cluster at trainer.ray_address={cfg.trainer.ray_address!r}: "
                             f"{type(err).__name__}: {err}; start it with `ray start --head` or fix the address") from err
    _check_resources(cfg, ray.cluster_resources())
    return True


def _gather(refs: Any) -> Any:
    """``ray.get`` with a worker's error as the user sees it in one process: a raised exception as
    itself (not wrapped in Ray's header), a dead worker as a RuntimeError saying how to go on."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(refs)
    except RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    except RayActorError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(f"a data-parallel worker died ({first}); its memory or its process was lost: continue from "
                           "the newest checkpoint with train.resume=auto, with fewer trainer.num_workers if memory ran out") from err


def _single_machine_mode() -> None:
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when imported: if it was imported before the
    variable was set, its constant is set too (the child processes read the variable). Checked
    after ``ray.init`` by the node address."""
    import importlib

    try:
        constants = importlib.import_module("ray._private.ray_constants")
    except ImportError:
        return
    if hasattr(constants, "ENABLE_RAY_CLUSTER"):
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # importlib returns a plain ModuleType, which declares no such attribute


def _check_resources(cfg: RunConfig, resources: dict[str, float]) -> None:
    need_gpu = torch.cuda.is_available()
    have = resources.get("GPU" if need_gpu else "CPU", 0)
    need = cfg.trainer.num_workers * (1 if need_gpu else cfg.trainer.num_cpus_per_worker)
    if have < need:
        import ray

        ray.shutdown()
        kind = "GPUs" if need_gpu else "CPUs"
        raise ValueError(f"trainer.num_workers={cfg.trainer.num_workers} needs {need:g} {kind} but the Ray cluster has {have:g}; "
                         f"lower trainer.num_workers" + ("" if need_gpu else " or trainer.num_cpus_per_worker"))


class RayActors:
    """`Transport` over Ray actors, one `PolicyWorker` (an FSDP2 rank) each.

    Use `ray_group`; `close` writes Ray's timeline, ends the process group and shuts down the Ray
    this run started.
    """

    in_process = False

    def __init__(self, actors: list, run_dir: Path, owns_ray: bool):
        self.actors, self.run_dir, self.owns_ray = actors, run_dir, owns_ray
        self.num_ranks = len(actors)

    def call(self, method: str, args_per_rank: Sequence[tuple], ranks: Sequence[int] | None = None) -> list[Any]:
        actors = self.actors if ranks is None else [self.actors[r] for r in ranks]
        return _gather([getattr(actor, method).remote(*args) for actor, args in zip(actors, args_per_rank, strict=True)])

    def share(self, obj: Any) -> Any:
        import ray

        return ray.put(obj)

    def trace_links(self) -> dict[str, str]:
        return {"ray_timeline": RAY_TIMELINE_FILE}

    def checkpoint_written(self) -> None:
        self._write_timeline()

    def _write_timeline(self) -> None:
        import ray

        state_logger = logging.getLogger("ray._private.state")  # silence a notice about a future dashboard-based timeline
        level = state_logger.level
        state_logger.setLevel(logging.ERROR)
        try:
            ray.timeline(filename=str(self.run_dir / RAY_TIMELINE_FILE))
        finally:
            state_logger.setLevel(level)

    def close(self, graceful: bool = True) -> None:
        """Write Ray's timeline, end the process group (``graceful``; skipped after a failure or
        Ctrl-C, when a rank may be inside a collective) and shut down the Ray this group started."""
        release_actors(self.actors, self.owns_ray, "workers", graceful=graceful, first=self._write_timeline)


def release_actors(actors: list, owns_ray: bool, what: str, *, graceful: bool = True, first: Callable[[], None] | None = None) -> None:
    """Run ``first`` (e.g. write Ray's timeline), ask every actor to ``close`` (``graceful``), then
    kill them all and shut down the Ray this run started (``owns_ray``). A failure on the way is
    logged as a warning naming ``what``, never raised: closing after a failure must not hide it."""
    import ray

    if not ray.is_initialized():
        return
    try:
        if first is not None:
            first()
        if graceful:
            ray.get([a.close.remote() for a in actors], timeout=60)
    except Exception as err:  # noqa: BLE001 - closing after a failure must not hide the failure
        logger.warning("closing the %s: %s: %s", what, type(err).__name__, err)
    finally:
        for actor in actors:
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()


def ray_group(cfg: RunConfig, run_dir: Path) -> WorkerGroup:
    """Start Ray, place the ranks, form the process group and load the shards.

    Raises:
        ValueError: see `start_ray`; a worker's set-up error.
    """
    tokenizer = load_policy_tokenizer(cfg.model)
    owns_ray = start_ray(cfg, run_dir)
    import ray

    gpus = 1 if torch.cuda.is_available() else 0
    loopback = cfg.trainer.ray_address is None
    plan = BatchPlan.from_config(cfg)
    actors: list = []
    try:
        remote = ray.remote(num_cpus=cfg.trainer.num_cpus_per_worker, num_gpus=gpus)(PolicyWorker)
        actors = [remote.remote(cfg, plan, rank=rank, world_size=cfg.trainer.num_workers, loopback=loopback)
                  for rank in range(cfg.trainer.num_workers)]
        address = _gather(actors[0].listen.remote())
        infos = _gather([a.setup.remote(address) for a in actors])
    except BaseException:  # a failed set-up or Ctrl-C leaves no actor and no Ray of ours behind
        for actor in actors:
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()
        raise
    logger.info("%d workers ready: %d data-parallel x %d sequence-parallel ranks (rendezvous %s:%d)", len(actors),
                plan.data_parallel_size, plan.sequence_parallel_size, *address)
    return WorkerGroup(plan=plan, algorithm=cfg.algorithm, tokenizer=tokenizer, transport=RayActors(actors, run_dir, owns_ray),
                       info=infos[0])
