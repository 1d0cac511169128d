"""The gsm8k preset on the real SmolLM2-135M (GGUF) and GSM8K files, 2 steps with trainer.num_workers=2."""

from __future__ import annotations

import json
import shutil

import pytest

from packrl.config import load_config
from packrl.trainer.loop import train
from tests.conftest import GGUF, GSM8K_DIR, needs_shared

TRAIN = GSM8K_DIR / "train.jsonl"

pytest.importorskip("ray")


@pytest.mark.slow
@needs_shared(GGUF, TRAIN)
def test_gsm8k_preset_two_steps_on_two_workers(tmp_path):
    # Smaller than the preset's batch and response budget to keep CI short; everything else is the preset's.
    cfg = load_config("gsm8k", [f"data.train_files=[{TRAIN}]", f"model.path={GGUF}", "trainer.num_workers=2",
                                "train.total_steps=2", f"train.out_dir={tmp_path}",
                                "data.batch_size=2", "rollout.n=2", "rollout.max_response_tokens=48"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["seqlen/rank_imbalance"] >= 1.0 and line["response_length/max"] <= 48
        assert all(isinstance(v, (int, float)) for v in line.values())
    assert "data-parallel over 2 FSDP2 ranks (gloo)" in (run_dir / "model.txt").read_text()
    final = run_dir / "checkpoints" / "step_2"  # written by rank 0 in the single-process layout
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json", "config.json"} <= {p.name for p in final.iterdir()}
    shutil.rmtree(final)  # 1.6 GB
