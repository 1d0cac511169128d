"""Invariant 3: every reordering (micro-batching, rank balancing, packing) is undone exactly, by the
helpers the worker group restores order with (`MicrobatchPlan.restore`, `RankPlan.restore`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packrl.seqlen.balance import balance_ranks
from packrl.seqlen.microbatch import plan_microbatches
from packrl.seqlen.packing import pack_sequences
from packrl.seqlen.update_plan import plan_ranks

lengths_strategy = st.lists(st.integers(1, 64), min_size=1, max_size=48)


@settings(max_examples=200, deadline=None)
@given(lengths_strategy, st.integers(64, 256), st.booleans())
def test_one_rank_plan_restores_input_order(lengths, cap, balance):
    plan = plan_ranks(lengths, 1, cap, balance=balance, budget_key="train.max_tokens_per_microbatch")
    assert plan.ranks[0] == plan_microbatches(lengths, cap, balance=balance)  # one rank: the micro-batch planner as is
    values = [f"seq{i}" for i in plan.ranks[0].order]  # what a worker returns, in plan order
    assert plan.restore([values]) == [f"seq{i}" for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(lengths_strategy, st.integers(1, 5), st.integers(64, 256))
def test_rank_plan_restores_input_order(lengths, num_ranks, cap):
    if len(lengths) < num_ranks:
        return
    plan = balance_ranks(lengths, num_ranks, cap)
    per_rank = [[("value", i) for i in rank.order] for rank in plan.ranks]
    assert plan.restore(per_rank) == [("value", i) for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(lengths_strategy, st.integers(1, 3), st.integers(64, 256))
def test_packs_of_a_plan_unpack_to_the_input_tensors(lengths, num_ranks, cap):
    """What a worker returns for its packs (each sequence unpacked, micro-batch after
    micro-batch) comes back in input order through `RankPlan.restore`."""
    if len(lengths) < num_ranks:
        return
    g = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    plan = plan_ranks(lengths, num_ranks, cap, balance=True, budget_key="train.max_tokens_per_logprob_microbatch")
    per_rank = []
    for rank in plan.ranks:
        packs = [pack_sequences([seqs[i] for i in mb], indices=mb) for mb in rank.microbatches if mb]
        per_rank.append([part for p in packs for part in p.unpack(p.input_ids[0])])
    restored = plan.restore(per_rank)
    assert len(restored) == len(seqs)
    for got, want in zip(restored, seqs):
        assert torch.equal(got, want)
    for p in (pack_sequences([seqs[i] for i in mb], indices=mb) for rank in plan.ranks for mb in rank.microbatches if mb):
        for pos, n in zip(p.unpack(p.position_ids[0]), p.seq_lens):
            assert torch.equal(pos, torch.arange(n))


def test_restore_rejects_mismatched_values():
    ranks = plan_ranks([3, 4, 5], 1, 8, balance=True, budget_key="train.max_tokens_per_microbatch")
    with pytest.raises(ValueError, match="returned 2 values"):
        ranks.restore([[1, 2]])
    with pytest.raises(ValueError, match="got values from 2 ranks"):
        ranks.restore([[1, 2, 3], []])
    ranks = plan_ranks([3, 4, 5], 2, 8, balance=True, budget_key="train.max_tokens_per_microbatch")
    with pytest.raises(ValueError, match="returned"):
        ranks.restore([[1], [2]])
