"""The length-control paths that touch the loss keep invariant 4 (the loss and the gradient of a
mini-batch do not depend on its micro-batches or ranks): GFPO's filtered responses
(``algorithm.filters.gfpo``: no loss tokens, advantage 0) and a thinking budget's forced
end-of-thinking tokens (``Response.forced_span``: out of the loss mask).

The oracle for the filter is independent of packrl's masking: the same update on a batch that
holds only the kept responses (groups of k, their advantages from the estimator over those k)
must give the same loss and gradient, for every aggregation mode, split and rank count.

The update leaves the filtered responses out of its micro-batches (no loss token,
`packrl.seqlen.update_plan.trained_sequences`); with them packed and masked (``keep_masked``,
what the update did before) the loss and the gradient are the same, also where a rank is left
with no loss token at all.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch
from tests.builders import BUDGETS, RTOL, WHOLE, pass_config
from tests.conftest import minibatch_grads, tiny_llama

PROMPT_LENS = [5, 9, 3]
RESPONSE_LENS = [14, 3, 22, 6, 17, 9, 1, 11, 8, 4, 12, 7]
"""Three prompts x four responses; response 2 has a forced end-of-thinking span (tokens 10-13)."""
FORCED = (2, (10, 13))
KEEP = 2


def _response(i: int, ids: tuple[int, ...]) -> Response:
    if i != FORCED[0]:
        return Response(ids, "eos")
    start, stop = FORCED[1]
    mask = tuple(not start <= t < stop for t in range(len(ids)))
    return Response(ids, "eos", response_mask=mask, forced_span=(start, stop))


def _scored(keep_only: list[int] | None = None) -> ScoredBatch:
    """The scored rollout (rewards drawn once, so the kept-only batch carries the same values)."""
    g = torch.Generator().manual_seed(11)
    prompts = PromptBatch(tuple(tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in PROMPT_LENS),
                          ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3)
    responses = [_response(i, tuple(torch.randint(0, 97, (n,), generator=g).tolist())) for i, n in enumerate(RESPONSE_LENS)]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 1.0], dtype=torch.float64)
    if keep_only is None:
        return ScoredBatch(RolloutBatch(prompts, 4, tuple(responses)), rewards, rewards)
    kept = tuple(responses[i] for i in keep_only)
    return ScoredBatch(RolloutBatch(prompts, KEEP, kept), rewards[keep_only], rewards[keep_only])


def _old_logprobs(indices: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    every = [-4.6 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64) for n in RESPONSE_LENS]
    return tuple(every[i] for i in indices)


def _cfg(mode: str, budget: int, keep: int | None):
    return pass_config(batch_size=3, n=4, max_prompt_tokens=12, max_response_tokens=24, update_tokens=budget, loss_agg_mode=mode,
                       clip_ratio_low=0.1, clip_ratio_high=0.1,
                       filters={} if keep is None else {"gfpo": {"keep": keep, "metric": "shortest"}})


def _loss_and_grads(batch, cfg, num_ranks: int, keep_masked: bool = False) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float64)
    loss = minibatch_grads(model, batch, cfg, num_ranks=num_ranks, keep_masked=keep_masked)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _kept() -> list[int]:
    lengths = torch.tensor(RESPONSE_LENS).view(3, 4)
    order = torch.sort(torch.argsort(lengths, dim=1, stable=True)[:, :KEEP], dim=1).values
    return (order + torch.arange(3).unsqueeze(1) * 4).reshape(-1).tolist()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gfpo_and_forced_tokens_do_not_depend_on_micro_batches_or_ranks(mode):
    every = list(range(len(RESPONSE_LENS)))
    batch, _ = build_train_batch(_scored(), _old_logprobs(every), None, _cfg(mode, WHOLE, KEEP).algorithm)
    assert batch.filtered is not None and sum(f is not None for f in batch.filtered) == 6
    assert not batch.loss_masks[FORCED[0]][FORCED[1][0]:FORCED[1][1]].any()
    loss_ref, grad_ref = _loss_and_grads(batch, _cfg(mode, WHOLE, KEEP), 1)
    assert grad_ref.abs().max() > 0
    _assert_every_split_gives(batch, mode, BUDGETS, loss_ref, grad_ref)


def _assert_every_split_gives(batch, mode, budgets, loss_ref, grad_ref):
    """The loss and gradient of ``batch`` under GFPO's keep on every budget of ``budgets`` and 1-2 ranks equal the reference."""
    for budget in budgets:
        for num_ranks in (1, 2):
            loss, grads = _loss_and_grads(batch, _cfg(mode, budget, KEEP), num_ranks)
            where = f"{mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=RTOL), where
            torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=where)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_filtered_responses_weigh_as_if_they_were_never_in_the_batch(mode):
    kept = _kept()
    assert kept == [1, 3, 5, 6, 9, 11]
    every = list(range(len(RESPONSE_LENS)))
    filtered, _ = build_train_batch(_scored(), _old_logprobs(every), None, _cfg(mode, WHOLE, KEEP).algorithm)
    alone, _ = build_train_batch(_scored(kept), _old_logprobs(kept), None, _cfg(mode, WHOLE, None).algorithm)
    for i, j in enumerate(kept):
        torch.testing.assert_close(filtered.advantages[j].double(), alone.advantages[i].double(), rtol=0, atol=1e-12)
    for budget in (WHOLE, BUDGETS[0]):
        for num_ranks in (1, 2):
            loss_f, grad_f = _loss_and_grads(filtered, _cfg(mode, budget, KEEP), num_ranks)
            loss_a, grad_a = _loss_and_grads(alone, pass_config(batch_size=3, n=KEEP, max_prompt_tokens=12, max_response_tokens=24,
                                                                update_tokens=budget, loss_agg_mode=mode, clip_ratio_low=0.1,
                                                                clip_ratio_high=0.1), num_ranks)
            where = f"{mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss_f == pytest.approx(loss_a, rel=RTOL), where
            torch.testing.assert_close(grad_f, grad_a, rtol=RTOL, atol=1e-12, msg=where)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_filtered_responses_left_out_of_the_update_give_the_loss_and_gradient_of_them_masked(mode):
    every = list(range(len(RESPONSE_LENS)))
    batch, _ = build_train_batch(_scored(), _old_logprobs(every), None, _cfg(mode, WHOLE, KEEP).algorithm)
    loss_ref, grad_ref = _loss_and_grads(batch, _cfg(mode, WHOLE, KEEP), 1, keep_masked=True)  # packed, forwarded, masked
    assert grad_ref.abs().max() > 0
    _assert_every_split_gives(batch, mode, (WHOLE, *BUDGETS), loss_ref, grad_ref)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_rank_left_without_loss_tokens_keeps_a_sequence_and_the_loss(mode):
    """One response with loss tokens in the mini-batch and two ranks: the other rank holds the
    shortest masked sequence (it adds 0), and the loss and gradient are those of the whole batch masked."""
    every = list(range(len(RESPONSE_LENS)))
    batch, _ = build_train_batch(_scored(), _old_logprobs(every), None, _cfg(mode, WHOLE, KEEP).algorithm)
    only = 3
    batch = replace(batch, loss_masks=tuple(m if i == only else torch.zeros_like(m) for i, m in enumerate(batch.loss_masks)))
    loss_ref, grad_ref = _loss_and_grads(batch, _cfg(mode, WHOLE, KEEP), 1, keep_masked=True)
    assert grad_ref.abs().max() > 0
    for budget in (WHOLE, BUDGETS[0]):
        loss, grads = _loss_and_grads(batch, _cfg(mode, budget, KEEP), 2)
        assert loss == pytest.approx(loss_ref, rel=RTOL), f"{mode}: budget {budget}"
        torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=f"{mode}: budget {budget}")
