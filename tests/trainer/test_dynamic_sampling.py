"""Dynamic sampling (algorithm.filters.dynamic_sampling, a sampling filter): zero-variance groups dropped, the batch refilled
from further rounds of the run's sampler, the round cap, the counts, the config checks, resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from packrl.algos.dynamic_sampling import groups_with_variance
from packrl.config import config_problems
from packrl.config.load import check_config
from packrl.config.plan import BatchPlan
from packrl.config.schema import (
    AlgorithmConfig,
    DataConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    TrainerConfig,
)
from packrl.data import DatasetPrompt, Example, PromptDataset, PromptSampler
from packrl.reward import REWARDS, register_reward
from packrl.rollout.engine import SamplingParams
from packrl.seqlen.prompt_policy import PromptAccounting, RowOutcome
from packrl.trainer.stages import sampling_stage
from packrl.trainer.stages.base import StageContext
from packrl.trainer.stages.rounds import fit_to_ranks
from packrl.types import Response, RolloutBatch

if "test_scripted_value" not in REWARDS:

    @register_reward("test_scripted_value")
    def _scripted_value(response_text: str, ground_truth: str, *, data_source: str, cfg) -> float:
        """The response's text is its score (`_Tok` decodes a response to its one token id)."""
        return float(response_text)


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(seq[0]) for seq in ids]


class _Workers:
    """Generation by script: response j of the prompt in data row r is the one token ``script(r, j)``."""

    def __init__(self, cfg: RunConfig, script):
        self.plan, self.tokenizer, self.script, self.rows = BatchPlan.from_config(cfg), _Tok(), script, []

    def generate(self, prompts, sampling):
        self.rows.append(prompts.rows)
        responses = tuple(Response((self.script(r, j),), "eos") for r in prompts.rows for j in range(sampling.n))
        return RolloutBatch(prompts, sampling.n, responses)


def _varied(rows):
    """A script: the rows in ``rows`` score 0, 1, 0, ... across their group; every other row scores 1 throughout."""
    return lambda row, j: j % 2 if row in rows else 1


def _cfg(*, enable=True, batch_size=4, n=2, max_rounds=10, mini=None, workers=1, metric="score", buffer=0) -> RunConfig:
    return RunConfig(
        data=DataConfig(batch_size=batch_size, shuffle=False), rollout=RolloutConfig(n=n),
        reward=RewardConfig(name="test_scripted_value", shaping={"overlong": {"buffer_tokens": buffer}} if buffer else {}),
        train=TrainConfig(mini_batch_size=mini),
        algorithm=AlgorithmConfig(filters={"dynamic_sampling": {"max_num_gen_batches": max_rounds, "metric": metric}} if enable else {}),
        trainer=TrainerConfig(num_workers=workers),
    )


def _sampler(cfg: RunConfig, num_prompts: int = 24) -> PromptSampler:
    prompts = [DatasetPrompt(Example([{"role": "user", "content": str(i)}], str(i), "s", row=i), (i,), False)
               for i in range(num_prompts)]
    dataset = PromptDataset(prompts, PromptAccounting(tuple(RowOutcome(i, "kept") for i in range(num_prompts))))
    return PromptSampler(dataset, cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=0)


def _step(cfg: RunConfig, script, sampler: PromptSampler | None = None):
    sampler = sampler or _sampler(cfg)
    workers = _Workers(cfg, script)
    timing: dict[str, float] = {}
    rollout, scored, metrics = sampling_stage(StageContext(cfg, sampler, workers, Path(".")))(SamplingParams(n=cfg.rollout.n), timing, [])
    return rollout, scored, metrics, workers, timing


@pytest.mark.parametrize(("values", "group_size", "expected"), [
    ([1, 1, 0, 1, 1, 0, 0, 0], 2, [1, 2]),
    ([1, 1, 1], 3, []),
    ([0.1, 0.1 + 1e-7, 0.2, 0.2], 2, [0]),
])
def test_groups_with_variance_table(values, group_size, expected):
    assert groups_with_variance(torch.tensor(values), group_size) == expected


@pytest.mark.parametrize(("prompts", "mini", "group_size", "ranks", "expected"), [
    (5, 2, 4, 8, 4), (5, 2, 8, 8, 5), (4, 2, 1, 8, 4), (1, 2, 2, 4, 0), (3, 4, 2, 1, 3),
])
def test_fit_to_ranks_table(prompts, mini, group_size, ranks, expected):
    assert fit_to_ranks(prompts, mini, group_size, ranks) == expected


