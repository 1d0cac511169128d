"""train.resume: 2 steps, SIGKILL, resume for 2 more == 4 steps straight (prompts and losses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packrl.worker.checkpoint import STATE_FILE, find_resume_checkpoint
from tests.builders import metric_lines
from tests.diagnostics.tiny_run import tiny_run

ROOT = Path(__file__).resolve().parents[2]
# A dense reward and a mini-batch per prompt, so parameters and optimizer state move every step.
COMMON = ["train.dump_rollouts=true", "train.save_every=2", "reward.name=test_letter_e", "train.mini_batch_size=1",
          "train.lr=1e-2"]


def _prompts(run_dir, step):
    return [json.loads(line)["prompt"] for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


ASYNC = ["trainer.rollout_mode=colocate_async", "rollout.over_provision=2"]


def _train_until_killed(run_dir: Path, checkpoint: Path, common: list[str]) -> None:
    """Train the tiny run in a subprocess and SIGKILL it once ``checkpoint`` is complete."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.diagnostics.tiny_run", str(run_dir), "1000", *common], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (checkpoint / STATE_FILE).is_file():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"no {checkpoint} after 240 s"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow  # a training run in a subprocess, killed, then resumed
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_resume_after_sigkill_matches_four_straight(tmp_path, smollm_tokenizer, mode):
    """``colocate_async``: the checkpoint carries partial groups, and the resumed run trains the
    same prompts in the same groups (and the same ledger) as the straight one."""
    tok = smollm_tokenizer
    tok.padding_side = "left"
    common = COMMON + (ASYNC if mode == "colocate_async" else [])
    straight, _ = tiny_run(tmp_path / "a", tok, ["train.total_steps=4", *common])
    step_2 = tmp_path / "b" / "checkpoints" / "step_2"
    _train_until_killed(tmp_path / "b", step_2, common)  # killed somewhere after the step-2 checkpoint
    assert json.loads((step_2 / STATE_FILE).read_text())["skips"] == {"skipped_steps": 0, "consecutive_skips": 0}
    (tmp_path / "b" / "checkpoints" / ".tmp-step_99").mkdir()  # an interrupted write is never chosen
    assert find_resume_checkpoint(tmp_path / "b", "auto").name != ".tmp-step_99"
    resumed, _ = tiny_run(tmp_path / "b", tok, ["train.total_steps=4", f"train.resume={step_2}", *common])
    a, b = metric_lines(straight), metric_lines(resumed)
    if mode == "colocate_async":
        assert json.loads((step_2 / STATE_FILE).read_text())["rollout"]["pool"], "the cut must carry groups"
        assert a[1]["async/carried_groups"] > 0 and any(line["async/partial_ratio"] > 0 for line in a)
        for key in ("async/ledger_trained", "async/ledger_in_flight", "async/carried_tokens", "async/staleness_token_mean"):
            assert [line[key] for line in b] == [line[key] for line in a], key
    assert [line["step"] for line in b] == [1, 2, 3, 4]
    assert any(line["actor/grad_norm"] > 0 for line in a), "the run must actually train"
    for step in (1, 2, 3, 4):
        assert _prompts(resumed, step) == _prompts(straight, step)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ValueError, match="train.resume=.*is not a complete checkpoint"):
        find_resume_checkpoint(tmp_path, str(tmp_path / "step_3"))
    assert find_resume_checkpoint(tmp_path, "auto") is None and find_resume_checkpoint(tmp_path, None) is None
