"""The update plan leaves sequences without a loss token out of its micro-batches
(`packrl.seqlen.update_plan.trained_sequences`): GFPO's filtered responses are in no micro-batch
of any rank, the denominators are those of the plan that keeps them, every rank still holds a
sequence, and GFPO with n=8, keep=4 plans half the tokens of the plan that keeps them."""

from __future__ import annotations

import pytest
import torch

from packrl.config.schema import AlgorithmConfig
from packrl.seqlen.update_plan import groups_of, plan_update, trained_sequences
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch


@pytest.mark.parametrize(("loss_tokens", "lengths", "ranks", "expected"), [
    ([3, 0, 5, 0], [9, 4, 9, 6], 1, (0, 2)),
    ([3, 0, 0, 0], [9, 8, 4, 6], 2, (0, 2)),
    ([0, 0, 0, 0], [9, 8, 4, 6], 1, (2,)),
])
def test_trained_sequences_table(loss_tokens, lengths, ranks, expected):
    assert trained_sequences((0, 1, 2, 3), loss_tokens, lengths, ranks) == expected


def _plan(lengths, loss_tokens, group_size, *, num_ranks, max_tokens, keep_masked=False, mini_batch_prompts=2, units=None):
    return plan_update(lengths, loss_tokens, groups=groups_of(len(lengths), group_size), mini_batch_prompts=mini_batch_prompts,
                       num_epochs=1, num_ranks=num_ranks, max_tokens=max_tokens, balance=True, loss_scale_factor=64,
                       keep_masked=keep_masked, units=units)


def _gfpo_batch(lengths: list[int], group_size: int, keep: int):
    """A GFPO train batch (``metric=reward_per_token``) over responses of ``lengths``, prompts of 5 tokens."""
    num = len(lengths) // group_size
    g = torch.Generator().manual_seed(1)
    prompts = PromptBatch(tuple((1, 2, 3, 4, k) for k in range(num)), ("1",) * num, ("t",) * num, tuple(range(num)), (False,) * num)
    rewards = torch.randint(0, 2, (len(lengths),), generator=g).float()
    scored = ScoredBatch(RolloutBatch(prompts, group_size, tuple(Response((7,) * n, "eos") for n in lengths)), rewards, rewards)
    cfg = AlgorithmConfig(adv_estimator="grpo", filters={"gfpo": {"keep": keep, "metric": "reward_per_token"}})
    return build_train_batch(scored, None, None, cfg)[0]


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("max_tokens", [4096, 40])
def test_filtered_responses_are_in_no_micro_batch_and_the_denominators_stay(num_ranks, max_tokens):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 30, (32,), generator=g).tolist()
    batch = _gfpo_batch(lengths, group_size=8, keep=4)
    assert batch.filtered is not None and sum(f is not None for f in batch.filtered) == 16
    seq_lengths = batch.rollout.sequence_lengths()
    loss_tokens = [int(m.sum()) for m in batch.loss_masks]
    plan = _plan(seq_lengths, loss_tokens, 8, num_ranks=num_ranks, max_tokens=max_tokens)
    before = _plan(seq_lengths, loss_tokens, 8, num_ranks=num_ranks, max_tokens=max_tokens, keep_masked=True)
    filtered = {i for i, out in enumerate(batch.filtered) if out}
    assert plan.left_out() == tuple(sorted(filtered)) and before.left_out() == ()
    for mb, old in zip(plan.minibatches, before.minibatches, strict=True):
        assert mb.denominators == old.denominators and mb.sequences == old.sequences
        planned = [i for r in range(num_ranks) for m in mb.microbatches(r) for i in m]
        assert sorted(planned) == [i for i in mb.sequences if i not in filtered]  # each kept response once, no filtered one
        assert all(any(mb.microbatches(r)) for r in range(num_ranks))  # every rank holds a sequence
        assert all(sum(seq_lengths[i] for i in m) <= max_tokens for r in range(num_ranks) for m in mb.microbatches(r))


def test_gfpo_n8_keep4_updates_half_the_tokens():
    """Responses of equal length: the update packs, forwards and back-propagates half the tokens
    (and half the sequences) of the plan that keeps the filtered responses masked."""
    batch = _gfpo_batch([12] * 32, group_size=8, keep=4)
    seq_lengths, loss_tokens = batch.rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks]

    def planned_tokens(keep_masked: bool) -> int:
        plan = _plan(seq_lengths, loss_tokens, 8, num_ranks=2, max_tokens=64, keep_masked=keep_masked)
        return sum(seq_lengths[i] for mb in plan.minibatches for r in range(2) for m in mb.microbatches(r) for i in m)

    assert planned_tokens(keep_masked=False) * 2 == planned_tokens(keep_masked=True) == 32 * (5 + 12)


def test_a_rank_without_a_loss_sequence_gets_the_shortest_masked_one():
    lengths, loss_tokens = [20, 9, 30, 7, 11, 5], [0, 0, 4, 0, 0, 0]
    plan = _plan(lengths, loss_tokens, 6, num_ranks=2, max_tokens=64, mini_batch_prompts=1)
    (mb,) = plan.minibatches
    assert sorted(tuple(i for m in mb.microbatches(r) for i in m) for r in range(2)) == [(2,), (5,)]
    assert (mb.denominators.num_tokens, mb.denominators.num_sequences) == (4, 1)
    none = _plan(lengths, [0] * 6, 6, num_ranks=1, max_tokens=64, mini_batch_prompts=1)  # a mini-batch with no loss token
    assert [i for m in none.minibatches[0].microbatches(0) for i in m] == [5] and none.minibatches[0].denominators.num_tokens == 0
    with pytest.raises(ValueError, match="ranks"):  # fewer sequences than ranks stays an error
        _plan(lengths[:2], [3, 0], 2, num_ranks=3, max_tokens=64, mini_batch_prompts=1)


def test_a_masked_sequence_over_the_budget_is_still_named():
    with pytest.raises(ValueError, match=r"sequence 1 .*train.max_tokens_per_microbatch"):
        _plan([10, 99, 12, 8], [3, 0, 2, 4], 2, num_ranks=1, max_tokens=64)


def test_step_wise_samples_count_their_trajectory_once_when_a_sample_is_left_out():
    """Samples 0-1 are one trajectory (sample 0 has no loss token), 2 another: S = 2 either way."""
    plan = _plan([10, 12, 8, 9], [0, 5, 3, 0], 4, num_ranks=1, max_tokens=64, units=[0, 0, 1, 2])
    old = _plan([10, 12, 8, 9], [0, 5, 3, 0], 4, num_ranks=1, max_tokens=64, units=[0, 0, 1, 2], keep_masked=True)
    assert plan.minibatches[0].denominators == old.minibatches[0].denominators
    assert (plan.minibatches[0].denominators.num_tokens, plan.minibatches[0].denominators.num_sequences) == (8, 2)
    assert plan.left_out() == (0, 3)
