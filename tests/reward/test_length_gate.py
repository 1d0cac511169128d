"""The accuracy gate of the length parts (`packrl.reward.length.common.gated`): each mode by hand on
shortest_correct and group_length, the gated fraction, and the config refusals."""

from __future__ import annotations

import pytest

from packrl.config import ConfigError, load_config
from tests.reward.test_length_parts import _rollout, _score

# two groups of 4: accuracy 0.5 (T T F F) and 0.25 (T F F F)
SC_LENGTHS, SC_CORRECT = [40, 25, 60, 15, 30, 10, 20, 40], [True, True, False, False, True, False, False, False]
SC_LENGTH = [-0.015, 0.0, -0.035, -0.010, 0.0, -0.020, -0.010, -0.010]  # -0.001 |len - SOL|, SOL = 25 and 30
SC_BONUS = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # (alpha - 1) * score on correct responses, alpha = 2, never gated


def _shortest(options: dict, step: int = 5):
    return _score(_rollout(SC_LENGTHS, SC_CORRECT, 4), "shortest_correct", {"beta": 0.001, **options}, step=step)


def test_shortest_correct_without_a_gate_reports_no_gated_term():
    scored = _shortest({})
    assert scored.parts["shortest_correct"].tolist() == pytest.approx([b + t for b, t in zip(SC_BONUS, SC_LENGTH)])
    assert "shortest_correct/gated" not in scored.parts


def test_shortest_correct_min_group_accuracy_switches_groups_off():
    scored = _shortest({"min_group_accuracy": 0.5})  # group 0 (2 of 4) passes, group 1 (1 of 4) does not
    length = SC_LENGTH[:4] + [0.0] * 4
    assert scored.parts["shortest_correct/length"].tolist() == pytest.approx(length)
    assert scored.parts["shortest_correct"].tolist() == pytest.approx([b + t for b, t in zip(SC_BONUS, length)])
    assert scored.parts["shortest_correct/gated"].tolist() == [0.0] * 4 + [1.0] * 4
    all_on = _shortest({"min_group_accuracy": 0.25})  # 1 of 4 meets 0.25 exactly
    assert all_on.parts["shortest_correct/length"].tolist() == pytest.approx(SC_LENGTH)


def test_shortest_correct_scale_by_pass_rate():
    scored = _shortest({"scale_by_pass_rate": True})
    length = [t * 0.5 for t in SC_LENGTH[:4]] + [t * 0.25 for t in SC_LENGTH[4:]]  # -0.0075, 0, -0.0175, -0.005, ...
    assert scored.parts["shortest_correct"].tolist() == pytest.approx([0.9925, 1.0, -0.0175, -0.005, 1.0, -0.005, -0.0025, -0.0025])
    assert scored.parts["shortest_correct/length"].tolist() == pytest.approx(length)
    assert scored.parts["shortest_correct/gated"].tolist() == [0.0] * 8
    none_correct = _score(_rollout([10, 30], [False, False], 2), "shortest_correct", {"scale_by_pass_rate": True})
    assert none_correct.parts["shortest_correct"].tolist() == [0.0, 0.0]  # pass rate 0: no length pressure
    assert none_correct.parts["shortest_correct/gated"].tolist() == [1.0, 1.0]


def test_shortest_correct_gate_modes_compose():
    scored = _shortest({"scale_by_pass_rate": True, "min_group_accuracy": 0.5})
    assert scored.parts["shortest_correct/length"].tolist() == pytest.approx([t * 0.5 for t in SC_LENGTH[:4]] + [0.0] * 4)
    warm = _shortest({"scale_by_pass_rate": True, "min_group_accuracy": 0.5, "warmup_steps": 3}, step=3)
    assert warm.parts["shortest_correct"].tolist() == SC_BONUS  # the warm-up zeroes every length term, not the bonus
    assert warm.parts["shortest_correct/gated"].tolist() == [1.0] * 8
    after = _shortest({"warmup_steps": 3}, step=4)
    assert after.parts["shortest_correct/length"].tolist() == pytest.approx(SC_LENGTH)
    assert after.parts["shortest_correct/gated"].tolist() == [0.0] * 8


# group_length, Kimi's lambda: group 0 (accuracy 0.5): lengths 20, 35, 50, 80 -> lambda 0.5, 0.25, 0, -0.5;
# group 1 (accuracy 0.25): 10, 20, 30, 40 -> lambda 0.5, 1/6, -1/6, -0.5
GL_LENGTHS, GL_CORRECT = [20, 35, 50, 80, 10, 20, 30, 40], [True, False, True, False, True, False, False, False]
GL_VALUE = [0.5, 0.0, 0.0, -0.5, 0.5, 0.0, -1 / 6, -0.5]  # lambda if correct, min(0, lambda) if wrong


