"""Invariant 4 for the critic: the value loss and its gradient do not depend on how a mini-batch
is split into micro-batches or ranks, for every loss aggregation mode (the critic's own
micro-batch path, `packrl.worker.critic.critic_microbatches`, ranks simulated one after the other
with their gradients summed as an all-reduce SUM does). Float64, as the actor's test. The
reference plan keeps the masked response in its micro-batch (``keep_masked``); every split leaves
it out, as the update does. The values the value pass returns are the ones a plain unpacked
forward gives."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES
from packrl.seqlen.update_plan import groups_of, plan_update
from packrl.worker.critic import ValueModel, compute_values, critic_microbatches
from packrl.worker.packs import PackForward
from tests.builders import BUDGETS, WHOLE, loss_batch
from tests.conftest import tiny_llama

CLIP = 0.2


def _critic() -> ValueModel:
    lm = tiny_llama(dtype=torch.float64)
    torch.manual_seed(1)
    return ValueModel(lm.get_decoder(), lm.config, head_std=0.02).double()


def _critic_batch():
    batch = loss_batch()
    g = torch.Generator().manual_seed(11)
    values = tuple(0.3 * torch.randn(len(m), generator=g, dtype=torch.float64) for m in batch.loss_masks)
    returns = tuple(v + 0.5 * torch.randn(len(v), generator=g, dtype=torch.float64) for v in values)
    return replace(batch, values=values, returns=returns)


def _loss_and_grads(mode: str, budget: int, num_ranks: int, keep_masked: bool = False) -> tuple[float, torch.Tensor]:
    batch = _critic_batch()
    critic = _critic()
    plan = plan_update(batch.rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                       groups=groups_of(len(batch.rollout), 2), mini_batch_prompts=4, num_epochs=1, num_ranks=num_ranks,
                       max_tokens=budget, balance=True, loss_scale_factor=24, keep_masked=keep_masked)
    minibatch = plan.minibatches[0]
    loss = sum(critic_microbatches(critic, batch, minibatch.microbatches(r), den=minibatch.denominators,
                                   context=contextlib.nullcontext, cliprange=CLIP, mode=mode,
                                   forward=PackForward("varlen", 1024, 1.0)).metrics["critic/vf_loss"]
               for r in range(num_ranks))
    return loss, torch.cat([p.grad.reshape(-1) for p in critic.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_and_grads_do_not_depend_on_micro_batches_or_ranks(mode):
    loss_ref, grad_ref = _loss_and_grads(mode, WHOLE, 1, keep_masked=True)
    assert grad_ref.abs().max() > 0 and loss_ref > 0
    for budget in (WHOLE, *BUDGETS):
        for num_ranks in (1, 2):
            loss, grads = _loss_and_grads(mode, budget, num_ranks)
            where = f"{mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=1e-9), where
            torch.testing.assert_close(grads, grad_ref, rtol=1e-6, atol=1e-12, msg=where)


@pytest.mark.parametrize("share", [False, True])
def test_packed_values_equal_each_sequence_alone(share):
    """The value pass (packed, shifted to the state before each response token, plus the value
    after the last token) equals a plain forward of each sequence alone."""
    batch = _critic_batch()
    critic = _critic()
    rollout = batch.rollout
    packed = compute_values(critic, rollout, [tuple(range(len(rollout)))], context=contextlib.nullcontext,
                            forward=PackForward("varlen", 1024, 1.0, share_prompts=share))
    for i, (values, bootstrap) in enumerate(packed):
        ids = torch.tensor([rollout.prompt_ids_of(i) + rollout.responses[i].response_ids])
        with torch.no_grad():
            alone = critic.value_head(critic.model(input_ids=ids).last_hidden_state[0]).squeeze(-1)
        p, r = len(rollout.prompt_ids_of(i)), len(rollout.responses[i].response_ids)
        torch.testing.assert_close(values.double(), alone[p - 1:p - 1 + r].float().double(), atol=1e-5, rtol=0)
        assert bootstrap == pytest.approx(float(alone[-1]), abs=1e-5)
