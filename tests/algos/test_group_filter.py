"""GFPO (algorithm.filters.gfpo): the kept responses by each metric, advantages over the kept set
only (GRPO written by hand on it), the filtered ones out of the loss but counted and dumped, and
the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from packrl.algos.group_filter import GfpoOptions, kept_indices
from packrl.config import ConfigError, load_config
from packrl.config.schema import AlgorithmConfig
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch


def _scored(lengths: list[int], rewards: list[float], group_size: int) -> ScoredBatch:
    num = len(lengths) // group_size
    prompts = PromptBatch(tuple((1, 2) for _ in range(num)), ("1",) * num, ("t",) * num, tuple(range(num)), (False,) * num)
    r = torch.tensor(rewards)
    return ScoredBatch(RolloutBatch(prompts, group_size, tuple(Response((3,) * n, "eos") for n in lengths)), r, r)


def test_the_kept_responses_by_each_metric():
    scored = _scored([30, 10, 20, 10, 5, 50, 40, 60], [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.5], 4)
    assert kept_indices(scored, GfpoOptions(keep=2, metric="shortest")) == [1, 3, 4, 6]  # ties: the earlier response
    # reward / tokens: group 0: 1/30, 0, 1/20, 1/10 -> 3 then 2; group 1: 0, 1/50, 1/40, 0.5/60 -> 6 then 5
    assert kept_indices(scored, GfpoOptions(keep=2, metric="reward_per_token")) == [2, 3, 5, 6]
    assert kept_indices(scored, GfpoOptions()) == list(range(8))


def test_reward_per_token_does_not_prefer_long_responses_under_negative_rewards():
    # reward / tokens would rank the 200-token response first (-0.001 > -0.01); (reward - min) / tokens: 0, 0, 0.004, 0.0033
    scored = _scored([20, 200, 50, 60], [-0.2, -0.2, 0.0, 0.0], 4)
    assert kept_indices(scored, GfpoOptions(keep=3, metric="reward_per_token")) == [0, 2, 3]
    ties = _scored([30, 10, 20, 40], [0.5, 0.5, 0.5, 0.5], 4)  # equal rewards: the shortest
    assert kept_indices(ties, GfpoOptions(keep=2, metric="reward_per_token")) == [1, 2]


def test_advantages_are_computed_over_the_kept_set_and_the_rest_leave_the_loss():
    scored = _scored([30, 10, 20, 12], [1.0, 0.0, 1.0, 1.0], 4)
    cfg = AlgorithmConfig(adv_estimator="grpo", filters={"gfpo": {"keep": 3, "metric": "shortest"}})
    batch, metrics = build_train_batch(scored, None, None, cfg)
    kept = [0.0, 1.0, 1.0]  # responses 1, 2, 3 (10, 20, 12 tokens): GRPO over them alone
    mean, std = sum(kept) / 3, torch.tensor(kept).std().item()
    expected = [0.0] + [(r - mean) / (std + 1e-6) for r in kept]
    assert [float(a[0]) for a in batch.advantages] == pytest.approx(expected)
    assert [bool(m.any()) for m in batch.loss_masks] == [False, True, True, True]
    assert batch.filtered == ("gfpo", None, None, None)
    assert metrics["filter/gfpo/dropped"] == 1
    assert metrics["filter/gfpo/filtered_length_mean"] == 30 and metrics["filter/gfpo/kept_length_mean"] == 14
    off, _ = build_train_batch(scored, None, None, AlgorithmConfig(adv_estimator="grpo"))
    assert off.filtered is None and all(bool(m.all()) for m in off.loss_masks)


def test_filtered_responses_are_dumped(tmp_path, smollm_tokenizer):
    from packrl.diagnostics.rollout_dump import build_rollout_dump

    scored = _scored([6, 2, 4, 3], [1.0, 0.0, 1.0, 1.0], 4)
    batch, _ = build_train_batch(scored, None, None, AlgorithmConfig(filters={"gfpo": {"keep": 2}}))
    build_rollout_dump(True, tmp_path, smollm_tokenizer)(1, batch)
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert [row["filtered"] for row in rows] == ["gfpo", None, "gfpo", None] and len(rows) == 4


def test_the_update_leaves_the_filtered_responses_out_and_reports_them():
    from types import SimpleNamespace

    from packrl.distributed.local import local_group
    from tests.conftest import tiny_llama

    cfg = load_config("demo", ["model.dtype=fp32", "data.batch_size=2", "rollout.n=4", "algorithm.filters.gfpo.keep=2",
                             "algorithm.filters.gfpo.metric=shortest"])
    workers = local_group(cfg, tiny_llama(), SimpleNamespace(eos_token_id=2, pad_token_id=0))
    scored = _scored([6, 2, 4, 3, 5, 5, 2, 7], [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0], 4)
    batch, _ = build_train_batch(scored, None, None, cfg.algorithm)
    assert batch.filtered == ("gfpo", None, "gfpo", None, None, "gfpo", None, "gfpo")
    metrics = workers.update(batch)
    # filtered: 6, 4, 5 and 7 response tokens, each after a 2-token prompt; kept: 2, 3, 5, 2
    assert metrics["seqlen/update_left_out_sequences"] == 4 and metrics["seqlen/update_left_out_tokens"] == 30
    assert metrics["seqlen/pad_fraction"] == 0.0 and metrics["seqlen/microbatch_tokens_max"] <= 4 * 2 + 2 + 3 + 5 + 2


def test_refusals():
    with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo.keep=5: > rollout.n=4"):
        load_config("demo", ["algorithm.filters.gfpo.keep=5"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo.keep=4: has no effect: it keeps all rollout.n=4"):
        load_config("demo", ["algorithm.filters.gfpo.keep=4"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo.keep=1: leaves a group of one, whose advantage under grpo is 0"):
        load_config("demo", ["algorithm.filters.gfpo.keep=1"])
    with pytest.raises(ConfigError, match=r"algorithm.filters.gfpo.keep=None: is required"):
        load_config("demo", ["algorithm.filters.gfpo.metric=reward_per_token"])
    with pytest.raises(ConfigError, match=r"algorithm.group_filter moved: write algorithm.filters.gfpo.keep=K"):
        load_config("demo", ["algorithm.group_filter.keep=2"])
    assert load_config("demo", ["rollout.n=8", "algorithm.filters.gfpo.keep=4"]).algorithm.filters["gfpo"]["keep"] == 4
