"""The arithmetic_tool preset on the real SmolLM2-135M (GGUF): 2 steps of multi-turn rollouts with
the calculator, end to end (dumps show each turn; metrics count turns and calls)."""

from __future__ import annotations

import json
import shutil

import pytest

from packrl.config import load_config
from packrl.trainer.loop import train
from tests.conftest import GGUF, needs_shared


@pytest.mark.slow
@needs_shared(GGUF)
def test_arithmetic_tool_preset_two_steps(tmp_path):
    # A smaller batch than the preset's to keep CI short; the multi-turn settings are the preset's.
    cfg = load_config("arithmetic_tool", [f"model.path={GGUF}", "train.total_steps=2", f"train.out_dir={tmp_path}",
                                          "data.batch_size=2", "rollout.n=2", "train.save_every=0"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert 1 <= line["num_turns/mean"] <= 3 and line["response_length/max"] <= 256
        assert sum(line[f"multi_turn/ended/{why}"] for why in ("answer", "max_turns", "turn_tokens", "response_tokens",
                                                                 "trajectory_tokens", "context", "abort")) == pytest.approx(1.0)
    rows = [json.loads(line) for line in (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["turns"][0]["role"] == "assistant" and row["turns"][0]["in_loss"] for row in rows)
    assert all(sum(t["tokens"] for t in row["turns"]) == row["response_tokens"] for row in rows)
    assert "rollout.multi_turn.max_turns" in (run_dir / "budgets.txt").read_text()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
