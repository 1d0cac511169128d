"""train.resume: 2 steps, stop, resume for 2 more == 4 steps straight (prompts and losses)."""

from __future__ import annotations

import json

import pytest

import tests.e2e.test_train_tiny  # noqa: F401  (registers the dense reward test_letter_e)
from packrl.trainer.checkpoint import find_resume_checkpoint
from tests.diagnostics.tiny_run import tiny_run


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _prompts(run_dir, step):
    return [json.loads(line)["prompt"] for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_resume_after_two_steps_matches_four_straight(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    tok.padding_side = "left"
    # A dense reward and a mini-batch per prompt, so parameters and optimizer state move every step.
    common = ["train.dump_rollouts=true", "train.save_every=2", "reward.name=test_letter_e", "train.mini_batch_size=1",
              "train.lr=1e-2"]
    straight, _ = tiny_run(tmp_path / "a", tok, ["train.total_steps=4", *common])
    tiny_run(tmp_path / "b", tok, ["train.total_steps=2", *common])
    (tmp_path / "b" / "checkpoints" / ".tmp-step_3").mkdir()  # an interrupted write is never chosen
    assert find_resume_checkpoint(tmp_path / "b", "auto").name == "step_2"
    resumed, _ = tiny_run(tmp_path / "b", tok, ["train.total_steps=4", "train.resume=auto", *common])
    a, b = _lines(straight), _lines(resumed)
    assert [line["step"] for line in b] == [1, 2, 3, 4]
    assert any(line["actor/grad_norm"] > 0 for line in a), "the run must actually train"
    for step in (3, 4):
        assert _prompts(resumed, step) == _prompts(straight, step)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ValueError, match="train.resume=.*is not a complete checkpoint"):
        find_resume_checkpoint(tmp_path, str(tmp_path / "step_3"))
    assert find_resume_checkpoint(tmp_path, "auto") is None and find_resume_checkpoint(tmp_path, None) is None
