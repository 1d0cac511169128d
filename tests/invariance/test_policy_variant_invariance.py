"""Invariant 4 for the policy-loss family: GSPO, Clip-Cov, KL-Cov, truncated importance weights and dual-clip PPO
give the same mini-batch loss and gradient whole, micro-batched under two budgets and over two
simulated ranks, and that loss equals a direct computation over the whole mini-batch.

Clip-Cov / KL-Cov choose their tokens once per mini-batch on the controller
(`packrl.algos.policy_losses.prepare_update`); the worker path (`tests.conftest.minibatch_grads`,
the real micro-batch loop) only applies that choice. Float64 model, as in test_loss_invariance.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from packrl.algos.policy_losses import loss_options, prepare_update
from packrl.config.plan import BatchPlan
from packrl.seqlen.update_plan import groups_of, plan_update
from tests.builders import BUDGETS, RTOL, WHOLE, loss_batch, pass_config, stepwise_batch
from tests.conftest import minibatch_grads, score_of, tiny_llama

CASES = {  # the algorithm section of each case
    "gspo": dict(policy_loss="gspo", clip_ratio_low=0.01, clip_ratio_high=0.02),
    "clip_cov": dict(policy_loss="clip_cov", policy_loss_args=dict(clip_cov_ratio=0.1, clip_cov_lb=0.0)),
    "kl_cov": dict(policy_loss="kl_cov", policy_loss_args=dict(kl_cov_ratio=0.1, ppo_kl_coef=1.0)),
    "tis": dict(policy_loss="ppo_clip"),
    "dual_clip": dict(policy_loss="ppo_clip", policy_loss_args=dict(clip_ratio_c=1.1)),
}


def _cfg(case: str, mode: str, budget: int):
    return pass_config(batch_size=4, n=2, max_prompt_tokens=12, max_response_tokens=24, update_tokens=budget, loss_agg_mode=mode,
                       **(dict(clip_ratio_low=0.1, clip_ratio_high=0.1) | CASES[case]))


def _prepared(case: str, cfg):
    """The batch as the worker group hands it to the update: the loss's controller-side choice made
    over the whole mini-batch, or (``tis``) truncated importance weights as extras."""
    batch = loss_batch()
    if case == "tis":
        g = torch.Generator().manual_seed(5)
        weights = tuple((0.5 + torch.rand(len(m), generator=g)).clamp(max=1.2) for m in batch.loss_masks)
        return replace(batch, extras={"rollout_is_weights": weights})
    plan = plan_update(batch.rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                       groups=groups_of(len(batch.rollout), 2), mini_batch_prompts=BatchPlan.from_config(cfg).mini_batch_prompts,
                       num_epochs=1, num_ranks=1, max_tokens=WHOLE, balance=True, loss_scale_factor=24)
    return prepare_update(batch, [mb.sequences for mb in plan.minibatches], cfg.algorithm, seed=11)[0]


def _loss_and_grads(case: str, mode: str, budget: int, num_ranks: int) -> tuple[float, torch.Tensor]:
    cfg = _cfg(case, mode, budget)
    model = tiny_llama(dtype=torch.float64)
    loss = minibatch_grads(model, _prepared(case, _cfg(case, mode, WHOLE)), cfg, num_ranks=num_ranks)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_and_grads_do_not_depend_on_micro_batches_or_ranks(case, mode):
    loss_ref, grad_ref = _loss_and_grads(case, mode, WHOLE, 1)
    assert grad_ref.abs().max() > 0
    for budget in BUDGETS:
        for num_ranks in (1, 2):
            loss, grads = _loss_and_grads(case, mode, budget, num_ranks)
            where = f"{case}, {mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=RTOL), where
            torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=where)


def _reference_token_losses(case: str, cfg, batch, logprobs) -> list[list[float]]:
    """Every response's token losses from the formulas, over the whole mini-batch at once."""
    algo = cfg.algorithm
    opts = loss_options(algo)
    masks, adv, old = batch.loss_masks, batch.advantages, batch.old_logprobs
    flat = [(i, t) for i, m in enumerate(masks) for t in range(len(m)) if m[t]]
    out, bound = [], 0
    if case in ("clip_cov", "kl_cov"):  # the selection from the covariance over the whole mini-batch, by hand
        a = [float(adv[i][t]) for i, t in flat]
        lp = [float(old[i][t]) for i, t in flat]
        cov = [(x - sum(a) / len(a)) * (y - sum(lp) / len(lp)) for x, y in zip(a, lp)]
        if case == "kl_cov":
            k = max(1, int(len(cov) * opts.kl_cov_ratio))
            chosen = {flat[j] for j in sorted(range(len(cov)), key=lambda j: -cov[j])[:k]}
            assert chosen == {(i, t) for i, s in enumerate(batch.extras["cov_selected"]) for t in range(len(s)) if s[t]}
        else:
            chosen = {(i, t) for i, s in enumerate(batch.extras["cov_selected"]) for t in range(len(s)) if s[t]}
            assert all(opts.clip_cov_lb < cov[flat.index(p)] < opts.clip_cov_ub for p in chosen)
            assert len(chosen) == max(1, int(len(cov) * opts.clip_cov_ratio))
    for i, m in enumerate(masks):
        live = [t for t in range(len(m)) if m[t]]
        seq_ratio = math.exp(sum(float(logprobs[i][t] - old[i][t]) for t in live) / max(1, len(live)))
        row = []
        for t in range(len(m)):
            a, d = float(adv[i][t]), float(logprobs[i][t] - old[i][t])
            r = seq_ratio if case == "gspo" else math.exp(d)
            ppo = max(-a * r, -a * min(max(r, 1 - algo.clip_ratio_low), 1 + algo.clip_ratio_high))
            if case == "kl_cov":
                row.append(-a * r + (opts.ppo_kl_coef * abs(d) if (i, t) in chosen else 0.0))
            elif case == "clip_cov":
                row.append(0.0 if (i, t) in chosen else ppo)
            elif case == "tis":
                row.append(ppo * float(batch.extras["rollout_is_weights"][i][t]))
            elif case == "dual_clip":  # Ye et al. 2020: bounded by -c A where A < 0
                row.append(min(ppo, -a * opts.clip_ratio_c) if a < 0 else ppo)
                bound += a < 0 and r > opts.clip_ratio_c and bool(m[t])
            else:
                row.append(ppo)
        out.append(row)
    assert case != "dual_clip" or bound > 0, "the dual clip binds on no token of the batch: the case tests nothing"
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_is_the_formula_over_the_whole_mini_batch(case):
    cfg = _cfg(case, "seq-mean-token-mean", BUDGETS[0])
    batch = _prepared(case, _cfg(case, "seq-mean-token-mean", WHOLE))
    model = tiny_llama(dtype=torch.float64)
    logprobs, _ = score_of(model, batch.rollout, cfg)
    rows = _reference_token_losses(case, cfg, batch, logprobs)
    per_seq = [sum(v for v, keep in zip(row, m) if keep) / int(m.sum()) for row, m in zip(rows, batch.loss_masks) if m.any()]
    expected = sum(per_seq) / len(per_seq)
    loss = minibatch_grads(model, batch, cfg, num_ranks=2)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_step_wise_samples_carry_the_extras_sliced_like_the_loss_masks():
    """Under the rolling window the update trains step-wise samples: per-token extras (importance
    weights, a Clip-Cov / KL-Cov choice) are cut to each sample's stretch like the masks are."""
    from packrl.seqlen.stepwise import step_samples

    batch = stepwise_batch()
    weights = tuple(torch.arange(len(m), dtype=torch.float32) + 10 * i for i, m in enumerate(batch.loss_masks))
    samples = step_samples(batch.rollout).train_batch(replace(batch, extras={"rollout_is_weights": weights}))
    steps = step_samples(batch.rollout)
    assert len(samples.rollout) > len(batch.rollout)
    for k, (t, start) in enumerate(zip(steps.trajectory_of, steps.offsets)):
        n = len(samples.rollout.responses[k].response_ids)
        torch.testing.assert_close(samples.extras["rollout_is_weights"][k], weights[t][start:start + n])
