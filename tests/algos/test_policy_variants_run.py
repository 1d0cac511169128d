"""The policy-loss family wired through a whole run: the engine returns its log-probs for rollout
correction, the old-log-prob pass's entropy reaches the entropy filter, and Clip-Cov / KL-Cov make
their choice in the worker group before the update (tiny random model, SmolLM2's tokenizer)."""

from __future__ import annotations

import json

import pytest

from tests.diagnostics.tiny_run import tiny_run


@pytest.mark.parametrize("loss", ["kl_cov", "gspo"])
def test_a_run_with_every_filter_logs_their_metrics(tmp_path, smollm_tokenizer, loss):
    smollm_tokenizer.padding_side = "left"
    run_dir, _ = tiny_run(tmp_path / "run", smollm_tokenizer, [
        "train.total_steps=2", "reward.name=test_letter_e", f"algorithm.policy_loss={loss}",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=geometric",
        "algorithm.rollout_correction.rollout_rs_threshold=1.5", "algorithm.filters.entropy.quantile=0.5",
    ])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["seqlen/masked_sequences/entropy"] == 3.0  # ceil(0.5 x 6) of the 6 responses kept
        assert line["rollout_corr/rollout_is_mean"] > 0 and line["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert "training/rollout_probs_diff_mean" in line  # the engine returned its log-probs
        if loss == "kl_cov":
            assert line["actor/cov_selected_fraction"] > 0
        else:
            assert 0 < line["actor/gspo_seq_ratio_mean"] < 2
