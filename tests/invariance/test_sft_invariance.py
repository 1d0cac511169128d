"""Supervised fine-tuning is exact under micro-batching: `packrl sft` on a tiny random Llama in
float64 trains the same weights and AdamW moments whether a step's traces share one micro-batch or
take one each, and its loss is the mean negative log-likelihood of the assistant's tokens computed
by hand with transformers' own forward. The 2-rank arm is tests/distributed/test_sft_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch

from packrl.config import load_config
from packrl.trainer.sft import sft, sft_traces, trace_sampler
from tests.diagnostics.tiny_run import tiny_policy
from tests.same_training import assert_same_training

SFT = ["model.dtype=fp64", "sft.train_files=[task:tool_traces]", "sft.num_rows=6", "sft.batch_size=4", "sft.total_steps=2",
       "sft.lr=1e-4", "train.loggers=[]", "data.val_files=[]", "data.max_prompt_tokens=160", "rollout.max_response_tokens=96"]
"""A 2-step run of 4 traces a step over 6 traces (the second step spans two epochs)."""


def _run(out, model_dir, *more):
    return sft(load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={out}", *SFT, *more]))


def test_sft_is_the_same_for_any_microbatch_split(tmp_path, model_dir):
    whole = _run(tmp_path / "whole", model_dir, "train.max_tokens_per_microbatch=4096")
    split = _run(tmp_path / "split", model_dir, "train.max_tokens_per_microbatch=256")
    lines = {name: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for name, run in
             (("whole", whole), ("split", split))}
    assert [line["seqlen/num_microbatches"] for line in lines["whole"]] == [1.0, 1.0]
    assert all(line["seqlen/num_microbatches"] == 4.0 for line in lines["split"])  # one trace each
    for a, b in zip(lines["whole"], lines["split"]):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-10)
    assert_same_training(whole / "checkpoints" / "step_2", split / "checkpoints" / "step_2")


def test_sft_loss_is_the_mean_nll_of_the_assistant_tokens(tmp_path, model_dir, smollm_tokenizer):
    # the RL sampling temperature does not reach the supervised loss: the model's own likelihood, at temperature 1
    run = _run(tmp_path / "run", model_dir, "train.max_tokens_per_microbatch=256", "sft.total_steps=1", "rollout.temperature=0.7")
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    cfg = load_config("arithmetic_tool", [f"model.path={model_dir}", *SFT])
    traces = sft_traces(cfg, smollm_tokenizer)
    model = tiny_policy(smollm_tokenizer).double().eval()
    nll, count = 0.0, 0
    for i in trace_sampler(traces, 4, cfg.train.seed).next_indices():  # step 1's traces
        ids = torch.tensor([*traces.prompt_ids[i], *traces.response_ids[i]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), -1).gather(1, ids[1:, None])[:, 0]
        mask = torch.tensor([False] * (len(traces.prompt_ids[i]) - 1) + list(traces.response_masks[i]))
        nll -= float(logp[mask].sum())
        count += int(mask.sum())
    assert first["sft/num_loss_tokens"] == count
    assert "generation" not in (run / "model.txt").read_text()  # nothing is generated: no engine phrase
    assert first["sft/loss"] == pytest.approx(nll / count, rel=1e-9)
