"""The Ray transport: ``trainer.num_workers`` Ray actors, each a `PolicyWorker` holding one FSDP2
rank (`packrl.worker.strategy.FSDP2`; one GPU each on CUDA). The controller's `WorkerGroup`
plans every pass and sends each rank its part through `RayActors`.

Local Ray (no ``trainer.ray_address``) listens on the loopback interface only (Ray's own
processes and torch.distributed's rendezvous and collectives), keeps its temp dir in
``RUN_DIR/ray`` (a link to a short path under the system temp dir when RUN_DIR is too deep for
the Unix socket paths Ray makes) and starts no dashboard. Ray's task timeline is written to
``RUN_DIR/ray_timeline.json`` at each checkpoint and at the end, and named in trace.json.

On a cluster (``trainer.ray_address``) the ranks are placed by a Ray placement group
(``trainer.placement``: pack or spread), one bundle per rank; before any actor starts, the nodes
must be able to hold every actor of the run (`placement_shortfall`) and must share
``train.out_dir`` (`check_shared_dir`). Where each actor landed is written to
``RUN_DIR/workers.json``; every call to the ranks is waited on by
`packrl.distributed.health.wait_all`, which turns a lost rank or node into `WorkerLost`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from packrl.config.plan import BatchPlan
from packrl.config.rollout_modes import mode_info
from packrl.config.schema import RunConfig, TrainerConfig
from packrl.distributed.group import WorkerGroup
from packrl.distributed.health import (
    ActorRecord,
    Located,
    alive_nodes,
    check_shared_dir,
    describe_nodes,
    locate,
    placement_shortfall,
    wait_all,
    wait_for_room,
)
from packrl.models.loading import ResolvedPolicy, load_policy_tokenizer
from packrl.worker.policy import PolicyWorker

logger = logging.getLogger(__name__)

RAY_TIMELINE_FILE = "ray_timeline.json"
WORKERS_FILE = "workers.json"
PLACEMENT_WAIT_S = 300.0
"""How long the ranks' placement group may wait for free resources the cluster has (seconds)."""
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


def start_ray(trainer: TrainerConfig, run_dir: Path) -> bool:
    """Join ``trainer.ray_address`` or start a private local Ray; True when this call connected
    this process to Ray (its `release_actors` disconnects it, and stops a private Ray).

    Raises:
        ValueError: Ray is not installed; the cluster cannot be reached; its nodes can never hold
            the run's actors at once (`_check_room`); a node of the cluster does not share
            ``train.out_dir`` (`check_shared_dir`); or a local Ray would not bind to loopback.
    """
    local = trainer.ray_address is None
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
        num_cpus = max(os.cpu_count() or 1, (trainer.num_workers + _num_rollout_actors(trainer)) * trainer.num_cpus_per_worker)
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
            ray.init(address=trainer.ray_address, log_to_driver=False, configure_logging=False)
        except Exception as err:  # connection and address errors
            raise ValueError(f"cannot join the Ray cluster at trainer.ray_address={trainer.ray_address!r}: "
                             f"{type(err).__name__}: {err}; start it with `ray start --head` or fix the address") from err
    try:
        _check_room(trainer)
        if not local:
            check_shared_dir(run_dir)
    except BaseException:
        ray.shutdown()
        raise
    return True


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


def actor_bundle(trainer: TrainerConfig) -> dict[str, float]:
    """The resources Ray reserves for one rank or rollout worker: ``trainer.num_cpus_per_worker``
    CPUs, and one GPU on CUDA."""
    return {"CPU": float(trainer.num_cpus_per_worker)} | ({"GPU": 1.0} if torch.cuda.is_available() else {})


def run_bundles(trainer: TrainerConfig) -> list[dict[str, float]]:
    """One `actor_bundle` per Ray actor of the run: the ranks (``trainer.num_workers > 1``) and the
    rollout workers (``separate_async``)."""
    ranks = trainer.num_workers if trainer.num_workers > 1 else 0
    return [actor_bundle(trainer)] * (ranks + _num_rollout_actors(trainer))


