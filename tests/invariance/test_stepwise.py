"""Step-wise samples (the rolling context window, `packrl.seqlen.stepwise`) join invariant 4: a
rollout whose trajectories dropped turns trains each turn in exactly the context it was generated
from, with every loss aggregation mode weighing a trajectory as one sequence, and the loss and
gradient do not depend on how the samples are split into micro-batches or ranks.

The reference is computed by hand: every sample scored by a plain unpacked forward of its own
context + stretch, the on-policy token loss ``-A * exp(lp - sg(lp))`` (its gradient is the policy
gradient ``-A * grad lp``) aggregated per trajectory with the mode's formula. Float64, as the other
loss-invariance tests.
"""

from __future__ import annotations

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES
from packrl.seqlen.stepwise import step_samples
from packrl.types import Response, RolloutBatch, Trajectory
from tests.builders import pass_config, stepwise_batch
from tests.conftest import minibatch_grads, tiny_llama

C = 24  # algorithm.loss_scale_factor


def _cfg(mode: str, budget: int):
    return pass_config(batch_size=2, n=2, max_prompt_tokens=9, max_response_tokens=15, update_tokens=budget, loss_agg_mode=mode,
                       kl_coef=0.0, entropy_coeff=0.0, loss_scale_factor=C if mode == "seq-mean-token-sum-norm" else None)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _reference(mode: str) -> torch.Tensor:
    """The gradient by hand: each sample alone, per-trajectory aggregation."""
    batch = stepwise_batch()
    steps = step_samples(batch.rollout)
    trained = steps.train_batch(batch)
    model = tiny_llama(dtype=torch.float64)
    per_trajectory: dict[int, torch.Tensor] = {}
    counts = [int(m.sum()) for m in batch.loss_masks]
    for s, t in enumerate(steps.trajectory_of):
        context, stretch = steps.rollout.prompts.prompt_ids[s], steps.rollout.responses[s].response_ids
        ids = torch.tensor([context + stretch])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        lp = logp[len(context) - 1:-1].gather(-1, ids[0, len(context):, None])[:, 0]
        token_loss = -trained.advantages[s] * torch.exp(lp - lp.detach())
        total = token_loss[trained.loss_masks[s]].sum()
        per_trajectory[t] = per_trajectory.get(t, 0.0) + total
    num_tokens, num_seqs = sum(counts), sum(c > 0 for c in counts)
    if mode == "token-mean":
        loss = sum(per_trajectory.values()) / num_tokens
    elif mode == "seq-mean-token-mean":
        loss = sum(v / counts[t] for t, v in per_trajectory.items()) / num_seqs
    elif mode == "seq-mean-token-sum":
        loss = sum(per_trajectory.values()) / num_seqs
    else:
        loss = sum(per_trajectory.values()) / (num_seqs * C)
    loss.backward()
    return _grads(model)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_step_wise_samples_train_each_turn_in_its_context_however_split(mode):
    batch = stepwise_batch()
    steps = step_samples(batch.rollout)
    assert steps is not None and steps.trajectory_of == (0, 0, 1, 2, 3, 3, 3)
    trained = steps.train_batch(batch)
    assert trained.trajectory_loss_tokens == tuple(int(batch.loss_masks[t].sum()) for t in steps.trajectory_of)
    reference = _reference(mode)
    assert reference.abs().max() > 0
    longest = max(trained.rollout.sequence_lengths())
    assert longest == 24 < max(batch.rollout.sequence_lengths())  # samples fit budgets whole trajectories do not
    for budget in (4096, longest, longest + 7):
        for num_ranks in (1, 2):
            model = tiny_llama(dtype=torch.float64)
            minibatch_grads(model, trained, _cfg(mode, budget), num_ranks=num_ranks, groups=list(steps.prompt_of),
                            units=list(steps.trajectory_of))
            torch.testing.assert_close(_grads(model), reference, rtol=1e-6, atol=1e-12,
                                       msg=f"{mode}: budget {budget}, {num_ranks} rank(s)")


def test_trajectories_without_dropped_turns_are_trained_as_they_are():
    batch = stepwise_batch()
    plain = RolloutBatch(batch.rollout.prompts, 2, (batch.rollout.responses[1], batch.rollout.responses[2]) * 2)
    assert step_samples(plain) is None


def test_stitched_values_land_on_each_samples_stretch_and_zero_elsewhere():
    batch = stepwise_batch()
    steps = step_samples(batch.rollout)
    values = [torch.full((len(r.response_ids),), float(s + 1)) for s, r in enumerate(steps.rollout.responses)]
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    stitched = steps.stitch(values, lengths)
    for t, r in enumerate(batch.rollout.responses):
        assert stitched[t].shape == (len(r.response_ids),)
        mask = r.generated_mask()
        assert bool((stitched[t][mask] > 0).all())  # every policy token got its sample's value
    # trajectory 0: turns 1-2 are sample 1, turn 3 is sample 2; the tool answer before turn 3 is in no sample
    spans = batch.rollout.responses[0].trajectory.turn_spans()
    assert set(stitched[0][: spans[1][1]].tolist()) == {1.0}
    assert set(stitched[0][spans[1][1]: spans[2][0]].tolist()) == {0.0} and set(stitched[0][spans[2][0]:].tolist()) == {2.0}
    folded = steps.fold(torch.ones(len(steps.trajectory_of), dtype=torch.float64))
    assert folded.tolist() == [2.0, 1.0, 1.0, 3.0]


def test_context_starts_must_fit_the_turns():
    with pytest.raises(ValueError, match="context_starts"):
        Response((1, 2, 3), "eos", None, (True, False, True),
                 trajectory=Trajectory((("assistant", 1), ("tool", 1), ("assistant", 1)), context_starts=(0, 3)))
