"""Invariant 3: every reordering (micro-batching, rank balancing, packing) is undone exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packrl.seqlen.balance import balance_ranks
from packrl.seqlen.microbatch import plan_microbatches
from packrl.seqlen.packing import pack_sequences, restore_order

lengths_strategy = st.lists(st.integers(1, 64), min_size=1, max_size=48)


@settings(max_examples=200, deadline=None)
@given(lengths_strategy, st.integers(64, 256), st.booleans())
def test_microbatch_plan_restores_input_order(lengths, cap, balance):
    plan = plan_microbatches(lengths, cap, balance=balance)
    values = [f"seq{i}" for i in plan.order]  # what a worker returns, in plan order
    assert plan.restore(values) == [f"seq{i}" for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(lengths_strategy, st.integers(1, 5), st.integers(64, 256))
def test_rank_plan_restores_input_order(lengths, num_ranks, cap):
    if len(lengths) < num_ranks:
        return
    plan = balance_ranks(lengths, num_ranks, cap)
    per_rank = [[("value", i) for i in rank.order] for rank in plan.ranks]
    assert plan.restore(per_rank) == [("value", i) for i in range(len(lengths))]


@settings(max_examples=100, deadline=None)
@given(lengths_strategy, st.integers(64, 256))
def test_packs_of_a_plan_unpack_to_the_input_tensors(lengths, cap):
    g = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in lengths]
    plan = plan_microbatches(lengths, cap)
    packs = [pack_sequences([seqs[i] for i in mb], indices=mb) for mb in plan.microbatches]
    restored = restore_order(packs, [p.unpack(p.input_ids[0]) for p in packs])
    assert len(restored) == len(seqs)
    for got, want in zip(restored, seqs):
        assert torch.equal(got, want)
    for p in packs:
        for pos, n in zip(p.unpack(p.position_ids[0]), p.seq_lens):
            assert torch.equal(pos, torch.arange(n))


def test_restore_rejects_mismatched_values():
    plan = plan_microbatches([3, 4, 5], 8)
    with pytest.raises(ValueError, match="got 2 values"):
        plan.restore([1, 2])
    packs = [pack_sequences([[1, 2]], indices=[0]), pack_sequences([[3]], indices=[0])]
    with pytest.raises(ValueError, match="appears in two packs"):
        restore_order(packs, [p.unpack(p.input_ids[0]) for p in packs])
