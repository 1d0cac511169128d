"""Recovery from lost Ray actors and nodes, on a real multi-node Ray cluster on this machine
(`tests.distributed.faults.local_cluster`: a head and 3 nodes of 1 CPU, every raylet on 127.0.0.1).

Each fault kind is recovered once automatically (``trainer.max_restarts``): a rank's process
killed with SIGKILL, a rank killed inside a checkpoint write, a rollout worker killed with
``ray.kill``, a rollout worker killed inside a weight sync, and a node removed from the cluster.
The run then ends with the weights of a run never interrupted (float64, `LAYOUT`;
tests/same_training.py gives the tolerances) and every step's prompts those of that run (each
trained once); with ``trainer.max_restarts=0`` a lost rank ends the run naming the actor and node.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster of 4 raylets and several worker groups

from packrl.config import load_config  # noqa: E402
from packrl.distributed.health import WorkerLost, check_shared_dir, probe_dir  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from tests.builders import LAYOUT, RAY_COMMON, metric_lines  # noqa: E402
from tests.diagnostics.tiny_run import BASE  # noqa: E402
from tests.distributed.faults import (  # noqa: E402
    Fault,
    Injector,
    after_step,
    fault_plugin,
    kill_rank,
    kill_rollout_worker,
    listening_beyond_loopback,
    local_cluster,
    remove_node_of,
    restart_lines,
)
from tests.same_training import assert_same_training  # noqa: E402

NODES = 3
SYNC = [*RAY_COMMON, *LAYOUT, "train.save_every=1", "train.total_steps=8"]
SEPARATE = [*BASE, *LAYOUT, "trainer.rollout_mode=separate_async", "trainer.num_rollout_workers=1", "rollout.over_provision=1",
            "rollout.partial_chunk_tokens=4", "reward.name=test_letter_e", "train.dump_rollouts=true", "train.save_every=1",
            "train.total_steps=5"]


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(NODES) as running:
        yield running


@pytest.fixture
def full_cluster(cluster):
    """The cluster with all its nodes (a test before may have removed one)."""
    cluster.ensure_nodes(NODES)
    return cluster


def _train(out, model_dir, *overrides):
    return train(load_config("demo", [f"train.out_dir={out}", f"model.path={model_dir}", *overrides]))


def _rows(run_dir, step):
    return [json.loads(line)["row"] for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def _assert_trained_as(straight, recovered, steps):
    """Every step logged once, each step's prompts those of the straight run, the same final training."""
    assert [line["step"] for line in metric_lines(recovered)] == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert _rows(recovered, step) == _rows(straight, step), step
    drawn = [row for step in range(1, steps + 1) for row in set(_rows(recovered, step))]
    assert len(drawn) == len(set(drawn)), "a prompt trained in two steps"
    assert_same_training(straight / "checkpoints" / f"step_{steps}", recovered / "checkpoints" / f"step_{steps}")


def _assert_restarts(run_dir, expected: list[tuple[str, str]]):
    """restarts.jsonl holds one line per ``(role, kind)`` (in any order), each complete."""
    lines = restart_lines(run_dir)
    assert sorted((line["failed"]["role"], line["failed"]["kind"]) for line in lines) == sorted(expected), lines
    for line in lines:
        assert line["failed"]["node_id"] and line["failed"]["pid"] and line["failed"]["stage"], line
        assert line["resumed_from"] is None or "/checkpoints/step_" in line["resumed_from"], line  # never a .tmp-step_N
        assert line["steps_redone"] == line["last_logged_step"] - line["resumed_step"] >= 0
        assert line["seconds_lost"] is not None and line["seconds_lost"] >= line["work_lost_s"], line
    assert metric_lines(run_dir)[-1]["train/restarts"] == len(expected)
    return lines


def test_a_killed_rank_a_kill_inside_a_checkpoint_write_and_a_lost_node_are_recovered(tmp_path, model_dir, full_cluster):
    """2 ranks spread over the nodes: rank 1's process killed with SIGKILL after step 1; rank 0
    killed inside the next checkpoint write after the first restart (a `.tmp-step_N` left, never
    resumed from); then the node of rank 1 removed. The run ends as a run never interrupted."""
    straight = _train(tmp_path / "straight", model_dir, *SYNC)  # one process: the same training as 2 ranks (LAYOUT)
    plugin = fault_plugin(tmp_path / "plugins", "checkpoint_write")
    faults = [Fault("kill rank 1", after_step(1), kill_rank(1)),
              Fault("kill inside the next checkpoint write", after_step(1, restarts=1), plugin.arm),
              Fault("remove the node of rank 1", after_step(1, restarts=2), remove_node_of(full_cluster, "workers.json", "rank 1"))]
    out = tmp_path / "recovered"
    with Injector(out, faults) as injector:
        _train(out, model_dir, *SYNC, "trainer.num_workers=2", f"trainer.ray_address={full_cluster.address}",
               "trainer.placement=spread", "trainer.max_restarts=3", "trainer.restart_wait_s=60", f"trainer.plugins=[{plugin.path}]")
    assert all(f.done_at for f in faults) and len(plugin.fired()) == 1, injector.errors
    lines = _assert_restarts(out, [("rank 1", "process_died"), ("rank 0", "process_died"), ("rank 1", "node_lost")])
    assert any(line["failed"]["stage"] == "save_checkpoint" and line["failed"]["role"] == "rank 0" for line in lines)
    _assert_trained_as(straight, out, 8)


