"""Faults injected into a run on a local multi-node Ray cluster (the recovery tests and
bench/bench_faults.py).

- `local_cluster`: Ray's own `ray.cluster_utils.Cluster`, several raylets on 127.0.0.1 (Ray's
  single-machine mode: every Ray server binds to loopback), its temp dir in a short folder of its
  own (Ray's Unix socket paths hold 107 bytes), stopped on exit.
- `fault_plugin`: a ``trainer.plugins`` file that SIGKILLs its own process at a named point of
  the product's code (inside a checkpoint write on a rank, inside a weight sync on a rollout
  worker) once the injector arms it: the product has no fault hook of its own; the plugin wraps
  the function where the fault should land, in the processes that import it (every rank and
  rollout worker).
- `Injector`: a thread that watches RUN_DIR while `packrl.trainer.loop.train` runs in the main
  thread and, when a fault's condition holds, kills a rank's process (its pid from
  ``RUN_DIR/workers.json``), kills a rollout worker with ``ray.kill`` (its name from
  ``RUN_DIR/rollout_workers.json``) or removes a rank's or rollout worker's node from the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLUGIN = '''"""Fault injection: SIGKILL this process at {point!r} once the injector has armed it."""
import json
import os
import signal
import time

_ARM, _FIRED = {arm!r}, {fired!r}


def _in_actor():
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _fire():
    """Kill this process if the fault is armed; the first process to take the arm file (an atomic
    rename) is the only one killed, and leaves when and where it died."""
    record = os.path.join(_FIRED, f"{{time.time_ns()}}-{{os.getpid()}}.json")
    try:
        os.rename(_ARM, record)
    except FileNotFoundError:
        return
    with open(record, "w") as f:
        json.dump({{"pid": os.getpid(), "time": time.time()}}, f)
    os.kill(os.getpid(), signal.SIGKILL)


if not _in_actor():
    pass  # the controller imports plugins too (and Ray ships the actor classes from there): nothing is wrapped there
elif {point!r} == "checkpoint_write":
    import packrl.worker.checkpoint as _checkpoint

    _fsync_tree = _checkpoint.fsync_tree

    def _fsync_then_die(path):  # the files are written, the folder not yet renamed to step_N
        _fsync_tree(path)
        _fire()

    _checkpoint.fsync_tree = _fsync_then_die
elif {point!r} == "weight_sync":  # the engine's class: Ray binds an actor's own methods when it starts
    from packrl.rollout.hf_engine import HFEngine

    _load_weights = HFEngine.load_weights

    def _die_while_loading(self, weights):
        _fire()
        return _load_weights(self, weights)

    HFEngine.load_weights = _die_while_loading
'''


@dataclass(frozen=True)
class Plugin:
    """A ``trainer.plugins`` file that kills the actor process reaching its point once armed."""

    path: Path
    arm_file: Path
    fired_dir: Path

    def arm(self, run_dir: Path | None = None) -> bool:
        """The next actor process to reach the point dies (an action for `Fault`)."""
        self.arm_file.write_text("armed")
        return True

    def fired(self) -> list[dict]:
        """``{"pid", "time"}`` of every process it killed, in order."""
        return [json.loads(p.read_text()) for p in sorted(self.fired_dir.glob("*.json"))]


def fault_plugin(folder: Path, point: str) -> Plugin:
    """A plugin that SIGKILLs the actor process reaching ``point`` once armed (`Plugin.arm`):
    ``checkpoint_write``: a rank's ``fsync_tree`` of a checkpoint's temporary folder (the files
    written, the folder not yet renamed); ``weight_sync``: a rollout worker's HF engine about to
    load the weights a sync pushed. Each arming kills one process."""
    assert point in ("checkpoint_write", "weight_sync"), point
    fired = folder / f"fired-{point}"
    fired.mkdir(parents=True, exist_ok=True)
    plugin = Plugin(folder / f"fault_{point}.py", folder / f"armed-{point}", fired)
    plugin.path.write_text(PLUGIN.format(point=point, arm=str(plugin.arm_file), fired=str(fired)))
    return plugin


@dataclass
class LocalCluster:
    """A running `ray.cluster_utils.Cluster` (``address`` for ``trainer.ray_address``)."""

    cluster: Any
    address: str
    cpus_per_node: int

    def worker_node(self, node_id: str) -> Any:
        """The non-head node with Ray id ``node_id``, or None (the head, or gone)."""
        return next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)

    def ensure_nodes(self, count: int) -> None:
        """Add worker nodes until the cluster has ``count`` besides the head (after a test removed some)."""
        while len(self.cluster.worker_nodes) < count:
            self.cluster.add_node(num_cpus=self.cpus_per_node, node_ip_address="127.0.0.1", object_store_memory=_STORE)

    def pids(self) -> set[int]:
        """The processes the cluster's nodes started (GCS, raylets, their helpers)."""
        nodes = [self.cluster.head_node, *self.cluster.worker_nodes]
        return {info.process.pid for node in nodes if node is not None for infos in node.all_processes.values() for info in infos}


_STORE = 80 << 20  # bytes of object store per node: the tiny model's batches and weights are small
LIVE_CLUSTERS: list[LocalCluster] = []
"""The clusters running now (tests/distributed/conftest.py does not count their processes as left behind)."""


