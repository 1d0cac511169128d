"""train.resume at its edges: nothing to resume, a corrupt newest checkpoint, a wrong path, a new
learning rate, a checkpoint past the end, and the data changing underneath."""

from __future__ import annotations

import json
import logging

import pytest

from tests.diagnostics.tiny_run import tiny_run

COMMON = ["train.save_every=1", "reward.name=test_letter_e"]


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def tok(smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    return smollm_tokenizer


def test_auto_without_a_checkpoint_starts_over_and_says_so(tmp_path, tok, caplog):
    run_dir, _ = tiny_run(tmp_path, tok, ["train.total_steps=2", "train.save_every=0", "reward.name=test_letter_e"])
    for path in (run_dir / "checkpoints").iterdir():  # as if killed before the first checkpoint
        import shutil

        shutil.rmtree(path)
    with caplog.at_level(logging.WARNING):
        tiny_run(tmp_path, tok, ["train.total_steps=2", "train.resume=auto", "reward.name=test_letter_e"])
    assert "no complete checkpoint" in caplog.text and "starting at step 1" in caplog.text
    assert _steps(run_dir) == [1, 2], "metrics.jsonl holds each step once"


def test_auto_falls_back_to_an_older_checkpoint_when_the_newest_is_corrupt(tmp_path, tok, caplog):
    run_dir, _ = tiny_run(tmp_path, tok, ["train.total_steps=3", *COMMON])
    (run_dir / "checkpoints" / "step_3" / "optimizer.pt").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING):
        tiny_run(tmp_path, tok, ["train.total_steps=4", "train.resume=auto", *COMMON])
    assert "optimizer.pt cannot be read" in caplog.text and "trying the next older checkpoint" in caplog.text
    assert "after step 2" in (run_dir / "resumed.txt").read_text()
    assert _steps(run_dir) == [1, 2, 3, 4]


def test_an_unreadable_checkpoint_named_explicitly_is_an_error_naming_the_file(tmp_path, tok):
    run_dir, _ = tiny_run(tmp_path, tok, ["train.total_steps=1", *COMMON])
    step = run_dir / "checkpoints" / "step_1"
    (step / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"the weights in .*step_1 cannot be read"):
        tiny_run(tmp_path, tok, ["train.total_steps=2", f"train.resume={step}", *COMMON])
    (step / "trainer_state.json").write_text("{")
    with pytest.raises(ValueError, match=r"trainer_state.json cannot be read"):
        tiny_run(tmp_path, tok, ["train.total_steps=2", f"train.resume={step}", *COMMON])


def test_a_wrong_resume_path_fails_before_anything_is_written(tmp_path, tok):
    with pytest.raises(ValueError, match=r"train.resume=.*does not exist"):
        tiny_run(tmp_path / "run", tok, ["train.total_steps=1", f"train.resume={tmp_path / 'nope'}"])
    assert not (tmp_path / "run").exists()


def test_a_new_learning_rate_applies_after_resume(tmp_path, tok, caplog):
    run_dir, _ = tiny_run(tmp_path, tok, ["train.total_steps=1", *COMMON])
    with caplog.at_level(logging.WARNING):
        tiny_run(tmp_path, tok, ["train.total_steps=2", "train.resume=auto", "train.lr=5e-4", *COMMON])
    assert "train.lr=0.0005 differs from the checkpoint's 0.001" in caplog.text
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["actor/lr"] for line in lines] == [pytest.approx(1e-3), pytest.approx(5e-4)]


def test_a_checkpoint_at_the_last_step_warns_that_nothing_is_left(tmp_path, tok, caplog):
    tiny_run(tmp_path, tok, ["train.total_steps=2", *COMMON])
    with caplog.at_level(logging.WARNING):
        tiny_run(tmp_path, tok, ["train.total_steps=2", "train.resume=auto", *COMMON])
    assert "nothing to train; raise train.total_steps" in caplog.text


def test_resuming_on_other_data_of_the_same_size_is_refused(tmp_path, tok):
    tiny_run(tmp_path, tok, ["train.total_steps=1", *COMMON])
    with pytest.raises(ValueError, match="differ from the checkpoint's"):
        tiny_run(tmp_path, tok, ["train.total_steps=2", "train.resume=auto", "data.arithmetic.digits=2", *COMMON])


def test_an_existing_run_dir_points_at_resume(tmp_path, tok):
    tiny_run(tmp_path, tok, ["train.total_steps=1", *COMMON])
    with pytest.raises(ValueError, match="already holds a run .*set train.resume=auto to continue it"):
        tiny_run(tmp_path, tok, ["train.total_steps=1", *COMMON])
