"""The length objectives against their papers' formulas, written here by hand, and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.config.schema import RewardConfig
from packrl.diagnostics.length_metrics import length_metrics
from packrl.reward import score_rollout
from packrl.reward.registry import REWARDS, register_reward
from packrl.types import PromptBatch, Response, RolloutBatch

if "test_correct_if_long_word" not in REWARDS:

    @register_reward("test_correct_if_long_word", scores_truncated=False, correct_score=1.0)
    def _scripted(response_text: str, ground_truth: str, *, data_source: str, cfg) -> float:
        """1 when the response holds the letter the ground truth names, else 0 (a reward with a notion of correct)."""
        return 1.0 if ground_truth in response_text else 0.0


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join("y" if t == 1 else "n" for t in seq) for seq in ids]


def _rollout(lengths: list[int], correct: list[bool], group_size: int, *, cut: list[bool] | None = None,
             targets: tuple[int, ...] | None = None) -> RolloutBatch:
    num = len(lengths) // group_size
    prompts = PromptBatch(tuple((1, 2) for _ in range(num)), ("y",) * num, ("t",) * num, tuple(range(num)), (False,) * num,
                          length_targets=targets)
    cut = cut or [False] * len(lengths)
    responses = tuple(Response((1 if c else 0,) * n, "length" if k else "eos") for n, c, k in zip(lengths, correct, cut))
    return RolloutBatch(prompts, group_size, responses)


def _score(rollout: RolloutBatch, part: str, options: dict, step: int = 5):
    return score_rollout(rollout, _Tok(), RewardConfig(name="test_correct_if_long_word", shaping={part: options}), 512, step=step)


def test_group_length_is_kimis_lambda():
    lengths, correct = [10, 20, 30, 40], [True, True, False, False]
    scored = _score(_rollout(lengths, correct, 4), "group_length", {"weight": 0.5})
    lam = [0.5 - (n - 10) / 30 for n in lengths]  # Kimi k1.5: 0.5 - (len - min) / (max - min)
    expected = [0.5 * x if c else 0.5 * min(0.0, x) for x, c in zip(lam, correct)]
    assert scored.parts["group_length"].tolist() == pytest.approx(expected)
    assert scored.parts["group_length/lambda"].tolist() == pytest.approx(lam)
    same = _score(_rollout([7, 7], [True, False], 2), "group_length", {})
    assert same.parts["group_length"].tolist() == [0.0, 0.0]  # max = min: 0 for all
    warm = _score(_rollout(lengths, correct, 4), "group_length", {"warmup_steps": 5}, step=5)
    assert warm.parts["group_length"].tolist() == [0.0] * 4  # off during the warm-up


def test_efficiency_is_arora_and_zanettes_sigmoid_of_the_correct_z_score():
    lengths, correct = [10, 30, 50, 5], [True, True, True, False]
    scored = _score(_rollout(lengths, correct, 4), "efficiency", {"alpha": 0.2})
    mean = (10 + 30 + 50) / 3
    std = math.sqrt(sum((n - mean) ** 2 for n in (10, 30, 50)) / 3)
    sig = [1 / (1 + math.exp(-(n - mean) / std)) for n in (10, 30, 50)]
    assert scored.parts["efficiency"].tolist() == pytest.approx([-0.2 * s for s in sig] + [0.0])
    assert scored.rewards.tolist() == pytest.approx([1 - 0.2 * s for s in sig] + [0.0])  # reward = 1 - alpha sigmoid(z)
    one = _score(_rollout([10, 30], [True, False], 2), "efficiency", {"alpha": 0.2})
    assert one.parts["efficiency"].tolist() == pytest.approx([-0.1, 0.0])  # one correct: z = 0


def test_shortest_correct_is_shorterbetters_distance_to_the_sample_optimal_length():
    scored = _score(_rollout([12, 8, 20, 4], [True, True, False, False], 4), "shortest_correct", {"beta": 0.01})
    assert scored.parts["shortest_correct/length"].tolist() == pytest.approx([-0.04, 0.0, -0.12, -0.04])  # target 8, the shortest correct
    assert scored.parts["shortest_correct"].tolist() == pytest.approx([0.96, 1.0, -0.12, -0.04])  # + (alpha - 1) on correct
    none = _score(_rollout([10, 20], [False, False], 2), "shortest_correct", {"beta": 0.01})
    assert none.parts["shortest_correct"].tolist() == pytest.approx([-0.05, -0.05])  # none correct: the group's mean, 15
    task_score = _score(_rollout([12, 8], [True, True], 2), "shortest_correct", {"beta": 0.01, "alpha": 1.0})
    assert task_score.rewards.tolist() == pytest.approx([0.96, 1.0])  # alpha = 1: the task score as the correctness term


def test_shortest_correct_gives_the_papers_rewards_and_advantages():
    """ShorterBetter's code (naive.py): reward = alpha 1[correct] - beta |len - SOL|, alpha 2, beta 0.001."""
    from packrl.config.schema import AlgorithmConfig
    from packrl.trainer.batch import build_train_batch

    scored = _score(_rollout([40, 25, 60, 15], [True, True, False, False], 4), "shortest_correct", {"beta": 0.001})
    paper = [1.985, 2.0, -0.035, -0.010]  # SOL = 25
    assert scored.rewards.tolist() == pytest.approx(paper)
    batch, _ = build_train_batch(scored, None, None, AlgorithmConfig(adv_estimator="grpo"))
    mean, std = sum(paper) / 4, torch.tensor(paper).std().item()
    assert [float(a[0]) for a in batch.advantages] == pytest.approx([(r - mean) / (std + 1e-6) for r in paper], abs=1e-5)
    assert [float(a[0]) for a in batch.advantages] == pytest.approx([0.85953, 0.87243, -0.87672, -0.85524], abs=1e-4)