@contextlib.contextmanager
def local_cluster(num_nodes: int, cpus_per_node: int = 1) -> Iterator[LocalCluster]:
    """A head with no CPUs (so no actor lands on the node the driver is connected to, which
    cannot be removed) and ``num_nodes`` worker nodes of ``cpus_per_node`` CPUs, all raylets on
    127.0.0.1, with a private temp dir; shut down (every node's processes stopped) when the block ends."""
    import ray
    from ray.cluster_utils import Cluster

    from packrl.distributed.ray_group import _single_machine_mode

    temp = Path(tempfile.mkdtemp(prefix="prc-"))  # short: Ray's socket paths live under it
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    os.environ.update(RAY_TMPDIR=str(temp), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    _single_machine_mode()
    cluster = Cluster(initialize_head=True, shutdown_at_exit=False, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": _STORE})
    handle = LocalCluster(cluster, cluster.address, cpus_per_node)
    LIVE_CLUSTERS.append(handle)
    try:
        handle.ensure_nodes(num_nodes)
        yield handle
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        LIVE_CLUSTERS.remove(handle)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp, ignore_errors=True)


def logged_lines(run_dir: Path) -> list[dict]:
    """The records metrics.jsonl holds now."""
    path = run_dir / "metrics.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):  # not written yet, or a line being written
        return []


def restart_lines(run_dir: Path) -> list[dict]:
    """The lines of RUN_DIR/restarts.jsonl."""
    path = run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@dataclass
class Fault:
    """One fault: ``action(run_dir) -> True`` once done, tried while ``ready(run_dir)`` holds;
    ``done_at``: when the action that succeeded began (the moment the fault struck)."""

    name: str
    ready: Callable[[Path], bool]
    action: Callable[[Path], bool]
    done_at: float | None = None


@dataclass
class Injector:
    """Runs ``faults`` in order, each once, from a daemon thread, while the run trains."""

    run_dir: Path
    faults: list[Fault]
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Injector:
        self._thread = threading.Thread(target=self._loop, name="fault-injector", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        for fault in self.faults:
            while not self._stop.is_set():
                try:
                    began = time.time()
                    if fault.ready(self.run_dir) and fault.action(self.run_dir):
                        fault.done_at = began
                        break
                except Exception as err:  # noqa: BLE001 - a run between groups; try again
                    self.errors.append(f"{fault.name}: {type(err).__name__}: {err}")
                time.sleep(0.05)


def after_step(step: int, restarts: int | None = 0) -> Callable[[Path], bool]:
    """Ready once ``restarts`` restarts are recorded (None: any number) and the attempt since the
    last one logged a step at or past ``step``: a step logged by the group running now, whose
    workers.json is current (its ``train/restarts`` counts every restart so far)."""
    def ready(run_dir: Path) -> bool:
        lines = restart_lines(run_dir)
        if restarts is not None and len(lines) != restarts:
            return False
        logged = logged_lines(run_dir)
        if not logged or logged[-1].get("train/restarts", 0) != len(lines):
            return False
        floor = lines[-1]["resumed_step"] if lines else 0
        return logged[-1]["step"] >= max(step, floor + 1)
    return ready


OWNER = "PACKRL_TEST_OWNER"
"""The environment variable tests/distributed/conftest.py sets to mark the processes this pytest process starts."""


def listening_beyond_loopback() -> list[tuple[str, str, int]]:
    """``(process name, address, port)`` of every listening socket, outside loopback, of this
    process and the processes it started (those that inherited its `OWNER` mark)."""
    import psutil

    mark = os.environ.get(OWNER)
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and (mark is None or proc.environ().get(OWNER) != mark):
                continue
            found += [(proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
        except (psutil.Error, OSError):
            continue
    return found


def _record(run_dir: Path, file: str, role: str) -> dict:
    records = json.loads((run_dir / file).read_text())
    return next(r for r in records if r["role"] == role)


def kill_rank(rank: int) -> Callable[[Path], bool]:
    """SIGKILL the process of ``rank`` (its pid from RUN_DIR/workers.json)."""
    def act(run_dir: Path) -> bool:
        os.kill(_record(run_dir, "workers.json", f"rank {rank}")["pid"], signal.SIGKILL)
        return True
    return act


def kill_rollout_worker(index: int) -> Callable[[Path], bool]:
    """``ray.kill`` rollout worker ``index`` (by its name in RUN_DIR/rollout_workers.json)."""
    def act(run_dir: Path) -> bool:
        import ray

        if not ray.is_initialized():
            return False
        ray.kill(ray.get_actor(_record(run_dir, "rollout_workers.json", f"rollout worker {index}")["actor_name"]))
        return True
    return act


def remove_node_of(cluster: LocalCluster, file: str, role: str) -> Callable[[Path], bool]:
    """Remove (stop every process of) the node ``role`` runs on (in RUN_DIR/``file``)."""
    def act(run_dir: Path) -> bool:
        node = cluster.worker_node(_record(run_dir, file, role)["node_id"])
        assert node is not None, f"{role} runs on the head node, which has no CPUs"
        cluster.cluster.remove_node(node)
        return True
    return act
