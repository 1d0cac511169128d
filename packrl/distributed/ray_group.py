"""The data-parallel worker group: ``trainer.num_workers`` Ray actors, each an `FSDPWorker` rank.

The controller (the training loop's process) keeps the tokenizer and the data; each call splits
the batch over the ranks with the seqlen balancer, sends every rank its part and puts the results
back in input order:

    call               split (packrl.seqlen.balance)                  back in order by
    generate           prompts: karmarkar_karp on prompt + response   prompt position
                       budget; each prompt keeps its seed
    compute_logprobs   sequences: balance_ranks (equal micro-batch    sequence index
                       counts, log-prob token budget)
    update             each mini-batch: balance_ranks (update token   -- (metrics merged)
                       budget); denominators all-reduced on the ranks

Local Ray (no ``trainer.ray_address``) listens on the loopback interface only (Ray's own
processes and torch.distributed's rendezvous and collectives), keeps its temp dir in
``RUN_DIR/ray`` (a link to a short path under the system temp dir when RUN_DIR is too deep for
the Unix socket paths Ray makes) and starts no dashboard. Ray's task timeline is written to
``RUN_DIR/ray_timeline.json`` at each checkpoint and at the end, and named in trace.json.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from packrl.config.schema import RunConfig
from packrl.diagnostics.trace import NullTracer
from packrl.distributed.local import generate_with_retry, is_on_policy
from packrl.distributed.protocol import Role
from packrl.models.loading import load_policy_tokenizer
from packrl.rollout.engine import SamplingParams
from packrl.seqlen.balance import balance_ranks, karmarkar_karp
from packrl.trainer.actor import LogprobResult, update_metrics
from packrl.trainer.checkpoint import check_disk_space, checkpoint_bytes, load_trainer_state
from packrl.types import PromptBatch, RolloutBatch, TrainBatch

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
        num_cpus = max(os.cpu_count() or 1, cfg.trainer.num_workers * cfg.trainer.num_cpus_per_worker)
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
        constants.ENABLE_RAY_CLUSTER = False


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


class RayWorkerGroup:
    """`WorkerGroup` over ``trainer.num_workers`` `FSDPWorker` Ray actors (one GPU each on CUDA).

    Use `build`; `close` writes Ray's timeline, ends the process group and shuts Ray down.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer: Any, actors: list, info: dict[str, Any], owns_ray: bool):
        self.cfg, self.run_dir, self.tokenizer, self.actors, self.owns_ray = cfg, run_dir, tokenizer, actors, owns_ray
        self.num_ranks = len(actors)
        self.max_context_tokens, self.rope_factor = info["max_context_tokens"], info["rope_factor"]
        self.model_summary = info["model_summary"]
        self.on_policy = is_on_policy(cfg)
        self._linked = False

    @classmethod
    def build(cls, cfg: RunConfig, run_dir: Path) -> RayWorkerGroup:
        """Start Ray, place the ranks, form the process group and load the shards.

        Raises:
            ValueError: see `start_ray`; the disk check (`check_disk_space`).
        """
        check_disk_space(run_dir, checkpoint_bytes(cfg), lora=cfg.model.lora.rank > 0)
        tokenizer = load_policy_tokenizer(cfg.model)
        owns_ray = start_ray(cfg, run_dir)
        import ray

        from packrl.distributed.fsdp_worker import FSDPWorker

        gpus = 1 if torch.cuda.is_available() else 0
        loopback = cfg.trainer.ray_address is None
        actors: list = []
        try:
            remote = ray.remote(num_cpus=cfg.trainer.num_cpus_per_worker, num_gpus=gpus)(FSDPWorker)
            actors = [remote.remote(cfg, rank, cfg.trainer.num_workers, loopback) for rank in range(cfg.trainer.num_workers)]
            host, port = _gather(actors[0].address.remote())
            infos = _gather([a.setup.remote(host, port) for a in actors])
        except BaseException:  # a failed set-up or Ctrl-C leaves no actor and no Ray of ours behind
            for actor in actors:
                ray.kill(actor)
            if owns_ray:
                ray.shutdown()
            raise
        logger.info("%d data-parallel workers ready (rendezvous %s:%d)", len(actors), host, port)
        return cls(cfg, run_dir, tokenizer, actors, infos[0], owns_ray)

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        """Each rank generates for its share of the prompts, with the prompts' own seeds (drawn
        here from torch's RNG as the single-process engine draws them), so the responses are the
        ones one process would sample."""
        import ray

        seeds = torch.randint(0, 1 << 62, (len(prompts.prompt_ids),)).tolist()
        costs = [len(p) + params.max_response_tokens for p in prompts.prompt_ids]
        parts = [p for p in karmarkar_karp(costs, min(self.num_ranks, len(costs))) if p]

        def run() -> list:
            calls = [self.actors[r].generate.remote([prompts.prompt_ids[i] for i in part], params, [seeds[i] for i in part])
                     for r, part in enumerate(parts)]
            out: list = [None] * len(costs)
            for part, groups in zip(parts, _gather(calls)):
                for i, group in zip(part, groups):
                    out[i] = group
            return out

        groups = generate_with_retry(run, prompts)
        return RolloutBatch(prompts, params.n, tuple(r for group in groups for r in group))

    def compute_logprobs(self, rollout: RolloutBatch, role: Role) -> LogprobResult | None:
        """Log-probs over the ranks' balanced shares (equal micro-batch counts), in sequence order."""
        import ray

        if (role == "ref" and self.cfg.algorithm.kl_coef == 0) or (role == "actor" and self.on_policy):
            return None
        plan = balance_ranks(rollout.sequence_lengths(), self.num_ranks, self.cfg.train.max_tokens_per_logprob_microbatch,
                             balance_microbatches=self.cfg.train.balance_microbatches,
                             budget_key="train.max_tokens_per_logprob_microbatch")
        shared = ray.put(rollout)
        calls = [a.compute_logprobs.remote(shared, role, [list(mb) for mb in p.microbatches]) for a, p in zip(self.actors, plan.ranks)]
        merged: dict[int, tuple] = {}
        for part in _gather(calls):
            merged.update(part)
        assert sorted(merged) == list(range(len(rollout))), "every sequence comes back exactly once"
        return LogprobResult(tuple(merged[i][0] for i in range(len(rollout))), tuple(merged[i][1] for i in range(len(rollout))),
                             tuple(mb for p in plan.ranks for mb in p.microbatches))

    def update(self, batch: TrainBatch, tracer: NullTracer = NullTracer()) -> dict[str, float]:
        """Every rank updates on its share of each mini-batch; metrics merged over ranks, plus
        ``seqlen/rank_imbalance`` (costliest rank over the mean, averaged over mini-batches)."""
        import ray

        plans, imbalance = self._minibatch_plans(batch)
        shared = ray.put(batch)
        results = _gather([a.update.remote(shared, plans[r]) for r, a in enumerate(self.actors)])
        for rank, (_, spans) in enumerate(results):
            tracer.add_worker_spans(rank, spans)
        if not self._linked:
            tracer.link("ray_timeline", RAY_TIMELINE_FILE)
            self._linked = True
        return update_metrics([stats for stats, _ in results], batch, self.cfg) | {"seqlen/rank_imbalance": imbalance}

    def _minibatch_plans(self, batch: TrainBatch) -> tuple[list[dict[int, list[list[int]]]], float]:
        """Per rank: first index of each mini-batch -> that rank's micro-batches (sequence indices)."""
        group, num_prompts = batch.rollout.group_size, len(batch.rollout.prompts)
        mini = self.cfg.train.mini_batch_size or num_prompts
        lengths = batch.rollout.sequence_lengths()
        plans: list[dict[int, list[list[int]]]] = [{} for _ in self.actors]
        imbalances = []
        for start in range(0, num_prompts, mini):
            indices = list(range(start * group, min(start + mini, num_prompts) * group))
            plan = balance_ranks([lengths[i] for i in indices], self.num_ranks, self.cfg.train.max_tokens_per_microbatch,
                                 balance_microbatches=self.cfg.train.balance_microbatches)
            imbalances.append(plan.imbalance())
            for rank, rank_plan in enumerate(plan.ranks):
                plans[rank][indices[0]] = [[indices[j] for j in mb] for mb in rank_plan.microbatches]
        return plans, sum(imbalances) / len(imbalances)

    def save_checkpoint(self, run_dir: Path, step: int, trainer_state: dict) -> Path:
        import ray

        paths = _gather([a.save_checkpoint.remote(str(run_dir), step, trainer_state) for a in self.actors])
        self._write_timeline()
        return Path(paths[0])

    def load_checkpoint(self, path: Path) -> dict:
        import ray

        _gather([a.load_checkpoint.remote(str(path)) for a in self.actors])
        return load_trainer_state(path)[0]

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
        import ray

        if not ray.is_initialized():
            return
        try:
            self._write_timeline()
            if graceful:
                ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as err:  # noqa: BLE001 - closing after a failure must not hide the failure
            logger.warning("closing the workers: %s: %s", type(err).__name__, err)
        finally:
            for actor in self.actors:
                ray.kill(actor)
            if self.owns_ray:
                ray.shutdown()


@contextlib.contextmanager
def open_worker_group(cfg: RunConfig, run_dir: Path, given: Any = None) -> Iterator[Any]:
    """The run's worker group: ``given`` as is (its owner closes it), else `LocalWorkerGroup` for
    ``trainer.num_workers=1`` or `RayWorkerGroup`, closed when the block ends (also on errors)."""
    if given is not None:
        yield given
        return
    if cfg.trainer.num_workers == 1:
        from packrl.distributed.local import LocalWorkerGroup

        yield LocalWorkerGroup.build(cfg, run_dir=run_dir)
        return
    group = RayWorkerGroup.build(cfg, run_dir)
    try:
        yield group
    except BaseException:
        group.close(graceful=False)
        raise
    group.close()
