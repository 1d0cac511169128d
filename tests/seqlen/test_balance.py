"""Karmarkar-Karp partitioning and the rank plan."""

from __future__ import annotations

import random

import pytest

from packrl.seqlen.balance import balance_ranks, karmarkar_karp, refine_partition


def test_kk_is_a_partition_and_balances():
    rng = random.Random(0)
    costs = [rng.randint(1, 1000) for _ in range(500)]
    parts = refine_partition(karmarkar_karp(costs, 8), costs)
    assert sorted(i for p in parts for i in p) == list(range(500))
    sums = [sum(costs[i] for i in p) for p in parts]
    assert max(sums) / (sum(sums) / 8) < 1.001


def test_kk_small_cases():
    costs = [8, 7, 6, 5, 4]
    kk = karmarkar_karp(costs, 2)
    assert sorted(sum(costs[i] for i in p) for p in kk) == [14, 16]  # KK's known answer; the optimum is 15/15
    refined = refine_partition(kk, costs)
    assert sorted(sum(costs[i] for i in p) for p in refined) == [15, 15]
    assert sum(map(len, karmarkar_karp([3], 4))) == 1


@pytest.mark.parametrize(("costs", "k", "match"), [([], 2, "empty batch"), ([1, 2], 0, "num_parts=0")])
def test_kk_bad_input(costs, k, match):
    with pytest.raises(ValueError, match=match):
        karmarkar_karp(costs, k)


def test_skewed_ranks_have_equal_microbatch_counts_and_report_imbalance():
    lengths = [1000] * 4 + [100] * 40
    plan = balance_ranks(lengths, 2, 2048)
    assert len({p.num_microbatches for p in plan.ranks}) == 1
    assert plan.imbalance() < 1.05
    assert sorted(i for idx in plan.rank_indices() for i in idx) == list(range(44))


def test_balance_ranks_errors_name_index_and_key():
    with pytest.raises(ValueError, match="sequence 2 has 5,000 tokens > train.max_tokens_per_microbatch=4,096"):
        balance_ranks([10, 20, 5000], 2, 4096)
    with pytest.raises(ValueError, match="num_ranks=0"):
        balance_ranks([10, 20], 0, 4096)
    with pytest.raises(ValueError, match="3 ranks"):
        balance_ranks([10, 20], 3, 4096)
