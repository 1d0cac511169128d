"""`packrl sft` on 2 FSDP2 ranks (Ray, gloo) trains as one process does: a step's traces split
over the ranks under the same global token-mean (float64, tests/same_training.py); a lost rank
restarts the run from its checkpoint (``trainer.max_restarts``), as RL's recovery does."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray and worker processes

import json  # noqa: E402

from packrl.config import load_config  # noqa: E402
from packrl.distributed.group import WorkerGroup  # noqa: E402
from packrl.distributed.health import ActorRecord, WorkerLost  # noqa: E402
from packrl.trainer.sft import sft  # noqa: E402
from tests.invariance.test_sft_invariance import SFT  # noqa: E402
from tests.same_training import assert_same_training  # noqa: E402


def test_sft_on_two_ranks_trains_as_one_process(tmp_path, model_dir):
    runs = {}
    for workers in (1, 2):
        cfg = load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={tmp_path / str(workers)}", *SFT,
                                              f"trainer.num_workers={workers}", "train.max_tokens_per_microbatch=256"])
        runs[workers] = sft(cfg)
    assert_same_training(runs[1] / "checkpoints" / "step_2", runs[2] / "checkpoints" / "step_2")


def test_a_lost_rank_restarts_an_sft_run_from_its_checkpoint(tmp_path, model_dir, monkeypatch):
    """A rank reported lost at step 2 (after the step-1 checkpoint) tears the group down; a fresh
    one resumes from step_1 and the run ends as an uninterrupted one (float64)."""
    def cfg(name, *more):
        return load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={tmp_path / name}", *SFT, "sft.total_steps=3",
                                               "trainer.num_workers=2", "train.max_tokens_per_microbatch=256", "train.save_every=1",
                                               *more])

    straight = sft(cfg("straight"))
    update, lost = WorkerGroup.update, []

    def flaky(self, batch, tracer=None, step=1):
        if step == 2 and not lost:
            lost.append(step)
            raise WorkerLost(ActorRecord("rank 1", "packrl-rank1", "aa" * 16, "bb" * 28, "127.0.0.1", 1), "update", "process_died", "")
        return update(self, batch, step=step)

    monkeypatch.setattr(WorkerGroup, "update", flaky)
    restarted = sft(cfg("restarted", "trainer.max_restarts=1"))
    (line,) = [json.loads(x) for x in (restarted / "restarts.jsonl").read_text().splitlines()]
    assert line["resumed_step"] == 1 and "after step 1" in (restarted / "resumed.txt").read_text()
    lines = [json.loads(x) for x in (restarted / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[-1]["train/restarts"] == 1.0
    assert_same_training(straight / "checkpoints" / "step_3", restarted / "checkpoints" / "step_3")