def test_a_response_a_budget_cut_is_not_correct():
    scored = _score(_rollout([10, 20], [True, True], 2, cut=[False, True]), "group_length", {"weight": 1.0})
    assert scored.correct.tolist() == [True, False]
    assert scored.parts["group_length"].tolist() == pytest.approx([0.5, -0.5])  # the cut one is pushed as a wrong one


def test_target_length_exact_and_max_follow_l1():
    rollout = _rollout([40, 60, 100, 100], [True, True, True, False], 2, targets=(50, 80))
    exact = _score(rollout, "target_length", {"alpha": 0.01})
    assert exact.parts["target_length"].tolist() == pytest.approx([-0.1, -0.1, -0.2, -0.2])  # -alpha |N - len|
    assert exact.parts["target_length/target_error"].tolist() == pytest.approx([0.2, 0.2, 0.25, 0.25])
    cap = _score(rollout, "target_length", {"mode": "max", "alpha": 0.01, "delta": 0.5})
    kept = [min(1.0, max(0.0, 0.01 * (t - n) + 0.5)) for t, n in ((50, 40), (50, 60), (80, 100))]  # clip(alpha (N - len) + delta, 0, 1)
    assert cap.parts["target_length"].tolist() == pytest.approx([k - 1 for k in kept] + [0.0])
    metrics = length_metrics(exact)
    assert metrics["length/target_error/mean"] == pytest.approx(0.225)


def test_target_length_scores_each_row_by_its_own_mode():
    """data.length_target.mode_column: an exact row and a max row in one batch (L1-Max's mix), whatever the option says."""
    from dataclasses import replace

    rollout = _rollout([40, 60, 40, 60], [True, True, True, False], 2, targets=(50, 50))
    rollout = replace(rollout, prompts=replace(rollout.prompts, length_modes=("exact", "max")))
    for option in ("exact", "max"):
        mixed = _score(rollout, "target_length", {"mode": option, "alpha": 0.01, "delta": 0.5})
        # exact row: -0.01 |50 - len|; max row: clip(0.01 (50 - len) + 0.5, 0, 1) - 1 on the correct one, 0 on the wrong one
        assert mixed.parts["target_length"].tolist() == pytest.approx([-0.1, -0.1, 0.6 - 1, 0.0])


