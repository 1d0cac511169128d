"""Hybrid models generate: one GRPO step of the demo preset (``rollout.n=2``, several generation
rounds) for each hybrid family the installed transformers builds, saved as a model folder with
SmolLM2's tokenizer, and the engine's log-probs equal the trainer's as for a Llama control.

The HF engine prefills each group's prompt once and copies it to the group's rows, and rows that
finish leave the batch between rounds: both select cache rows, which for conv, SSM and
linear-attention layers means their states, not keys and values. A state copied to the wrong row
or left behind moves the next token's log-prob by whole nats; a cache re-prefilled on top of its
own states (Mamba's, which cannot say how many positions it holds) by 0.04 nats. The trainer
scores each sequence alone (these models train one sequence per micro-batch), so the mismatch
metric (verl's, in probability) compares generation against an independent computation. These
random models are near uniform over SmolLM2's 49,152 tokens (p about 2e-5), where a log-prob
error of e nats moves a probability by about 2e-5 e: float32 rounding (1e-6 nats; 2e-11 to
1.4e-10 measured, the Llama control 4.5e-11) stays far below the limit of 2e-9 (1e-4 nats), and
the faults above (8e-7 and more) far above it. `tests/rollout/test_hybrid_engine.py` checks the
engine's log-probs themselves, in nats."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from packrl.config import load_config
from packrl.trainer.loop import train
from tests.builders import HYBRIDS, hybrid_config
from tests.conftest import SMOLLM_DIR

# max |p_train - p_rollout| over generated tokens: 1e-4 nats at these near-uniform probabilities (see the module docstring)
MISMATCH_LIMIT = 2e-9


def _save(family: str, path, tokenizer) -> None:
    """A tiny random model of ``family`` with SmolLM2's vocabulary, saved with SmolLM2's tokenizer files."""
    config = hybrid_config(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM_DIR / file, path / file)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", *sorted(HYBRIDS)])
def test_one_grpo_step_generates_and_matches_the_trainer(family, tmp_path, smollm_tokenizer):
    _save(family, tmp_path / "model", smollm_tokenizer)
    cfg = load_config("demo", [
        f"model.path={tmp_path / 'model'}", "model.dtype=fp32", f"train.out_dir={tmp_path / 'run'}", "train.total_steps=1",
        "data.batch_size=2", "rollout.n=2", "rollout.max_response_tokens=40", "rollout.return_logprobs=true",
        "data.val_files=[]", "train.loggers=[]",
    ])
    run_dir = train(cfg)
    line = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["response_length/max"] > 16, "a response must outlive the first generation round"
    assert line["training/rollout_probs_diff_max"] <= MISMATCH_LIMIT, line["training/rollout_probs_diff_max"]
    summary = (run_dir / "model.txt").read_text()
    assert "compute dtype fp32 (model.dtype=fp32: as set)" in summary
    if family == "llama":
        assert "packing: on" in summary and "generation: engine-made KV cache" in summary
    elif family == "mamba":  # its cache holds only SSM states: one generate call per batch, said in model.txt
        assert "packing: off" in summary and "generation: one generate call per batch" in summary
    else:
        assert "packing: off" in summary and "generation: engine-made KV cache" in summary
