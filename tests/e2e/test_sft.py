"""`packrl sft` on the real SmolLM2-135M (GGUF): calculator traces lower the loss, and the
checkpoint starts an RL run of the arithmetic_tool preset as its model.path."""

from __future__ import annotations

import json

import pytest

from packrl.cli.main import main
from tests.conftest import GGUF, needs_shared


@pytest.mark.slow
@needs_shared(GGUF)
def test_sft_then_rl_from_its_checkpoint(tmp_path):
    traces = tmp_path / "traces.jsonl"
    assert main(["data", "tool-traces", "arithmetic_tool", "sft.num_rows=12", "--out", str(traces)]) == 0
    run = tmp_path / "sft"
    assert main(["sft", "arithmetic_tool", f"model.path={GGUF}", f"sft.train_files=[{traces}]", "sft.total_steps=3",
                 "sft.batch_size=4", "sft.lr=1e-4", "model.dtype=fp32", f"train.out_dir={run}"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[-1]["sft/loss"] < lines[0]["sft/loss"]
    assert all(0 < line["sft/num_loss_tokens"] < line["sft/num_tokens"] for line in lines)  # prompts and tool answers out of the loss
    assert "12 kept" in (run / "sft_accounting.txt").read_text()
    assert "generation" not in (run / "model.txt").read_text()  # nothing is generated: no engine phrase
    rl = tmp_path / "rl"
    assert main(["train", "arithmetic_tool", f"model.path={run / 'checkpoints' / 'step_3'}", "train.total_steps=1",
                 "data.batch_size=2", "rollout.n=2", "model.dtype=fp32", f"train.out_dir={rl}"]) == 0
    assert json.loads((rl / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
