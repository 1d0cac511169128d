"""The advantage stage: rewards (optionally KL-shaped) -> filters -> advantages -> loss masks -> `TrainBatch`.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from packrl.algos.advantages import AdvantageInputs, check_advantages, token_rewards_of
from packrl.algos.filters import FilterInputs, filter_chain, kept_for_advantages, run_filters
from packrl.algos.gae import gae_of
from packrl.algos.losses import kl_penalty
from packrl.config.schema import AlgorithmConfig
from packrl.registry import ADVANTAGE_ESTIMATORS
from packrl.types import ScoredBatch, TrainBatch, ValueEstimates


def loss_masks(scored: ScoredBatch, truncated: str) -> tuple[torch.Tensor, ...]:
    """True = the response token counts in the loss: a token the policy generated
    (`Response.response_mask`) of a response the truncation policy keeps. ``truncated="mask"``
    gives responses cut by a budget (finish reason ``length``/``context``) no loss tokens at all.
    ``N`` x Shape [R_i], bool."""
    out = []
    for r in scored.rollout.responses:
        keep = not (truncated == "mask" and r.truncated)
        out.append(r.generated_mask() & keep)
    return tuple(out)


def build_train_batch(scored: ScoredBatch, old_logprobs: tuple[torch.Tensor, ...] | None, ref_logprobs: tuple[torch.Tensor, ...] | None,
                      cfg: AlgorithmConfig, values: ValueEstimates | None = None, *,
                      old_entropy: tuple[torch.Tensor, ...] | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """The batch the update consumes: 1. the rewards with in-reward KL (`kl_shaped_rewards`) and the
    truncation policy's loss masks (`loss_masks`); 2. the advantage filters (GFPO) choose the
    responses ``algorithm.adv_estimator`` sees, the same number per group (`packrl.algos.filters`;
    the others get advantage 0 and no loss tokens); 3. the advantages, with the critic's ``values``
    its GAE returns; 4. the loss filters (rollout correction, entropy; ``old_entropy``: the
    old-log-prob pass's, ``N`` x Shape [R_i] float32 nats) take responses out of the loss and may
    add per-token extras.

    ``old_logprobs`` is None when the update is on-policy. ``batch.filtered`` names, per response,
    the filter that took it out of the loss. Metrics: ``seqlen/masked_tokens/truncated``,
    `kl_shaped_rewards`'s, `value_metrics` and each filter's (``filter/<name>/dropped``, its own).

    Raises:
        ValueError: an unknown estimator, one that does not return one value per response token, or
            a filter's missing inputs (engine log-probs, old log-probs, entropy).
    """
    generated = tuple(r.generated_mask() for r in scored.rollout.responses)
    rewards, penalties, metrics = kl_shaped_rewards(scored, old_logprobs, ref_logprobs, generated, cfg)  # 1
    shaped = replace(scored, rewards=rewards)
    inputs = AdvantageInputs(scored=scored, rewards=rewards, token_rewards=token_rewards_of(scored.rewards, generated, penalties),
                             response_masks=generated, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, cfg=cfg,
                             values=None if values is None else values.values,
                             bootstrap_values=None if values is None else values.bootstrap)
    masks = loss_masks(scored, cfg.truncated)
    metrics["seqlen/masked_tokens/truncated"] = float(sum(int((g & ~m).sum()) for g, m in zip(generated, masks)))
    chosen = kept_for_advantages(filter_chain(cfg, "advantages"), FilterInputs(shaped, masks, old_logprobs, old_entropy))  # 2
    advantages = estimate(inputs, [i for i, keep in enumerate(chosen.keep) if keep])  # 3
    returns = None if values is None else gae_of(inputs)[1]
    if values is not None and returns is not None:
        metrics |= value_metrics(values.values, returns, generated)
    after = run_filters(filter_chain(cfg, "loss"), FilterInputs(shaped, chosen.masks, old_logprobs, old_entropy))  # 4
    by = tuple(a or b for a, b in zip(chosen.filtered_by, after.filtered_by))
    batch = TrainBatch(shaped, advantages, after.masks, old_logprobs, ref_logprobs, values=inputs.values, returns=returns,
                       extras=after.extras, filtered=by if any(by) else None)
    return batch, metrics | chosen.metrics | after.metrics


def kl_shaped_rewards(scored: ScoredBatch, old_logprobs: tuple[torch.Tensor, ...] | None, ref_logprobs: tuple[torch.Tensor, ...] | None,
                      generated: tuple[torch.Tensor, ...], cfg: AlgorithmConfig
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, dict[str, float]]:
    """The rewards after in-reward KL, the per-token penalties and their metrics.

    With ``algorithm.kl_in_reward`` and a reference model, every token t the policy generated gets
    the reward ``-kl_coef x KL_t`` (KL of the old to the reference log-probs, ``algorithm.kl_estimator``)
    and the response's reward sits on its last policy token, as verl's ``apply_kl_penalty`` builds
    ``token_level_rewards``: token-level estimators (GAE, REINFORCE++) read these token rewards,
    outcome estimators (GRPO, RLOO) the response's reward ``r - kl_coef x sum_t KL_t``.

    Returns:
        ``(rewards Shape [N] float32, penalties N x Shape [R_i] or None, metrics)``: with in-reward
        KL ``critic/kl_in_reward/mean`` (the mean over responses of sum_t KL_t) and verl's
        ``actor/reward_kl_penalty`` (of mean_t KL_t) and ``actor/reward_kl_penalty_coeff``.
    """
    if not (cfg.kl_in_reward and ref_logprobs is not None):
        return scored.rewards.clone(), None, {}
    assert old_logprobs is not None, "in-reward KL needs the old log-probs"
    token_kl = tuple(torch.where(g, kl_penalty(old, ref, cfg.kl_estimator), 0.0)  # the policy's tokens only, not tool answers
                     for old, ref, g in zip(old_logprobs, ref_logprobs, generated))
    seq_kl = torch.stack([kl.sum() for kl in token_kl])
    seq_mean_kl = [float(kl.sum() / g.sum()) for kl, g in zip(token_kl, generated) if g.any()]
    metrics = {"critic/kl_in_reward/mean": seq_kl.mean().item(),
               "actor/reward_kl_penalty": sum(seq_mean_kl) / max(len(seq_mean_kl), 1), "actor/reward_kl_penalty_coeff": cfg.kl_coef}
    return scored.rewards - cfg.kl_coef * seq_kl, tuple(cfg.kl_coef * kl for kl in token_kl), metrics


def estimate(inputs: AdvantageInputs, kept: list[int]) -> tuple[torch.Tensor, ...]:
    """``algorithm.adv_estimator`` on the responses ``kept`` (each group's, the advantage filters';
    all of them without one), the others' advantages 0. ``N`` tensors of Shape [R_i], float32."""
    estimator = ADVANTAGE_ESTIMATORS.lookup(inputs.cfg.adv_estimator)
    responses = inputs.scored.rollout.responses
    if len(kept) == len(responses):
        return check_advantages(estimator(inputs), inputs)
    subset = _subset(inputs, kept)
    out = [torch.zeros(len(r.response_ids)) for r in responses]
    for j, advantage in zip(kept, check_advantages(estimator(subset), subset)):
        out[j] = advantage
    return tuple(out)


def _subset(inputs: AdvantageInputs, kept: list[int]) -> AdvantageInputs:
    """``inputs`` of the responses ``kept`` alone: ``k`` per group (a group size of ``k``)."""
    scored, rollout = inputs.scored, inputs.scored.rollout
    index = torch.tensor(kept, dtype=torch.long)

    def pick(values: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        return None if values is None else tuple(values[i] for i in kept)

    sub = replace(rollout, group_size=len(kept) // len(rollout.prompts), responses=tuple(rollout.responses[i] for i in kept))
    sub_scored = scored.indexed(sub, index)
    return replace(inputs, scored=sub_scored, rewards=inputs.rewards[index], token_rewards=tuple(inputs.token_rewards[i] for i in kept),
                   response_masks=tuple(inputs.response_masks[i] for i in kept), old_logprobs=pick(inputs.old_logprobs),
                   ref_logprobs=pick(inputs.ref_logprobs), values=pick(inputs.values),
                   bootstrap_values=None if inputs.bootstrap_values is None else inputs.bootstrap_values[index])


def value_metrics(values: tuple[torch.Tensor, ...], returns: tuple[torch.Tensor, ...],
                  masks: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """``critic/values/mean|max|min``, ``critic/returns/mean|max|min`` and
    ``critic/vf_explained_var`` = 1 - Var(returns - values) / Var(returns) over the policy's
    tokens (verl's names and formula, ``metric_utils.compute_data_metrics``)."""
    v = torch.cat([x[m] for x, m in zip(values, masks)]) if values else torch.zeros(0)
    r = torch.cat([x[m] for x, m in zip(returns, masks)]) if returns else torch.zeros(0)
    if v.numel() == 0:
        return {}
    out: dict[str, float] = {}
    for name, x in (("values", v), ("returns", r)):
        out |= {f"critic/{name}/mean": float(x.mean()), f"critic/{name}/max": float(x.max()), f"critic/{name}/min": float(x.min())}
    if r.numel() > 1:
        out["critic/vf_explained_var"] = 1.0 - float((r - v).var()) / (float(r.var()) + 1e-5)
    return out
