"""The advantage stage: rewards (optionally KL-shaped) -> advantages, loss masks -> `TrainBatch`.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from packrl.algos.advantages import AdvantageInputs, check_advantages, token_rewards_of
from packrl.algos.entropy_filter import apply_entropy_filter
from packrl.algos.gae import gae_of
from packrl.algos.group_filter import filter_metrics, kept_indices
from packrl.algos.losses import kl_penalty
from packrl.algos.rollout_correction import apply_behaviour_weights, apply_rollout_correction
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


def build_train_batch(
    scored: ScoredBatch,
    old_logprobs: tuple[torch.Tensor, ...] | None,
    ref_logprobs: tuple[torch.Tensor, ...] | None,
    cfg: AlgorithmConfig,
    values: ValueEstimates | None = None,
    *,
    old_entropy: tuple[torch.Tensor, ...] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages for every response token (``algorithm.adv_estimator``, looked up in
    `packrl.registry.ADVANTAGE_ESTIMATORS`) and the batch the update consumes.

    With ``algorithm.kl_in_reward`` and a reference model, every token t the policy generated gets
    the reward ``-kl_coef x KL_t`` (KL of the old to the reference log-probs, ``algorithm.kl_estimator``)
    and the response's reward sits on its last policy token, as verl's ``apply_kl_penalty`` builds
    ``token_level_rewards``: token-level estimators (GAE, REINFORCE++) read these token rewards,
    outcome estimators (GRPO, RLOO) the response's reward ``r - kl_coef x sum_t KL_t``.
    ``old_logprobs`` is None when the update is on-policy (`packrl.config.plan.BatchPlan`). The
    batch's ``scored.rewards`` are the rewards the advantages were computed from (KL-shaped if asked).

    With the critic's ``values`` (PPO with a critic) the estimator may read them, and the batch
    carries them with the critic's targets, the GAE returns (`packrl.algos.gae`).

    With ``algorithm.group_filter`` (GFPO) the estimator sees each group's kept responses alone
    (`packrl.algos.group_filter`); the others get advantage 0 and no loss tokens (the update
    plan leaves such sequences out of its micro-batches). After the
    truncation policy, `response_filters` may take whole responses out of the loss
    (rollout-correction rejection, the entropy filter; ``old_entropy``: the old-log-prob pass's
    entropy, ``N`` x Shape [R_i] float32 nats) and add per-token extras for the loss.

    Returns:
        ``(batch, metrics)``; metrics hold ``seqlen/masked_tokens/truncated`` (loss tokens removed
        by ``algorithm.truncated=mask``), with in-reward KL ``critic/kl_in_reward/mean`` (the
        mean over responses of sum_t KL_t) and verl's ``actor/reward_kl_penalty`` (of mean_t KL_t)
        and ``actor/reward_kl_penalty_coeff``,
        with values `value_metrics`, with GFPO `filter_metrics`, and those of `response_filters`.

    Raises:
        ValueError: an unknown estimator, or one that does not return one value per response token.
    """
    rewards = scored.rewards.clone()
    metrics: dict[str, float] = {}
    generated = tuple(r.generated_mask() for r in scored.rollout.responses)
    penalties = None
    if cfg.kl_in_reward and ref_logprobs is not None:
        assert old_logprobs is not None, "in-reward KL needs the old log-probs"
        token_kl = tuple(torch.where(g, kl_penalty(old, ref, cfg.kl_estimator), 0.0)  # the policy's tokens only, not tool answers
                         for old, ref, g in zip(old_logprobs, ref_logprobs, generated))
        penalties = tuple(cfg.kl_coef * kl for kl in token_kl)
        seq_kl = torch.stack([kl.sum() for kl in token_kl])
        rewards = rewards - cfg.kl_coef * seq_kl
        metrics["critic/kl_in_reward/mean"] = seq_kl.mean().item()
        seq_mean_kl = [float(kl.sum() / g.sum()) for kl, g in zip(token_kl, generated) if g.any()]
        metrics["actor/reward_kl_penalty"] = sum(seq_mean_kl) / max(len(seq_mean_kl), 1)
        metrics["actor/reward_kl_penalty_coeff"] = cfg.kl_coef
    token_rewards = token_rewards_of(scored.rewards, generated, penalties)
    critic_values = None if values is None else values.values
    inputs = AdvantageInputs(scored=scored, rewards=rewards, token_rewards=token_rewards, response_masks=generated,
                             old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, cfg=cfg, values=critic_values,
                             bootstrap_values=None if values is None else values.bootstrap)
    kept = kept_indices(replace(scored, rewards=rewards), cfg.group_filter)
    advantages = estimate(inputs, kept)
    returns: tuple[torch.Tensor, ...] | None = None
    if values is not None:
        returns = gae_of(inputs)[1]
        metrics |= value_metrics(values.values, returns, generated)
    masks = loss_masks(scored, cfg.truncated)
    metrics["seqlen/masked_tokens/truncated"] = float(sum(int((g & ~m).sum()) for g, m in zip(generated, masks)))
    filtered: tuple[bool, ...] | None = None
    if cfg.group_filter.keep is not None:
        keep = set(kept)
        filtered = tuple(i not in keep for i in range(len(masks)))
        masks = tuple(m & (not out) for m, out in zip(masks, filtered))
        metrics |= filter_metrics(scored, kept)
    masks, extras, other_metrics = response_filters(scored, old_logprobs, old_entropy, masks, cfg)
    batch = TrainBatch(replace(scored, rewards=rewards), advantages, masks, old_logprobs, ref_logprobs,
                       values=critic_values, returns=returns, extras=extras, filtered=filtered)
    return batch, metrics | other_metrics


def estimate(inputs: AdvantageInputs, kept: list[int]) -> tuple[torch.Tensor, ...]:
    """``algorithm.adv_estimator`` on the responses ``kept`` (each group's, `packrl.algos.group_filter`;
    all of them without GFPO), the others' advantages 0. ``N`` tensors of Shape [R_i], float32."""
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


def response_filters(scored: ScoredBatch, old_logprobs: tuple[torch.Tensor, ...] | None, old_entropy: tuple[torch.Tensor, ...] | None,
                     masks: tuple[torch.Tensor, ...], cfg: AlgorithmConfig) -> tuple[tuple[torch.Tensor, ...], dict, dict[str, float]]:
    """Loss masks after ``algorithm.rollout_correction`` (rejection; token weights as extras,
    `packrl.algos.rollout_correction`; behaviour weights of tokens carried from earlier steps,
    `apply_behaviour_weights`) and then ``algorithm.entropy_filter``
    (`packrl.algos.entropy_filter`), on the controller before the update plan counts the
    denominators; each is a no-op when off. Returns ``(masks, extras, metrics)``.

    Raises:
        ValueError: a filter is on but its inputs (engine log-probs, old log-probs, entropy) are missing.
    """
    responses = scored.rollout.responses
    masks, extras, metrics = apply_rollout_correction(responses, old_logprobs, masks, cfg.rollout_correction)
    extras, stale_metrics = apply_behaviour_weights(responses, old_logprobs, masks, extras, scored.rollout.policy_version,
                                                    cfg.rollout_correction.rollout_is_threshold)
    metrics |= stale_metrics
    masks, entropy_metrics = apply_entropy_filter(old_entropy, [r.generated_mask() for r in responses], masks, cfg.entropy_filter)
    return masks, extras, metrics | entropy_metrics


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