def _num_rollout_actors(trainer: TrainerConfig) -> int:
    """``trainer.num_rollout_workers`` where the rollout mode declares rollout workers of its own
    (`packrl.config.rollout_modes.RolloutModeInfo.rollout_workers`), else 0."""
    return trainer.num_rollout_workers if mode_info(trainer.rollout_mode).rollout_workers else 0


def _room_fix(trainer: TrainerConfig) -> str:
    knobs = "trainer.num_workers" + (", trainer.num_rollout_workers" if _num_rollout_actors(trainer) else "")
    return f"lower {knobs} or trainer.num_cpus_per_worker, or add nodes to the cluster (`ray start --address=HEAD:PORT` on each)"


def _check_room(trainer: TrainerConfig) -> None:
    """Refuse a run whose actors the cluster's alive nodes can never hold at once (each actor's
    bundle must fit one node).

    Raises:
        ValueError: naming the keys and values, each node's CPUs and GPUs, and the fix.
    """
    bundles = run_bundles(trainer)
    nodes = alive_nodes()
    missing = placement_shortfall(bundles, nodes)
    if missing:
        actors = f"trainer.num_workers={trainer.num_workers}" + (
            f" + trainer.num_rollout_workers={trainer.num_rollout_workers}" if _num_rollout_actors(trainer) else "")
        raise ValueError(f"{actors} Ray actors of {bundles[0]} each do not fit the Ray cluster: {missing} of {len(bundles)} "
                         f"have no room ({describe_nodes(nodes)}); {_room_fix(trainer)}")


def wait_for_cluster(trainer: TrainerConfig, timeout_s: float) -> float:
    """Before a restart on a cluster (``trainer.ray_address``): join it, wait until its alive nodes
    can hold the run's actors again (a lost node rejoining), leave; return the seconds waited (0
    for a private local Ray, which starts afresh).

    Raises:
        RuntimeError: still no room after ``timeout_s`` (``trainer.restart_wait_s``), naming the
            nodes' resources and the fix.
        ValueError: the cluster cannot be joined.
    """
    if trainer.ray_address is None:
        return 0.0
    import ray

    try:
        ray.init(address=trainer.ray_address, log_to_driver=False, configure_logging=False)
    except Exception as err:  # connection and address errors
        raise ValueError(f"cannot join the Ray cluster at trainer.ray_address={trainer.ray_address!r} to restart: "
                         f"{type(err).__name__}: {err}") from err
    try:
        return wait_for_room(run_bundles(trainer), timeout_s, "the run",
                             f"{_room_fix(trainer)}; then continue with train.resume=auto, or raise trainer.restart_wait_s")
    finally:
        ray.shutdown()


def _on_loopback(nodes: Sequence[dict[str, Any]]) -> bool:
    """Every node of the cluster is this machine's loopback (a cluster started on one machine)."""
    return all(n["NodeManagerAddress"].startswith("127.") or n["NodeManagerAddress"] == "::1" for n in nodes)