def _group_length(options: dict, step: int = 5):
    return _score(_rollout(GL_LENGTHS, GL_CORRECT, 4), "group_length", options, step=step)


def test_group_length_each_gate_mode():
    assert _group_length({}).parts["group_length"].tolist() == pytest.approx(GL_VALUE)
    gate = _group_length({"min_group_accuracy": 0.5})
    assert gate.parts["group_length"].tolist() == pytest.approx(GL_VALUE[:4] + [0.0] * 4)
    assert float(gate.parts["group_length/gated"].mean()) == 0.5
    scaled = _group_length({"scale_by_pass_rate": True})
    assert scaled.parts["group_length"].tolist() == pytest.approx([0.25, 0.0, 0.0, -0.25, 0.125, 0.0, -1 / 24, -0.125])
    both = _group_length({"scale_by_pass_rate": True, "min_group_accuracy": 0.3, "weight": 2.0})
    assert both.parts["group_length"].tolist() == pytest.approx([0.5, 0.0, 0.0, -0.5] + [0.0] * 4)
    warm = _group_length({"warmup_steps": 5, "scale_by_pass_rate": True}, step=5)
    assert warm.parts["group_length"].tolist() == [0.0] * 8
    assert warm.parts["group_length/lambda"].tolist() == pytest.approx([0.5, 0.25, 0.0, -0.5, 0.5, 1 / 6, -1 / 6, -0.5])


def test_gate_metric_is_the_fraction_of_responses_zeroed():
    from packrl.config.schema import AlgorithmConfig
    from packrl.diagnostics.metrics import score_metrics
    from packrl.trainer.batch import build_train_batch

    batch, _ = build_train_batch(_group_length({"min_group_accuracy": 0.5}), None, None, AlgorithmConfig())
    metrics = score_metrics(batch)
    assert metrics["reward/group_length/gated/mean"] == 0.5


def test_every_length_part_takes_the_gate():
    over = ["data.length_target.min_tokens=8", "data.length_target.max_tokens=32"]
    for part in ("group_length", "efficiency", "shortest_correct", "target_length"):
        cfg = load_config("demo", [f"reward.shaping.{part}.min_group_accuracy=0.5", f"reward.shaping.{part}.scale_by_pass_rate=true",
                                   f"reward.shaping.{part}.warmup_steps=2", *over])
        assert cfg.reward.shaping[part] == {"min_group_accuracy": 0.5, "scale_by_pass_rate": True, "warmup_steps": 2}


def test_gate_refusals_name_the_key_the_value_and_the_fix():
    key = "reward.shaping.shortest_correct"
    for value in ("1.5", "-0.1"):
        with pytest.raises(ConfigError, match=rf"{key}.min_group_accuracy={value}: must be in \[0, 1\].*fix: set {key}.min_group_accuracy"):
            load_config("demo", [f"{key}.min_group_accuracy={value}"])
    with pytest.raises(ConfigError, match=rf"{key}.warmup_steps=-1: must be >= 0; fix: set {key}.warmup_steps=0"):
        load_config("demo", [f"{key}.warmup_steps=-1"])
    with pytest.raises(ConfigError, match=rf"{key}.warmup_steps=1.5: must be an integer; fix: set {key}.warmup_steps to an integer"):
        load_config("demo", [f"{key}.warmup_steps=1.5"])
    with pytest.raises(ConfigError, match=rf"{key}.scale_by_pass_rate=1: must be true or false"):
        load_config("demo", [f"{key}.scale_by_pass_rate=1"])
    with pytest.raises(ConfigError, match=rf"{key}.warmup_steps=5: leaves no step of train.total_steps=5"):
        load_config("demo", [f"{key}.warmup_steps=5"])
    exact = "reward.shaping.target_length"  # exact mode reads no correctness, the gate does
    with pytest.raises(ConfigError, match=rf"{exact}=.*declares no notion of correct"):
        load_config("demo", [f"{exact}.scale_by_pass_rate=true", "reward.name=test_dense", "data.length_target.min_tokens=8",
                             "data.length_target.max_tokens=32"])
    assert load_config("demo", [f"{exact}.warmup_steps=2", "reward.name=test_dense", "data.length_target.min_tokens=8",
                                "data.length_target.max_tokens=32"]).reward.shaping[exact.rsplit(".", 1)[1]] == {"warmup_steps": 2}
