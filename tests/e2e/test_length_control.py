"""Length control on the real SmolLM2-135M (GGUF): a char_count run with thinking budgets forces the
end of thinking where it runs out (the forced tokens dumped, counted and out of the loss, the answer
within its budget), and a run with a length objective, GFPO and prompts that ask for a length
reports every length metric."""

from __future__ import annotations

import json

import pytest

from packrl.cli.main import main
from tests.conftest import GGUF, needs_shared

TINY = ["data.batch_size=2", "rollout.n=2", "model.dtype=fp32", "train.total_steps=1", "data.val_files=[]", "train.loggers=[]",
        "train.max_tokens_per_microbatch=2048", "train.max_tokens_per_logprob_microbatch=2048", "rollout.max_response_tokens=64"]


@pytest.mark.slow
@needs_shared(GGUF)
def test_thinking_budgets_force_the_end_of_thinking_on_the_135m_model(tmp_path):
    run = tmp_path / "think"
    assert main(["train", "char_count", f"model.path={GGUF}", *TINY, f"train.out_dir={run}", "rollout.think_budget_tokens=16",
                 "rollout.answer_budget_tokens=24", "rollout.end_of_thinking=</think>"]) == 0
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    rows = [json.loads(r) for r in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    forced = [r for r in rows if "forced" in r]
    assert forced, "the base model never writes </think>: its thinking runs out and the end is forced"
    assert line["seqlen/forced_tokens"] == sum(r["forced_tokens"] for r in forced)
    for r in forced:
        assert r["forced"]["forced"] == "</think>" and r["response_tokens"] <= 16 + r["forced_tokens"] + 24


@pytest.mark.slow
@needs_shared(GGUF)
def test_length_objectives_gfpo_and_targets_report_their_metrics(tmp_path):
    run = tmp_path / "length"
    assert main(["train", "char_count", f"model.path={GGUF}", *TINY, f"train.out_dir={run}", "rollout.n=4",
                 "reward.shaping.shortest_correct.beta=0.01", "algorithm.filters.gfpo.keep=2",
                 "data.length_target.min_tokens=16", "data.length_target.max_tokens=48"]) == 0
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["filter/gfpo/dropped"] == 4
    assert "length/target_error/mean" in line and "reward/shortest_correct/mean" in line
    assert "length/all_cut_or_wrong" in line and "length/score_per_1k_tokens" in line
    rows = [json.loads(r) for r in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert sum(r["filtered"] == "gfpo" for r in rows) == 4 and all(16 <= r["length_target"] <= 48 for r in rows)