def _place_ranks(trainer: TrainerConfig) -> Any:
    """A placement group of one `actor_bundle` per rank (``trainer.placement``), ready.

    Raises:
        RuntimeError: the cluster has the room but not free within `PLACEMENT_WAIT_S`.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([actor_bundle(trainer)] * trainer.num_workers, strategy=trainer.placement.upper())
    if not group.wait(timeout_seconds=PLACEMENT_WAIT_S):
        remove_placement_group(group)
        raise RuntimeError(f"the {trainer.num_workers} ranks (trainer.num_workers, trainer.placement={trainer.placement}) "
                           f"found no free room within {PLACEMENT_WAIT_S:g} s; free now: {ray.available_resources()}; "
                           "stop what holds the cluster's resources, or lower trainer.num_workers")
    return group


def write_records(path: Path, records: Sequence[ActorRecord]) -> None:
    """``records`` as a JSON list (``RUN_DIR/workers.json``: where each actor runs)."""
    path.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")


class RankActor(Located, PolicyWorker):
    """The `PolicyWorker` of one rank as a Ray actor that can say where it runs (`Located`)."""


class RayActors:
    """`Transport` over Ray actors, one `PolicyWorker` (an FSDP2 rank) each.

    Use `ray_group`; every call is waited on by `wait_all` (a lost rank or node is `WorkerLost`);
    `close` writes Ray's timeline, ends the process group, removes the placement group and shuts
    down the Ray this run started.

    Args:
        actors: the rank actors, rank order.
        records: where each runs (`ActorRecord`), rank order.
        placement: their placement group (removed at `close`), or None.
    """

    in_process = False

    def __init__(self, actors: list, run_dir: Path, owns_ray: bool, records: Sequence[ActorRecord], placement: Any = None):
        self.actors, self.run_dir, self.owns_ray, self.records, self.placement = actors, run_dir, owns_ray, list(records), placement
        self.num_ranks = len(actors)

    def call(self, method: str, args_per_rank: Sequence[tuple], ranks: Sequence[int] | None = None) -> list[Any]:
        chosen = range(self.num_ranks) if ranks is None else ranks
        refs = [getattr(self.actors[r], method).remote(*args) for r, args in zip(chosen, args_per_rank, strict=True)]
        return wait_all(refs, [self.records[r] for r in chosen], method)

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
        release_actors(self.actors, self.owns_ray, "workers", graceful=graceful, first=self._write_timeline, placement=self.placement)


def release_actors(actors: list, owns_ray: bool, what: str, *, graceful: bool = True, first: Callable[[], None] | None = None,
                   placement: Any = None) -> None:
    """Run ``first`` (e.g. write Ray's timeline), ask every actor to ``close`` (``graceful``), then
    kill them all, remove their ``placement`` group and shut down the Ray this run started
    (``owns_ray``). A failure on the way is logged as a warning naming ``what``, never raised:
    closing after a failure must not hide it."""
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
        if placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(placement)
        if owns_ray:
            ray.shutdown()


def ray_group(cfg: RunConfig, run_dir: Path, plan: BatchPlan | None = None, policy: ResolvedPolicy | None = None) -> WorkerGroup:
    """Start Ray (or join ``trainer.ray_address``), place the ranks (``trainer.placement``), write
    where each landed to ``RUN_DIR/workers.json``, form the process group and load the shards.
    ``plan``: the recipe's `BatchPlan` (None: RL's, `BatchPlan.from_config`). ``policy``:
    ``model.path`` as the controller resolved it (`packrl.models.loading.resolve_policy`), whose
    tokenizer the group uses (None: loaded here); each rank resolves ``model.path`` where it runs.

    Raises:
        ValueError: see `start_ray`; a worker's set-up error.
        RuntimeError: the ranks found no free room (`_place_ranks`); an actor could not start.
        WorkerLost: a rank or its node was lost during set-up.
    """
    tokenizer = policy.tokenizer if policy is not None else load_policy_tokenizer(cfg.model)
    owns_ray = start_ray(cfg.trainer, run_dir)
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = cfg.trainer.num_workers
    plan = plan or BatchPlan.from_config(cfg)
    actors: list = []
    placement = None
    try:
        placement = _place_ranks(cfg.trainer)
        loopback = cfg.trainer.ray_address is None or _on_loopback(alive_nodes())
        bundle = actor_bundle(cfg.trainer)
        remote = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0))(RankActor)
        names = [f"packrl-rank{rank}-{secrets.token_hex(3)}" for rank in range(n)]
        actors = [remote.options(name=names[rank], scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement, placement_group_bundle_index=rank)).remote(cfg, plan, rank=rank, world_size=n, loopback=loopback)
            for rank in range(n)]
        records = locate(actors, [f"rank {rank}" for rank in range(n)], names)
        write_records(run_dir / WORKERS_FILE, records)
        transport = RayActors(actors, run_dir, owns_ray, records, placement)
        address = transport.call("listen", [()], [0])[0]
        infos = transport.call("setup", [(address,)] * n)
    except BaseException:  # a failed set-up or Ctrl-C leaves no actor, placement group or Ray of ours behind
        release_actors(actors, owns_ray, "workers", graceful=False, placement=placement)
        raise
    logger.info("%d workers ready: %d data-parallel x %d sequence-parallel ranks (rendezvous %s:%d) on %s", n,
                plan.data_parallel_size, plan.sequence_parallel_size, *address, ", ".join(f"{r.role} {r.node_ip} pid {r.pid}"
                                                                                      for r in records))
    return WorkerGroup(plan=plan, tokenizer=tokenizer, transport=transport, info=infos[0])
