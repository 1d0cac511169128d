"""`packrl sft char_count` on the real SmolLM2-135M (GGUF): verbose task:char_count traces train
and the run writes a checkpoint that loads as a model directory."""

from __future__ import annotations

import json

import pytest

from packrl.cli.main import main
from tests.conftest import GGUF, needs_shared


@pytest.mark.slow
@needs_shared(GGUF)
def test_sft_char_count_writes_a_checkpoint(tmp_path, smollm_tokenizer):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "sft"
    assert main(["sft", "char_count", f"model.path={GGUF}", "sft.num_rows=8", "sft.batch_size=2", "sft.total_steps=2",
                 "data.char_count.max_letters=8", "model.dtype=fp32", f"train.out_dir={run}"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["sft/loss"] > 0 and 0 < line["sft/num_loss_tokens"] < line["sft/num_tokens"] for line in lines)
    assert "8 kept" in (run / "sft_accounting.txt").read_text()
    accounting = json.loads((run / "data_accounting.json").read_text())["sft"]
    assert {row["source"] for row in accounting["rows"]} == {"task:char_count_traces"}
    checkpoint = run / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # what model.path of the RL run loads
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == len(smollm_tokenizer)