def test_a_killed_rollout_worker_a_kill_inside_a_weight_sync_and_a_lost_node_are_recovered(tmp_path, model_dir, full_cluster):
    """separate_async with one rollout worker: killed with ray.kill after step 1, killed inside
    the next weight sync after the first restart, then its node removed. The ledger and the
    weights end as in the run never interrupted."""
    address = f"trainer.ray_address={full_cluster.address}"
    straight = _train(tmp_path / "straight", model_dir, *SEPARATE, address)
    plugin = fault_plugin(tmp_path / "plugins", "weight_sync")
    faults = [Fault("ray.kill the rollout worker", after_step(1), kill_rollout_worker(0)),
              Fault("kill inside the next weight sync", after_step(1, restarts=1), plugin.arm),
              Fault("remove the node of the rollout worker", after_step(1, restarts=2),
                    remove_node_of(full_cluster, "rollout_workers.json", "rollout worker 0"))]
    out = tmp_path / "recovered"
    with Injector(out, faults) as injector:
        _train(out, model_dir, *SEPARATE, address, "trainer.max_restarts=3", f"trainer.plugins=[{plugin.path}]")
    assert all(f.done_at for f in faults) and len(plugin.fired()) == 1, injector.errors
    lines = _assert_restarts(out, [("rollout worker 0", "killed"), ("rollout worker 0", "process_died"),
                                   ("rollout worker 0", "node_lost")])
    assert any(line["failed"]["stage"] == "weight sync" for line in lines)
    a, b = metric_lines(straight), metric_lines(out)
    assert [line["async/ledger_trained"] for line in b] == [line["async/ledger_trained"] for line in a]
    _assert_trained_as(straight, out, 5)


def test_without_restarts_a_lost_rank_ends_the_run_naming_it(tmp_path, model_dir, full_cluster):
    """trainer.max_restarts=0: rank 1 killed with SIGKILL ends the run at once (the survivor's
    collective is not waited for), the error naming the rank, its Ray actor and node, the step and
    how to continue. Mid-run, nothing of the cluster or the ranks listens beyond loopback."""
    out = tmp_path / "run"
    listening: list = []

    def look_then_kill(run_dir):
        listening.extend(listening_beyond_loopback())  # the cluster, its workers and the ranks mid-run
        return kill_rank(1)(run_dir)

    fault = Fault("kill rank 1", after_step(1), look_then_kill)
    with Injector(out, [fault]) as injector, pytest.raises(WorkerLost) as failure:
        _train(out, model_dir, *SYNC, "trainer.num_workers=2", f"trainer.ray_address={full_cluster.address}",
               "trainer.collective_timeout_s=600")
    ended = time.time()
    assert fault.done_at is not None, injector.errors
    record = json.loads((out / "workers.json").read_text())[1]
    message = str(failure.value) + " ".join(failure.value.__notes__)
    for part in ("rank 1", record["actor_name"], record["node_id"][:12], "127.0.0.1", str(record["pid"]), "step ",
                 "trainer.max_restarts=0", "train.resume=auto"):
        assert part in message, (part, message)
    assert failure.value.kind == "process_died"
    assert ended - fault.done_at < 600, "the run waited for the collective timeout instead of Ray's report of the death"
    assert not (out / "restarts.jsonl").exists()
    assert not listening, f"sockets listening beyond loopback: {listening}"


@pytest.mark.parametrize("overrides, short", [(["trainer.num_workers=4", "train.mini_batch_size=2"], "1 of 4"),
                                              (["trainer.num_workers=2", "trainer.num_cpus_per_worker=2"], "2 of 2")])
def test_a_cluster_that_can_never_hold_the_ranks_is_refused_before_step_1(tmp_path, model_dir, full_cluster, overrides, short):
    """3 nodes of 1 CPU: 4 ranks never fit, nor 2 ranks of 2 CPUs each (3 CPUs in all, but no node holds 2)."""
    with pytest.raises(ValueError) as refused:
        _train(tmp_path / "run", model_dir, *SYNC, f"trainer.ray_address={full_cluster.address}", *overrides)
    message = str(refused.value)
    for part in (overrides[0], short, "(127.0.0.1): CPU 1", "add nodes", "trainer.num_cpus_per_worker"):
        assert part in message, (part, message)
    assert not (tmp_path / "run" / "workers.json").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_node_must_see_the_run_dir(tmp_path, full_cluster):
    """Each node reads the controller's marker and writes its own; a node whose folder by that
    name is another (a local disk) is named."""
    import ray

    private = tmp_path / "private"
    private.mkdir()
    ray.init(address=full_cluster.address, log_to_driver=False)
    try:
        check_shared_dir(tmp_path)  # one machine: every node sees it
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        victim = nodes[-1]

        def local_disk_on_one_node(path: str, token: str, node_id: str) -> str | None:
            return probe_dir(str(private) if node_id == victim else path, token, node_id)

        with pytest.raises(ValueError) as refused:
            check_shared_dir(tmp_path, probe=local_disk_on_one_node)
    finally:
        ray.shutdown()
    message = str(refused.value)
    assert f"node {victim[:12]} (127.0.0.1) cannot read the controller's marker" in message and "train.out_dir" in message
    assert not [n for n in nodes if n != victim and n[:12] in message], "only the node with its own disk is named"
    assert not list(tmp_path.glob(".packrl-shared-*")), "the markers are removed"
