"""Invariant 4: the loss and the gradient of a mini-batch do not depend on how it is split into
micro-batches or ranks, for every loss aggregation mode.

The split is the real one: the update plan (`packrl.seqlen.update_plan.plan_update`) for 1 and 2
ranks under two micro-batch budgets, run through the update's own micro-batch path
(`packrl.worker.actor.actor_microbatches`: the registered policy loss, the KL term and the entropy
bonus), ranks simulated one after the other with their gradients summed as an all-reduce SUM does.
The model runs in float64 so that a 1e-6 relative check tests the aggregation, not float32
summation order (float32 packs of different widths differ by ~1e-7 before any loss is taken).
The reference keeps the masked (truncated) response in its micro-batch (``keep_masked``); the
splits leave it out, as the update does (`packrl.seqlen.update_plan.trained_sequences`).
"""

from __future__ import annotations

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES, aggregate_loss
from packrl.seqlen.denominators import LossDenominators
from tests.builders import BUDGETS, LOSS_PROMPT_LENS, LOSS_RESPONSE_LENS, RTOL, WHOLE, loss_batch, pass_config
from tests.conftest import minibatch_grads, tiny_llama


def _cfg(mode: str, budget: int):
    return pass_config(batch_size=4, n=2, max_prompt_tokens=12, max_response_tokens=24, update_tokens=budget, loss_agg_mode=mode,
                       kl_coef=0.1, entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1)


def _loss_and_grads(mode: str, budget: int, num_ranks: int, keep_masked: bool = False) -> tuple[float, torch.Tensor]:
    model = tiny_llama(dtype=torch.float64)
    loss = minibatch_grads(model, loss_batch(), _cfg(mode, budget), num_ranks=num_ranks, keep_masked=keep_masked)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_and_grads_do_not_depend_on_micro_batches_or_ranks(mode):
    loss_ref, grad_ref = _loss_and_grads(mode, WHOLE, 1, keep_masked=True)
    assert grad_ref.abs().max() > 0
    for budget in (WHOLE, *BUDGETS):
        for num_ranks in (1, 2):
            loss, grads = _loss_and_grads(mode, budget, num_ranks)
            where = f"{mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=RTOL), where
            torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=where)


def test_the_splits_really_differ():
    from packrl.seqlen.update_plan import plan_update

    lengths = [LOSS_PROMPT_LENS[i // 2] + n for i, n in enumerate(LOSS_RESPONSE_LENS)]
    counts = {}
    for budget in (WHOLE, *BUDGETS):
        for num_ranks in (1, 2):
            plan = plan_update(lengths, LOSS_RESPONSE_LENS, groups=[i // 2 for i in range(len(lengths))], mini_batch_prompts=4,
                               num_epochs=1, num_ranks=num_ranks, max_tokens=budget, balance=True, loss_scale_factor=24)
            counts[budget, num_ranks] = [len([mb for mb in plan.minibatches[0].microbatches(r) if mb]) for r in range(num_ranks)]
    assert counts[WHOLE, 1] == [1] and sum(counts[BUDGETS[0], 1]) >= 3 and all(c >= 1 for c in counts[BUDGETS[0], 2])
    assert counts[BUDGETS[0], 1] != counts[BUDGETS[1], 1]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_whole_batch_matches_the_padded_formula(mode):
    """Packed flat aggregation == the [N, R] formula of the same mode on a padded matrix."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 7, 1, 5]
    width = max(lens)
    loss_mat = torch.randn(len(lens), width, generator=g, dtype=torch.float64)
    mask = torch.arange(width)[None, :] < torch.tensor(lens)[:, None]
    mask[2] = False  # one fully masked sequence
    denominators = LossDenominators.from_masks(list(mask), loss_scale_factor=width)
    s = (loss_mat * mask).sum(-1)
    n = mask.sum(-1)
    live = n > 0
    expected = {
        "token-mean": s.sum() / n.sum(),
        "seq-mean-token-sum": s[live].mean(),
        "seq-mean-token-mean": (s[live] / n[live]).mean(),
        "seq-mean-token-sum-norm": s[live].mean() / width,
    }[mode]
    padded = aggregate_loss(loss_mat, mask, mode, denominators)
    flat = aggregate_loss(loss_mat[mask.any(-1)].reshape(-1), mask[mask.any(-1)].reshape(-1), mode, denominators,
                          sequence_ids=torch.arange(3).repeat_interleave(width))
    torch.testing.assert_close(padded, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(flat, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_microbatch_adds_nothing(mode):
    token_loss = torch.tensor([3.0, float("nan"), 7.0], requires_grad=True)
    loss_mask = torch.zeros(3, dtype=torch.bool)
    denominators = LossDenominators(num_tokens=10, num_sequences=2, loss_scale_factor=8)
    loss = aggregate_loss(token_loss, loss_mask, mode, denominators, sequence_ids=torch.tensor([0, 0, 1]))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(token_loss.grad, torch.zeros(3))


def test_worked_case_token_mean_is_one():
    token_loss = torch.tensor([[10.0] + [0.0] * 9])
    loss_mask = torch.ones(1, 10, dtype=torch.bool)
    denominators = LossDenominators.from_masks(list(loss_mask), loss_scale_factor=10)
    assert aggregate_loss(token_loss, loss_mask, "token-mean", denominators).item() == 1.0


def test_bad_arguments_are_value_errors():
    d = LossDenominators(num_tokens=1, num_sequences=1, loss_scale_factor=1)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), "mean", d)
    with pytest.raises(ValueError, match="differ in shape"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool), "token-mean", d)
    with pytest.raises(ValueError, match="sequence_ids"):
        aggregate_loss(torch.zeros(4), torch.ones(4, dtype=torch.bool), "token-mean", d)
    with pytest.raises(ValueError, match="loss_scale_factor=0"):
        LossDenominators.from_masks([torch.ones(2, dtype=torch.bool)], loss_scale_factor=0)