def test_zero_variance_groups_are_refilled_to_a_full_batch_over_rounds():
    cfg = _cfg()
    rollout, scored, metrics, workers, timing = _step(cfg, _varied({0, 3, 6, 9}))
    assert workers.rows == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]  # three rounds, each data.batch_size prompts
    assert rollout.prompts.rows == (0, 3, 6, 9) and scored.rollout is rollout and len(rollout) == 8
    assert scored.scores.tolist() == [0.0, 1.0] * 4 == [float(r.response_ids[0]) for r in rollout.responses]
    assert groups_with_variance(scored.scores, 2) == [0, 1, 2, 3]  # only groups with variance are left
    assert metrics == {
        "train/num_gen_batches": 3.0, "train/num_gen_prompts": 12.0, "train/num_kept_prompts": 4.0,
        "train/num_dropped_prompts/dynamic_sampling": 8.0, "train/num_dropped_prompts/surplus": 0.0,
        "train/num_dropped_prompts/too_few_for_ranks": 0.0, "train/update_batch_prompts": 4.0,
        "train/gen_score/mean": pytest.approx(20 / 24),
    }
    assert timing.keys() == {"gen", "reward"}


def test_groups_kept_beyond_the_batch_are_dropped_and_counted():
    cfg = _cfg()
    rollout, _, metrics, workers, _ = _step(cfg, _varied({0, 1, 2, 4, 5}))
    assert len(workers.rows) == 2 and rollout.prompts.rows == (0, 1, 2, 4)
    assert metrics["train/num_kept_prompts"] == 5 and metrics["train/num_dropped_prompts/surplus"] == 1
    assert metrics["train/update_batch_prompts"] == 4 == cfg.data.batch_size


def test_the_round_cap_stops_there_and_trains_what_was_kept(caplog):
    cfg = _cfg(max_rounds=2)
    with caplog.at_level(logging.WARNING, logger="packrl.trainer.stages.rounds"):
        rollout, _, metrics, workers, _ = _step(cfg, _varied({1, 6, 9}))
    assert len(workers.rows) == 2 and rollout.prompts.rows == (1, 6)
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/update_batch_prompts"] == 2
    assert metrics["train/num_dropped_prompts/dynamic_sampling"] == 6
    assert "2 of data.batch_size=4 prompt groups kept after 2 rounds" in caplog.text
    with pytest.raises(RuntimeError, match=r"no prompt group to train after 2 rounds .*the filters dropped all 8 prompt "
                                           r"groups \(\{'dynamic_sampling': 8\}"):
        _step(cfg, _varied(set()))


def test_a_last_mini_batch_too_small_for_the_ranks_is_left_out():
    cfg = _cfg(mini=2, workers=4, max_rounds=1)  # a mini-batch of one prompt would be 2 sequences for 4 ranks
    rollout, _, metrics, _, _ = _step(cfg, _varied({0, 1, 2}))
    assert rollout.prompts.rows == (0, 1) and metrics["train/num_dropped_prompts/too_few_for_ranks"] == 1
    with pytest.raises(RuntimeError, match="fewer sequences than the 4 data-parallel ranks"):
        _step(cfg, _varied({3}))


def test_the_reward_metric_sees_the_shaping():
    # responses of different lengths under an overlong penalty: equal scores, different rewards
    cfg = _cfg(metric="reward", max_rounds=1, buffer=400)
    sampler, workers = _sampler(cfg), _Workers(cfg, lambda row, j: 1)
    long = Response((1,) * 500, "eos")
    workers.generate = lambda prompts, sampling: RolloutBatch(prompts, 2, tuple(
        r for row in prompts.rows for r in ((Response((1,), "eos"), long) if row == 2 else (long, long))))
    rollout, scored, _ = sampling_stage(StageContext(cfg, sampler, workers, Path(".")))(SamplingParams(n=2), {}, [])
    assert rollout.prompts.rows == (2,) and scored.scores.tolist() == [1.0, 1.0] and scored.rewards[1] < scored.rewards[0]


def test_off_is_one_round_without_metrics():
    cfg = _cfg(enable=False)
    rollout, scored, metrics, workers, timing = _step(cfg, _varied(set()))
    assert workers.rows == [(0, 1, 2, 3)] and rollout.prompts.rows == (0, 1, 2, 3) and metrics == {}
    assert scored.rollout is rollout and timing.keys() == {"gen", "reward"}


