"""The liveness of a run's Ray actors and nodes, as the controller sees it.

Every call the controller makes to its rank actors (`packrl.distributed.ray_group.RayActors`)
or rollout workers (`packrl.distributed.rollout_pool.RolloutPool`) is waited on by `wait_all`:
a loop of ``ray.wait`` that returns once every call is done and meanwhile, once a second,
checks that the nodes of the actors still running are alive (``ray.nodes()``). A dead actor, a
dead node, or a collective that failed on a survivor (a gloo or NCCL error, a rank waiting past
``trainer.collective_timeout_s``) is raised as `WorkerLost`: what died (role, actor, process),
where (node id and address), in which call, and why when Ray knows (killed, out of memory, its
node lost, its process gone). A survivor blocked in a collective with a dead peer is never
waited on: the first report of a death ends the wait, and the group is torn down by killing its
actors (`packrl.trainer.recovery` then restarts the run, or the run fails).

The same module checks what a cluster must offer before a run starts: room for every actor on
the nodes it has (`placement_shortfall`), and the same ``train.out_dir`` on every node
(`check_shared_dir`: each node reads a marker the controller wrote and writes one back).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

POLL_S = 1.0
"""How often `wait_all` checks the nodes of the actors it waits on (seconds)."""
GRACE_S = 10.0
"""After one actor's call raised, how long `wait_all` still waits for the others: a survivor's
collective error (a peer's socket closed) may reach the controller before Ray reports the peer's
death, which is then the error to report."""
SHARED_DIR_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ActorRecord:
    """Where one of the run's actors lives (written to ``RUN_DIR/workers.json``).

    Attributes:
        role: ``rank 1``, ``rollout worker 0``.
        actor_name: the Ray actor's name (``ray list actors`` shows it).
        actor_id: Ray's actor id (hex).
        node_id: Ray's id of the node it runs on (hex).
        node_ip: that node's address.
        pid: its process id on that node.
    """

    role: str
    actor_name: str
    actor_id: str
    node_id: str
    node_ip: str
    pid: int


class Located:
    """Mixed into an actor class: `location` says where the actor runs."""

    def location(self) -> tuple[str, str, str, int]:
        """``(actor id, node id, node address, pid)`` of this actor."""
        import ray

        context = ray.get_runtime_context()
        return context.get_actor_id() or "", context.get_node_id(), ray.util.get_node_ip_address(), os.getpid()


def locate(actors: Sequence[Any], roles: Sequence[str], names: Sequence[str]) -> list[ActorRecord]:
    """The `ActorRecord` of each actor (a call each; the actors must mix in `Located`).

    Raises:
        RuntimeError: an actor that could not start (its constructor's error).
        WorkerLost: an actor or its node died meanwhile.
    """
    pending = [ActorRecord(role, name, "", "", "", 0) for role, name in zip(roles, names, strict=True)]
    found = wait_all([a.location.remote() for a in actors], pending, "start")
    return [ActorRecord(role, name, *where) for role, name, where in zip(roles, names, found, strict=True)]


class WorkerLost(RuntimeError):
    """An actor of the run, or its node, is gone: the group cannot go on, a fresh one can.

    Args:
        record: the actor that died (or whose node died, or whose collective failed).
        stage: the call it was in (``update``, ``save_checkpoint``, ``generate``, ...).
        kind: ``killed`` (``ray.kill``), ``oom``, ``node_lost``, ``process_died`` (a signal, the
            kernel's OOM killer, a crash: Ray cannot tell them apart), ``exited`` (the process
            exited by itself) or ``collective`` (a survivor's collective failed or timed out and
            no death was reported).
        cause: Ray's words on why (its first lines), or the collective's error.
        step: the step in progress, set by the supervisor (`at_step`).
    """

    def __init__(self, record: ActorRecord, stage: str, kind: str, cause: str, step: int | None = None):
        self.record, self.stage, self.kind, self.cause, self.step = record, stage, kind, cause, step
        self.detected_at = time.time()
        super().__init__(self._message())

    def _message(self) -> str:
        r = self.record
        when = f" of step {self.step}" if self.step is not None else ""
        where = f"on node {r.node_id[:12] or '?'} ({r.node_ip or '?'})"
        return (f"{r.role} (Ray actor {r.actor_name or '?'}, pid {r.pid or '?'}) {where} was lost during {self.stage}{when}: "
                f"{_KIND_WORDS.get(self.kind, self.kind)}; Ray: {self.cause}")

    def at_step(self, step: int) -> WorkerLost:
        """This error with the step in progress named (the supervisor knows it, the transport does not)."""
        self.step = step
        self.args = (self._message(),)
        return self

    def to_json(self) -> dict[str, Any]:
        """The failure as ``RUN_DIR/restarts.jsonl`` records it."""
        return asdict(self.record) | {"stage": self.stage, "step": self.step, "kind": self.kind, "cause": self.cause}


_KIND_WORDS = {
    "killed": "it was killed with ray.kill",
    "oom": "it ran out of memory",
    "node_lost": "its node is gone",
    "process_died": "its process died (a signal, the kernel's OOM killer or a crash)",
    "exited": "its process exited",
    "collective": "a collective failed on it (a peer lost, or trainer.collective_timeout_s passed)",
}


def lost_from_error(record: ActorRecord, err: Exception, stage: str) -> WorkerLost:
    """`WorkerLost` from Ray's ``RayActorError``, its kind read from Ray's message (Ray 2.x's
    words: ``killed by `ray.kill```, ``node has died``, ``running low on memory`` / ``memory
    pressure`` from Ray's memory monitor, ``exit code``); a process that vanished is ``process_died``."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line and line.split(":", 1)[0] in _FIELDS)
    said = " ".join(line for line in lines[1:] if line.split(":", 1)[0] not in _FIELDS)
    text = " ".join(lines).lower()
    if "ray.kill" in text:
        kind = "killed"
    elif "node has died" in text or "node died" in text:
        kind = "node_lost"
    elif "low on memory" in text or "memory pressure" in text:
        kind = "oom"
    elif re.search(r"exit code \d+", text) and "unexpectedly" not in text:
        kind = "exited"
    else:
        kind = "process_died"
    pid = fields.get("pid", "").strip()
    if not record.pid and pid.isdigit():  # an actor lost before it said where it runs
        record = ActorRecord(record.role, record.actor_name, record.actor_id, record.node_id, fields.get("ip", "").strip(), int(pid))
    return WorkerLost(record, stage, kind, (said or (lines[0] if lines else type(err).__name__))[:600])


_FIELDS = ("class_name", "actor_id", "pid", "namespace", "ip", "name")
"""The header lines of Ray's ActorDiedError message (the rest says why)."""


def _collective_error(cause: BaseException | None) -> bool:
    """A failed or timed-out torch.distributed collective (gloo's transport errors are plain
    RuntimeErrors that name their source file; NCCL's and the store's are DistError subclasses)."""
    if cause is None:
        return False
    try:
        from torch.distributed import DistError
    except ImportError:  # torch built without distributed
        DistError = ()  # type: ignore[assignment,misc]
    return isinstance(cause, DistError) or (isinstance(cause, RuntimeError) and "/gloo/" in str(cause))


def wait_all(refs: Sequence[Any], holders: Sequence[ActorRecord], stage: str) -> list[Any]:
    """The results of ``refs`` (one call per actor, ``holders[i]`` made ``refs[i]``), in order.

    Waits with ``ray.wait`` and checks the pending actors' nodes every `POLL_S`. An actor's own
    exception is raised as itself (not wrapped in Ray's header) once the others are done or
    `GRACE_S` has passed, unless an actor died meanwhile.

    Raises:
        WorkerLost: an actor died (Ray's memory monitor's kill included), its node died, a result
            was lost with its node, or its collective failed (`_collective_error`).
        RuntimeError: an actor whose constructor raised (its error's text).
        Exception: a call's own exception.
    """
    import ray
    from ray.exceptions import ObjectLostError, OutOfMemoryError, RayActorError, RayTaskError

    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    failure: tuple[int, Any] | None = None
    deadline = float("inf")
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except RayActorError as err:
                if err.actor_init_failed:
                    raise RuntimeError(f"{holders[i].role} could not start: {err}") from None
                raise lost_from_error(holders[i], err, stage) from None
            except OutOfMemoryError as err:  # Ray's memory monitor killed the call's worker
                raise WorkerLost(holders[i], stage, "oom", str(err)[:600]) from None
            except ObjectLostError as err:  # the result was on a node that is gone
                raise WorkerLost(holders[i], stage, "node_lost", str(err).strip().splitlines()[0][:600]) from None
            except RayTaskError as err:
                if failure is None:
                    failure, deadline = (i, err), time.monotonic() + GRACE_S
        if pending:
            dead = dead_node_holder([holders[index[ref]] for ref in pending], stage)
            if dead is not None:
                raise dead
        if failure is not None and time.monotonic() > deadline:
            break
    if failure is not None:
        i, raised = failure
        cause = getattr(raised, "cause", None)
        if _collective_error(cause):
            raise WorkerLost(holders[i], stage, "collective", f"{type(cause).__name__}: {str(cause).splitlines()[0][:400]}") from None
        if isinstance(cause, Exception):
            raise cause from None
        raise raised
    return results


def dead_node_holder(holders: Sequence[ActorRecord], stage: str) -> WorkerLost | None:
    """`WorkerLost` for the first of ``holders`` whose node Ray reports dead, else None."""
    import ray

    ids = {h.node_id for h in holders if h.node_id}
    if not ids:
        return None
    dead = {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in ids and not n["Alive"]}
    for holder in holders:
        node = dead.get(holder.node_id)
        if node is not None:
            why = node.get("DeathReasonMessage") or "no reason given"
            return WorkerLost(holder, stage, "node_lost", f"node {holder.node_id} ({holder.node_ip}) is dead: {why}")
    return None


# What a cluster must offer before a run starts (and again before a restart).


def alive_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()`` of the nodes alive now."""
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def describe_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    """``node 1a2b3c (10.0.0.2): CPU 8, GPU 1; ...`` of ``nodes`` (``ray.nodes()`` entries)."""
    if not nodes:
        return "no node alive"
    parts = []
    for n in nodes:
        res = n.get("Resources", {})
        have = ", ".join(f"{k} {res[k]:g}" for k in ("CPU", "GPU") if res.get(k))
        parts.append(f"node {n['NodeID'][:12]} ({n['NodeManagerAddress']}): {have or 'no CPU or GPU'}")
    return "; ".join(parts)


def placement_shortfall(bundles: Sequence[dict[str, float]], nodes: Sequence[dict[str, Any]]) -> int:
    """How many of ``bundles`` (each one actor's resources, e.g. ``{"CPU": 1}``) the ``nodes``'
    total resources cannot hold at once, first fit by decreasing size (0 = they all fit; first
    fit is a heuristic: it may report a shortfall where a cleverer packing would fit, never the
    reverse)."""
    room = [dict(n.get("Resources", {})) for n in nodes]
    missing = 0
    for bundle in sorted(bundles, key=lambda b: tuple(-b.get(k, 0.0) for k in ("GPU", "CPU"))):
        for free in room:
            if all(free.get(k, 0.0) >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    free[k] -= v
                break
        else:
            missing += 1
    return missing


def wait_for_room(bundles: Sequence[dict[str, float]], timeout_s: float, what: str, fix: str) -> float:
    """Wait until the alive nodes can hold ``bundles`` (`placement_shortfall`); return the seconds waited.

    Raises:
        RuntimeError: still short after ``timeout_s``, naming ``what`` the bundles are, the nodes'
            resources and ``fix``.
    """
    start = time.monotonic()
    while True:
        nodes = alive_nodes()
        missing = placement_shortfall(bundles, nodes)
        if not missing:
            return time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            raise RuntimeError(f"after {timeout_s:g} s the Ray cluster still lacks room for {missing} of the {len(bundles)} actors "
                               f"{what} needs ({describe_nodes(nodes)}); {fix}")
        time.sleep(POLL_S)


def probe_dir(path: str, token: str, node_id: str) -> str | None:
    """Run on one node: read the controller's marker in ``path`` and write this node's; None when
    both worked, else what failed."""
    mine = Path(path) / f".packrl-shared-{token}"
    try:
        seen = mine.read_text()
    except OSError as err:
        return f"cannot read the controller's marker {mine} ({type(err).__name__}: {err})"
    if seen != token:
        return f"reads other contents in {mine} (another folder by the same name)"
    try:
        (Path(path) / f".packrl-shared-{token}-{node_id}").write_text(node_id)
    except OSError as err:
        return f"cannot write into {path} ({type(err).__name__}: {err})"
    return None


def check_shared_dir(run_dir: Path, probe: Callable[[str, str, str], str | None] = probe_dir) -> None:
    """Every alive node reads a marker the controller wrote into ``run_dir`` and writes one back,
    which the controller reads (a task pinned to each node, ``probe`` run there): checkpoints
    written by one node's rank are then read by every other's.

    Raises:
        ValueError: a node that does not share ``run_dir`` with the controller, naming it, what
            failed and the fix (``train.out_dir`` on a file system every node mounts at the same path).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = alive_nodes()
    token = secrets.token_hex(8)
    marker = run_dir / f".packrl-shared-{token}"
    marker.write_text(token)
    remote = ray.remote(num_cpus=0)(probe)
    try:
        refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            str(run_dir), token, n["NodeID"]) for n in nodes]
        replies = ray.get(refs, timeout=SHARED_DIR_TIMEOUT_S)
        problems = []
        for node, reply in zip(nodes, replies):
            theirs = run_dir / f".packrl-shared-{token}-{node['NodeID']}"
            if reply is None and not theirs.is_file():
                reply = f"writes a marker the controller cannot see ({theirs.name})"
            if reply is not None:
                problems.append(f"node {node['NodeID'][:12]} ({node['NodeManagerAddress']}) {reply}")
    finally:
        for path in run_dir.glob(f".packrl-shared-{token}*"):
            path.unlink(missing_ok=True)
    if problems:
        raise ValueError(f"train.out_dir={str(run_dir)!r} is not the same folder on every node of the Ray cluster: "
                         f"{'; '.join(problems)}; set train.out_dir to a path on a file system every node mounts at that path "
                         "(NFS, a cluster file system), where checkpoints written by one node are read by all")
