"""The length bench's paired statistics: McNemar's exact p-value, the bootstrap intervals of the
paired accuracy difference and of the mean-length ratio, the guess floor and the sample size."""

from __future__ import annotations

import math

import pytest

from bench.length_stats import compare, mcnemar_exact, rows_needed, summary


def _rows(correct, tokens, counts=None):
    counts = counts or [k % 4 for k in range(len(correct))]
    return [{"row": k, "count": c, "correct_strict": ok, "correct_lenient": True, "tokens": t}
            for k, (ok, t, c) in enumerate(zip(correct, tokens, counts))]


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(10, 2) == pytest.approx(2 * sum(math.comb(12, k) for k in range(3)) / 2**12)  # 0.0386
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2) and mcnemar_exact(5, 5) == 1.0


def test_rows_needed_for_a_paired_non_inferiority_test():
    assert rows_needed(0.10, 0.05) == 248 and rows_needed(0.20, 0.05) == 495
    assert rows_needed(0.10, 0.02) == 1546


def test_equal_arms_differ_by_nothing_and_a_halved_length_is_a_ratio_of_one_half():
    base = _rows([k % 3 != 0 for k in range(300)], [200 + k % 7 for k in range(300)])
    same = compare(base, base)
    assert same["accuracy_strict"]["difference_points"] == 0.0 and same["accuracy_strict"]["ci95_points"] == [0.0, 0.0]
    assert same["accuracy_strict"]["non_inferior"] and same["tokens_mean_ratio"] == 1.0
    half = compare(_rows([r["correct_strict"] for r in base], [r["tokens"] / 2 for r in base]), base)
    assert half["tokens_mean_ratio"] == 0.5 and half["tokens_mean_cut"] == 0.5 and half["tokens_mean_ratio_ci95"] == [0.5, 0.5]


def test_an_arm_ten_points_worse_is_not_non_inferior_at_five():
    correct = [k % 2 == 0 for k in range(400)]
    worse = [ok and k % 10 != 0 for k, ok in enumerate(correct)]  # 40 rows lost: -10 points
    result = compare(_rows(worse, [100] * 400), _rows(correct, [100] * 400))["accuracy_strict"]
    assert result["difference_points"] == -10.0 and result["only_base_right"] == 40 and result["only_arm_right"] == 0
    assert result["ci95_points"][1] < 0 and result["lower_one_sided_95_points"] < -5 and not result["non_inferior"]
    assert result["mcnemar_p"] < 1e-6


def test_rows_of_other_questions_are_refused():
    with pytest.raises(ValueError, match="different rows"):
        compare(_rows([True], [1]), _rows([True, False], [1, 2]))


def test_the_summary_reads_both_readings_by_count_and_the_guess_floor():
    rows = _rows([True, False, True, True], [10, 20, 30, 40], counts=[1, 1, 2, 0])
    s = summary(rows)
    assert s["accuracy_strict"] == 0.75 and s["accuracy_lenient"] == 1.0 and s["guess_floor_lenient"] == 0.5
    assert s["by_count"]["1"] == {"rows": 2, "accuracy_strict": 0.5, "accuracy_lenient": 1.0}
    assert s["tokens_mean"] == 25 and s["correct_tokens_mean"] == pytest.approx(80 / 3)