def test_resuming_the_sampler_after_a_step_draws_the_same_rounds():
    cfg, script = _cfg(), _varied({0, 3, 6, 9, 13, 17, 18, 23})
    sampler = _sampler(cfg)
    _step(cfg, script, sampler)
    state = sampler.state_dict()
    straight = _step(cfg, script, sampler)
    resumed_sampler = _sampler(cfg)
    resumed_sampler.load_state_dict(state)
    resumed = _step(cfg, script, resumed_sampler)
    assert resumed[3].rows == straight[3].rows == [(12, 13, 14, 15), (16, 17, 18, 19), (20, 21, 22, 23)]
    assert resumed[0].prompts.rows == straight[0].prompts.rows == (13, 17, 18, 23)


def _problems(overrides: list[str]) -> list[str]:
    cfg, problems, _ = check_config("demo", ["reward.name=gsm8k", *overrides])
    return [str(p) for p in problems if "filter" in p.key]


def test_config_refuses_a_filter_that_cannot_act():
    (one,) = _problems(["algorithm.filters.dynamic_sampling={}", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])
    assert one.startswith("algorithm.filters.dynamic_sampling={}: with rollout.n=1") and "set rollout.n >= 2" in one
    (zero,) = _problems(["algorithm.filters.dynamic_sampling.max_num_gen_batches=0"])
    assert "max_num_gen_batches=0: must be >= 1" in zero
    (mode,) = _problems(["algorithm.filters.dynamic_sampling={}", "trainer.rollout_mode=colocate_async"])
    assert "does not run under trainer.rollout_mode=colocate_async (it runs under sync)" in mode
    (moved,) = _problems(["algorithm.filter_groups.enable=true"])
    assert "algorithm.filter_groups moved: write algorithm.filters.dynamic_sampling={}" in moved
    assert _problems(["algorithm.filters.dynamic_sampling={}"]) == [] and config_problems(_cfg()) == []


def test_a_tiny_run_with_dynamic_sampling_trains_only_groups_with_variance(tmp_path, smollm_tokenizer):
    from tests.diagnostics.tiny_run import tiny_run

    if "test_letter_e_odd" not in REWARDS:

        @register_reward("test_letter_e_odd", scores_truncated=True)
        def _letter_e_odd(response_text: str, ground_truth: str, *, data_source: str, cfg) -> float:
            """The share of 'e' for odd answers; 0 for even ones (whose groups then have no variance)."""
            return response_text.count("e") / max(1, len(response_text)) if int(ground_truth) % 2 else 0.0

    smollm_tokenizer.padding_side = "left"
    common = ["reward.name=test_letter_e_odd", "algorithm.filters.dynamic_sampling={}", "train.dump_rollouts=true",
              "train.save_every=1", "train.mini_batch_size=1", "train.lr=1e-2"]
    straight, _ = tiny_run(tmp_path / "a", smollm_tokenizer, ["train.total_steps=3", *common])
    tiny_run(tmp_path / "b", smollm_tokenizer, ["train.total_steps=1", *common])
    resumed, _ = tiny_run(tmp_path / "b", smollm_tokenizer, ["train.total_steps=3", "train.resume=auto", *common])
    a, b = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, resumed))
    assert [line["step"] for line in b] == [1, 2, 3]
    assert sum(line["train/num_gen_batches"] for line in a) > 3, "some step must need a second round"
    for line in a:
        assert line["train/num_gen_prompts"] == 2 * line["train/num_gen_batches"]
        assert line["train/num_gen_prompts"] == line["train/num_dropped_prompts/dynamic_sampling"] + line["train/num_kept_prompts"]
        assert line["train/num_kept_prompts"] == (line["train/update_batch_prompts"] + line["train/num_dropped_prompts/surplus"]
                                                  + line["train/num_dropped_prompts/too_few_for_ranks"])
    for step in range(1, 4):
        dumped = [json.loads(x) for x in (straight / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert dumped == [json.loads(x) for x in (resumed / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        scores = torch.tensor([row["score"] for row in dumped])
        assert groups_with_variance(scores, 3) == list(range(len(dumped) // 3))
        for key in ("actor/pg_loss", "actor/grad_norm", "train/num_gen_batches", "train/update_batch_prompts"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)
