"""``trainer.rollout_mode=separate_async``: a rollout worker on its own Ray process generates the next
batch while the trainer updates; every trained token is at least one update old, budgets and the
ledger hold, and a run checkpointed and resumed trains what the straight run trains."""

from __future__ import annotations

import json

import pytest

from packrl.config import load_config
from packrl.trainer.loop import train
from tests.builders import metric_lines
from tests.diagnostics.tiny_run import BASE

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray and worker processes

SEPARATE = ["trainer.rollout_mode=separate_async", "trainer.num_rollout_workers=1", "rollout.over_provision=1",
            "rollout.partial_chunk_tokens=4", "reward.name=test_letter_e", "train.dump_rollouts=true", "train.lr=1e-2"]


def _run(out_dir, model_dir, *overrides):
    cfg = load_config("demo", [f"train.out_dir={out_dir}", *BASE, f"model.path={model_dir}", *SEPARATE, *overrides])
    return train(cfg)


def _prompts(run_dir, step):
    return [(r["row"], r["response"]) for r in map(json.loads, (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines())]


def test_the_next_batch_is_generated_while_the_trainer_updates_and_resume_is_exact(tmp_path, model_dir):
    straight = _run(tmp_path / "a", model_dir, "train.total_steps=4")
    lines = metric_lines(straight)
    assert [line["async/ledger_trained"] for line in lines] == [2.0, 4.0, 6.0, 8.0]
    assert lines[0]["async/staleness_token_max"] == 0  # step 1: nothing prefetched yet
    for line in lines[1:]:  # every later batch was generated during the previous update
        assert line["async/staleness_token_mean"] >= 1 and line["async/staleness_token_max"] <= 2
        assert line["timing_s/weight_sync"] > 0 and line["async/rollout_busy_s"] > 0
    rows = [json.loads(r) for step in range(1, 5) for r in (straight / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    assert all(r["response_tokens"] <= 12 for r in rows)
    assert len({r["row"] for r in rows}) == len(rows) // 3  # 3 responses per group, each row trained once
    _run(tmp_path / "b", model_dir, "train.total_steps=2", "train.save_every=2")
    resumed = _run(tmp_path / "b", model_dir, "train.total_steps=4", "train.save_every=2", "train.resume=auto")
    again = metric_lines(resumed)
    for step in (3, 4):
        assert _prompts(resumed, step) == _prompts(straight, step)
        for key in ("async/ledger_trained", "async/carried_tokens", "async/staleness_token_mean", "async/generated_tokens",
                    "actor/pg_loss"):
            assert again[step - 1][key] == pytest.approx(lines[step - 1][key], abs=1e-6), (step, key)


def test_two_trainer_ranks_push_their_gathered_weights_to_the_rollout_worker(tmp_path, model_dir):
    """FSDP2 over 2 ranks: the weights the rollout worker loads are gathered by every rank (a
    collective) and sent by the writer; the batches stay one update behind."""
    lines = metric_lines(_run(tmp_path / "c", model_dir, "train.total_steps=3", "trainer.num_workers=2"))
    assert [line["async/ledger_trained"] for line in lines] == [2.0, 4.0, 6.0]
    assert all(line["async/staleness_token_mean"] >= 1 and line["timing_s/weight_sync"] > 0 for line in lines[1:])
    assert all(line["actor/grad_norm"] > 0 for line in lines)


def test_the_carried_metrics_of_a_step_are_the_pool_and_ledger_its_checkpoint_holds(tmp_path, model_dir):
    """Each step's async/carried_groups and async/ledger_* equal its checkpoint's pool and ledger
    (after the top-up for the next step: batch + over-provision = 3 groups), and its
    async/carried_tokens plus what the prefetch then generated (the checkpoint's pending counts)
    are the tokens the checkpoint's pool holds."""
    run_dir = _run(tmp_path / "d", model_dir, "train.total_steps=2", "train.save_every=1")
    for step, line in enumerate(metric_lines(run_dir), start=1):
        state = json.loads((run_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())["rollout"]
        tokens = sum(len(ids) for g in state["pool"] for m in g["members"] for ids, _, _ in m["segments"])
        ledger = {kind: 0.0 for kind in ("queued", "in_flight", "trained", "dropped")}
        for entry in state["ledger"]["states"]:
            ledger[entry.split("@", 1)[0]] += 1
        assert line["async/carried_groups"] == len(state["pool"]) == 3, step
        assert {k: line[f"async/ledger_{k}"] for k in ledger} == ledger, step
        assert line["async/carried_tokens"] + state["pending"]["generated_tokens"] == tokens, step
