"""What the controller makes of Ray's reports (no Ray started here): a lost actor's kind, where
and why from Ray's own messages, and whether a cluster's nodes can hold the run's actors."""

from __future__ import annotations

import pytest
import torch

from packrl.distributed.health import ActorRecord, WorkerLost, describe_nodes, lost_from_error, placement_shortfall

RECORD = ActorRecord("rank 1", "packrl-rank1-ab12cd", "fa35ebcdf5c50817431d513a01000000",
                     "5166283bd8e37f1339c3aa15e6bae320d940d5c9808a234fec423ce5", "10.0.0.7", 8595)

_HEADER = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RankActor\n"
           "\tactor_id: fa35ebcdf5c50817431d513a01000000\n\tpid: 8595\n\tnamespace: 1c84982c\n\tip: 10.0.0.7\n")
# Ray 2.60's words, as the recovery tests on a local cluster received them
KILLED_9 = _HEADER + ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
                      "unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was "
                      "killed by the OOM killer due to high memory usage, (2) ray stop --force was called")
RAY_KILL = _HEADER + "The actor is dead because it was killed by `ray.kill`."
NODE_GONE = _HEADER + ("The actor died because its node has died. Node Id: 5166283bd8e37f1339c3aa15e6bae320d940d5c9808a234fec423ce5\n"
                       "\tthe actor's node was terminated expectedly: received SIGTERM")
OOM = _HEADER + ("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: 1 "
                 "worker(s) were killed due to the node running low on memory.")  # the raylet's words (Ray 2.60)


@pytest.mark.parametrize("text, kind, words", [(KILLED_9, "process_died", "its process died"),
                                               (RAY_KILL, "killed", "killed with ray.kill"),
                                               (NODE_GONE, "node_lost", "its node is gone"),
                                               (OOM, "oom", "ran out of memory")])
def test_a_lost_actor_is_named_with_where_when_and_why(text, kind, words):
    lost = lost_from_error(RECORD, RuntimeError(text), "update").at_step(3)
    assert lost.kind == kind
    message = str(lost)
    for part in ("rank 1", "packrl-rank1-ab12cd", "pid 8595", "node 5166283bd8e3 (10.0.0.7)", "during update of step 3", words):
        assert part in message, (part, message)
    assert "class_name" not in lost.cause and "namespace" not in lost.cause, "Ray's header fields are not the cause"
    assert lost.to_json() | {"cause": ""} == {"role": "rank 1", "actor_name": "packrl-rank1-ab12cd", "actor_id": RECORD.actor_id,
                                              "node_id": RECORD.node_id, "node_ip": "10.0.0.7", "pid": 8595, "stage": "update",
                                              "step": 3, "kind": kind, "cause": ""}


def test_an_actor_lost_before_it_said_where_takes_pid_and_address_from_ray():
    unknown = ActorRecord("rollout worker 0", "packrl-rollout0-x", "", "", "", 0)
    lost = lost_from_error(unknown, RuntimeError(KILLED_9), "start")
    assert (lost.record.pid, lost.record.node_ip) == (8595, "10.0.0.7")
    assert isinstance(lost, WorkerLost) and isinstance(lost, RuntimeError)


def _node(name: str, cpus: float, gpus: float = 0.0) -> dict:
    return {"NodeID": name * 10, "NodeManagerAddress": f"10.0.0.{len(name)}", "Alive": True,
            "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_placement_counts_the_actors_no_node_can_hold():
    nodes = [_node("a", 1), _node("b", 1), _node("c", 1)]
    assert placement_shortfall([{"CPU": 1.0}] * 3, nodes) == 0
    assert placement_shortfall([{"CPU": 1.0}] * 4, nodes) == 1
    assert placement_shortfall([{"CPU": 2.0}] * 2, nodes) == 2, "3 CPUs in all, but no node holds 2"
    gpu_nodes = [_node("g", 8, gpus=2), _node("h", 8, gpus=1)]
    assert placement_shortfall([{"CPU": 1.0, "GPU": 1.0}] * 3, gpu_nodes) == 0
    assert placement_shortfall([{"CPU": 1.0, "GPU": 1.0}] * 4, gpu_nodes) == 1
    assert placement_shortfall([{"CPU": 1.0}], []) == 1
    assert describe_nodes(gpu_nodes) == "node gggggggggg (10.0.0.1): CPU 8, GPU 2; node hhhhhhhhhh (10.0.0.1): CPU 8, GPU 1"
    assert describe_nodes([]) == "no node alive"


def test_the_run_reserves_one_bundle_per_ray_actor_from_the_trainer_section():
    from packrl.config.schema import TrainerConfig
    from packrl.distributed.ray_group import run_bundles

    gpu = {"GPU": 1.0} if torch.cuda.is_available() else {}
    assert run_bundles(TrainerConfig(num_workers=1)) == [], "one process: no Ray actor"
    assert run_bundles(TrainerConfig(num_workers=2, num_cpus_per_worker=3)) == [{"CPU": 3.0} | gpu] * 2
    separate = TrainerConfig(num_workers=2, rollout_mode="separate_async", num_rollout_workers=3)
    assert run_bundles(separate) == [{"CPU": float(separate.num_cpus_per_worker)} | gpu] * 5
    assert len(run_bundles(TrainerConfig(num_workers=2, num_rollout_workers=3))) == 2, "rollout workers only under separate_async"
