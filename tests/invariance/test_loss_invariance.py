"""Invariant 4: the loss and the gradient of a mini-batch do not depend on how it is split into
micro-batches or ranks, for every loss aggregation mode.

The model runs in float64 here so that a 1e-6 relative check tests the aggregation, not float32
summation order (float32 packs of different widths differ by ~1e-7 before any loss is taken).
"""

from __future__ import annotations

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES, LossDenominators, aggregate_loss
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.balance import balance_ranks
from packrl.seqlen.microbatch import plan_microbatches
from packrl.seqlen.packing import pack_sequences
from tests.conftest import tiny_llama

RTOL = 1e-6


def _batch():
    """Eight sequences: prompt + response ids, per-sequence advantage, response loss mask.
    Sequence 5's response is fully masked (a truncated response under algorithm.truncated=mask)."""
    g = torch.Generator().manual_seed(3)
    prompt_lens = [5, 9, 3, 12, 4, 7, 6, 10]
    response_lens = [14, 3, 22, 6, 17, 9, 1, 11]
    seqs, masks = [], []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        seqs.append(torch.randint(0, 97, (p + r,), generator=g))
        mask = torch.zeros(p + r, dtype=torch.bool)
        if i != 5:
            mask[p:] = True
        masks.append(mask)
    advantages = torch.randn(len(seqs), generator=g, dtype=torch.float64)
    return seqs, masks, advantages


def _microbatch_loss(model, seqs, masks, advantages, indices, mode, denominators):
    pack = pack_sequences([seqs[i] for i in indices], indices=indices)
    lp = pack_logprobs(model, pack, chunk_tokens=16)
    adv = advantages[list(indices)][pack.sequence_ids()]
    ratio_like = torch.exp(lp.token_logprobs - lp.token_logprobs.detach())
    token_loss = -adv * ratio_like + 0.05 * lp.token_logprobs**2  # a PPO-shaped, nonlinear token loss
    loss_mask = torch.cat([masks[i] for i in indices])
    return aggregate_loss(token_loss, loss_mask, mode, denominators, sequence_ids=pack.sequence_ids())


def _loss_and_grads(mode, groups_per_rank):
    model = tiny_llama(dtype=torch.float64)
    seqs, masks, advantages = _batch()
    denominators = LossDenominators.from_masks(masks, loss_scale_factor=24)
    total = torch.zeros((), dtype=torch.float64)
    for rank_groups in groups_per_rank:  # ranks: gradients are summed, as an all-reduce SUM does
        for indices in rank_groups:
            loss = _microbatch_loss(model, seqs, masks, advantages, indices, mode, denominators)
            loss.backward()
            total += loss.detach()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return total, grads


def _splits():
    seqs, _, _ = _batch()
    lengths = [len(s) for s in seqs]
    micro = plan_microbatches(lengths, 40)
    assert micro.num_microbatches >= 4
    splits = {"whole": [[tuple(range(len(seqs)))]], "micro-batches": [list(micro.microbatches)]}
    for d in (2, 3):
        ranks = balance_ranks(lengths, d, 40)
        splits[f"{d} ranks"] = [[mb for mb in rank.microbatches if mb] for rank in ranks.ranks]
    return splits


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_and_grads_do_not_depend_on_the_split(mode):
    results = {name: _loss_and_grads(mode, groups) for name, groups in _splits().items()}
    loss_ref, grad_ref = results["whole"]
    assert grad_ref.abs().max() > 0
    for name, (loss, grads) in results.items():
        torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=0, msg=f"{mode}: loss of {name}")
        torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=f"{mode}: grads of {name}")


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