def test_length_metrics_of_correct_and_wrong_responses():
    scored = _score(_rollout([10, 20, 30, 40], [True, True, False, False], 4), "group_length", {})
    m = length_metrics(scored)
    assert m["length/correct/mean"] == 15 and m["length/wrong/mean"] == 35
    assert m["length/tokens_per_correct"] == 50 and m["length/all_cut_or_wrong"] == 0.0
    assert m["length/score_per_1k_tokens"] == pytest.approx(1000 * 2 / 100)
    none = length_metrics(_score(_rollout([10, 20], [False, False], 2), "group_length", {}))
    assert none["length/all_cut_or_wrong"] == 1.0 and "length/tokens_per_correct" not in none


def test_refusals_name_the_key_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"reward.shaping.group_length=.*reward.name=test_dense declares no notion of correct"):
        load_config("demo", ["reward.shaping.group_length={}", "reward.name=test_dense"])
    with pytest.raises(ConfigError, match=r"reward.format_score=1.0: >= the correct score 1 of reward.name=gsm8k"):
        load_config("demo", ["reward.shaping.efficiency={}", "reward.format_score=1.0"])
    with pytest.raises(ConfigError, match=r"reward.shaping.group_length.warmup_steps=5: leaves no step of train.total_steps=5"):
        load_config("demo", ["reward.shaping.group_length.warmup_steps=5"])
    with pytest.raises(ConfigError, match=r"reward.shaping.efficiency.alpha=2.0: must be in \(0, 1\]"):
        load_config("demo", ["reward.shaping.efficiency.alpha=2"])
    with pytest.raises(ConfigError, match=r"reward.shaping.target_length=.*data.length_target sets none"):
        load_config("demo", ["reward.shaping.target_length={}"])
    with pytest.raises(ConfigError, match=r"reward.shaping.target_length=.*reward.name=test_dense declares no notion of correct"):
        load_config("demo", ["reward.shaping.target_length={}", "reward.name=test_dense", "data.length_target.column=n",
                             "data.length_target.mode_column=mode"])  # exact by option, but a row may ask for a maximum
    with pytest.raises(ConfigError, match=r"data.length_target.max_tokens=100: > rollout.max_response_tokens=64"):
        load_config("demo", ["data.length_target.min_tokens=10", "data.length_target.max_tokens=100"])
    assert load_config("demo", ["reward.shaping.shortest_correct.beta=0.01"]).reward.shaping == {"shortest_correct": {"beta": 0.01}}


if "test_dense" not in REWARDS:

    @register_reward("test_dense")
    def _dense(response_text: str, ground_truth: str, *, data_source: str, cfg) -> float:
        """A dense score with no notion of correct."""
        return len(response_text) / 100


def test_every_length_part_is_registered_with_its_check():
    from packrl.registry import REWARD_SHAPING

    for part in ("group_length", "efficiency", "shortest_correct", "target_length"):
        assert part in REWARD_SHAPING and REWARD_SHAPING.options_class(part) is not None
    assert torch.is_tensor(_score(_rollout([3, 4], [True, False], 2), "shortest_correct", {}).parts["shortest_correct"])


def test_task_arithmetic_trains_with_every_length_part_gfpo_and_targets(tmp_path, smollm_tokenizer):
    """The demo preset's task:arithmetic (not only task:char_count) runs with the four objectives,
    GFPO and drawn targets at once: every part is reported, the filter keeps k of n, every value is finite."""
    import json

    from tests.diagnostics.tiny_run import tiny_run

    run_dir, workers = tiny_run(tmp_path, smollm_tokenizer, [
        "train.total_steps=2", "rollout.n=4", "algorithm.filters.gfpo.keep=2", "reward.shaping.group_length.weight=0.5",
        "reward.shaping.efficiency.alpha=0.2", "reward.shaping.shortest_correct.beta=0.01", "reward.shaping.target_length.mode=max",
        "data.length_target.min_tokens=4", "data.length_target.max_tokens=12"])
    workers.close()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        for part in ("group_length", "efficiency", "shortest_correct", "target_length"):
            assert math.isfinite(line[f"reward/{part}/mean"])
        assert line["filter/gfpo/dropped"] == 4
        assert math.isfinite(line["length/target_error/mean"]) and math.isfinite(line["actor/pg_loss"])
