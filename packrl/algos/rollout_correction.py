"""Rollout correction: the engine that sampled a response is not exactly the policy being trained
(bf16 generation, other kernels), so the samples are slightly off-policy for the update
(``algorithm.rollout_correction``; verl's ``rollout_corr_helper``, after Liu, Li et al. 2025, "When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch", and Yao et
al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" for TIS).

Shapes: ``N`` responses · ``R_i`` response tokens of response i.

Two parts, both on the controller from the old-log-prob pass and the engine's log-probs, before the
update is planned:

- truncated importance sampling (``rollout_is=token``): w_t = min(exp(old_t - rollout_t), C)
  multiplies token t's policy loss (`weighted_token_loss`, applied by the worker to any loss);
- rejection (``rollout_rs=geometric``): a response whose geometric-mean ratio
  rho_i = exp(mean_t (old_t - rollout_t)) over its policy tokens lies outside [lower, upper]
  loses its loss tokens, so it leaves the loss and the denominators. The mean makes rho
  length-unbiased: with the same per-token ratios a long and a short response get the same
  decision, whereas a product of ratios (verl's ``sequence`` level) drifts away from 1 with length
  and rejects long responses more.

Log-ratios are clamped to +-20 before exp(), as verl bounds its weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from packrl.algos.filters import FilterInputs, FilterOutput
from packrl.config.algorithm_variants import RolloutCorrectionConfig
from packrl.registry import FILTERS
from packrl.types import Response

_LOG_RATIO_CLAMP = 20.0
IS_WEIGHTS = "rollout_is_weights"
BEHAVIOUR_STALE = "behaviour_stale"
"""The batch extra marking tokens of an earlier policy version whose behaviour weights the update
computes itself (`behaviour_weights_in_update`): bool per response token, True = stale."""
"""The `packrl.types.TrainBatch.extras` key of the token weights (verl's name)."""


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Truncated token importance weights w_t = min(exp(old_t - rollout_t), threshold).

    Args:
        old_logprobs: log pi_old per token. Shape [R], float32, nats.
        rollout_logprobs: the engine's log-prob per token. Shape [R], float32, nats.
        threshold: the truncation C (``rollout_is_threshold``).

    Returns:
        Shape [R], float32, in [exp(-20), threshold].
    """
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).clamp(max=threshold)


def geometric_mean_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, policy_mask: torch.Tensor) -> float | None:
    """rho = exp(mean over the policy tokens of (old_t - rollout_t)): the geometric mean of the
    token ratios, the statistic of ``rollout_rs=geometric``. Each token's log-ratio is clamped to
    +-20 before the mean, as verl's ``rollout_corr_helper`` does for its ``seq_mean_k1`` statistic
    (a clamp of the mean instead would decide otherwise for a response with a token beyond +-20).

    Args:
        old_logprobs, rollout_logprobs: Shape [R], float32, nats.
        policy_mask: True = a token the policy generated. Shape [R], bool.

    Returns:
        rho, or None for a response without policy tokens.
    """
    if not bool(policy_mask.any()):
        return None
    diff = (old_logprobs.double() - rollout_logprobs.double())[policy_mask].clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return float(torch.exp(diff.mean()))


def _engine_logprobs(responses: Sequence[Response]) -> tuple[torch.Tensor, ...]:
    missing = [i for i, r in enumerate(responses) if r.rollout_logprobs is None]
    if missing:
        raise ValueError(f"algorithm.rollout_correction needs the engine's log-probs, but responses {missing[:8]} have none "
                         "(Response.rollout_logprobs); use an engine that honours SamplingParams.return_logprobs "
                         "(rollout.engine=hf or vllm), or set algorithm.rollout_correction.rollout_is and rollout_rs to null")
    return tuple(torch.tensor(r.rollout_logprobs, dtype=torch.float32) for r in responses)


def apply_rollout_correction(
    responses: Sequence[Response],
    old_logprobs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor],
    cfg: RolloutCorrectionConfig,
) -> tuple[tuple[torch.Tensor, ...], dict[str, tuple[torch.Tensor, ...]], dict[str, float]]:
    """Rejection masks and truncated weights for one step's responses (nothing when off).

    Args:
        responses: the step's responses, with ``rollout_logprobs`` (``N``).
        old_logprobs: log pi_old per response, ``N`` x Shape [R_i], float32 nats (the old-log-prob
            pass, which runs whenever rollout correction is on).
        loss_masks: the loss masks so far, ``N`` x Shape [R_i], bool.
        cfg: ``algorithm.rollout_correction``.

    Returns:
        ``(loss_masks, extras, metrics)``: the masks with rejected responses all False; extras
        ``{"rollout_is_weights": N x Shape [R_i] float32}`` with ``rollout_is=token``; metrics
        ``rollout_corr/rollout_is_mean|max|min`` (over loss tokens after rejection),
        ``rollout_corr/rollout_rs_masked_fraction`` (rejected / responses with policy tokens),
        ``rollout_corr/rollout_rs_mean`` (mean rho), ``rollout_corr/geo_log_ratio_mean`` (mean log
        rho = mean over responses of mean_t(old - rollout), nats), ``seqlen/masked_tokens/rollout_rs`` and
        ``seqlen/masked_sequences/rollout_rs``.

    Raises:
        ValueError: a response without engine log-probs, or no old log-probs.
    """
    masks = tuple(loss_masks)
    if not cfg.enabled:
        return masks, {}, {}
    if old_logprobs is None:
        raise ValueError("algorithm.rollout_correction needs the old log-probs (the old-log-prob pass); "
                         "BatchPlan.needs_old_logprobs turns it on with rollout correction")
    engine = _engine_logprobs(responses)
    policy = [r.generated_mask() for r in responses]
    rhos = [geometric_mean_ratio(old, eng, p) for old, eng, p in zip(old_logprobs, engine, policy)]
    measured = [rho for rho in rhos if rho is not None]
    metrics: dict[str, float] = {}
    if measured:
        metrics["rollout_corr/rollout_rs_mean"] = sum(measured) / len(measured)
        metrics["rollout_corr/geo_log_ratio_mean"] = sum(math.log(rho) for rho in measured) / len(measured)
    if cfg.rollout_rs is not None:
        lower, upper = cfg.rs_bounds
        rejected = [rho is not None and not lower <= rho <= upper for rho in rhos]
        removed = sum(int(m.sum()) for m, r in zip(masks, rejected) if r)
        masks = tuple(m & ~torch.tensor(r) for m, r in zip(masks, rejected))
        metrics["rollout_corr/rollout_rs_masked_fraction"] = sum(rejected) / max(1, len(measured))
        metrics["seqlen/masked_tokens/rollout_rs"] = float(removed)
        metrics["seqlen/masked_sequences/rollout_rs"] = float(sum(rejected))
    extras: dict[str, tuple[torch.Tensor, ...]] = {}
    if cfg.rollout_is is not None:
        weights = tuple(rollout_is_weights(old, eng, cfg.rollout_is_threshold) for old, eng in zip(old_logprobs, engine))
        extras[IS_WEIGHTS] = weights
        kept = torch.cat([w[m] for w, m in zip(weights, masks)]) if weights else torch.zeros(0)
        if kept.numel():
            metrics |= {"rollout_corr/rollout_is_mean": float(kept.mean()), "rollout_corr/rollout_is_max": float(kept.max()),
                        "rollout_corr/rollout_is_min": float(kept.min())}
    return masks, extras, metrics


def apply_behaviour_weights(
    responses: Sequence[Response],
    old_logprobs: Sequence[torch.Tensor] | None,
    loss_masks: Sequence[torch.Tensor],
    extras: dict[str, tuple[torch.Tensor, ...]],
    policy_version: int | None,
    threshold: float,
) -> tuple[dict[str, tuple[torch.Tensor, ...]], dict[str, float]]:
    """The behaviour half of decoupled PPO (Fu et al. 2025, AReaL, arXiv 2505.24298) for tokens an
    earlier policy version sampled (`Response.token_versions` < ``policy_version``: a partial
    rollout carried across steps): their loss is the PPO clip against the proximal policy pi_old
    (this step's weights before the update) times w_t = min(pi_old / pi_behaviour, C), with
    pi_behaviour the engine's log-prob at sampling and C ``rollout_is_threshold``.

    With an old-log-prob pass (``old_logprobs``: the update takes several optimizer steps, or
    another setting reads them) the weights are computed here. Without one the update is a single
    on-policy step, whose forward is pi_old itself: the stale tokens are marked
    (``extras["behaviour_stale"]``) and the update weighs them from its own log-probs, detached
    (`behaviour_weights_in_update`), saving the pass.

    Tokens of this step's policy keep weight 1, so a batch with nothing carried trains exactly as
    without partial rollouts; with ``rollout_is=token`` every token is weighted already
    (`apply_rollout_correction`) and nothing is added.

    Returns:
        ``(extras, metrics)``: ``rollout_is_weights`` (or ``behaviour_stale``) set when some loss
        token is stale; metrics ``async/stale_token_fraction`` (stale / loss tokens) and, with the
        pass, ``async/behaviour_weight_mean|max|min`` over the stale loss tokens (without it the
        update reports the mean).

    Raises:
        ValueError: stale tokens without engine log-probs.
    """
    if policy_version is None:
        return extras, {}
    stale = tuple(torch.zeros(len(r.response_ids), dtype=torch.bool) if r.token_versions is None
                  else torch.tensor(r.token_versions) < policy_version for r in responses)
    num_loss = sum(int(m.sum()) for m in loss_masks)
    num_stale = sum(int((s & m).sum()) for s, m in zip(stale, loss_masks))
    metrics = {"async/stale_token_fraction": num_stale / max(1, num_loss)}
    if num_stale == 0 or IS_WEIGHTS in extras:
        return extras, metrics
    engine = _engine_logprobs(responses)
    if old_logprobs is None:
        return {**extras, BEHAVIOUR_STALE: stale}, metrics
    weights = tuple(torch.where(s, rollout_is_weights(old, eng, threshold), torch.ones(len(s)))
                    for s, old, eng in zip(stale, old_logprobs, engine))
    picked = torch.cat([w[s & m] for w, s, m in zip(weights, stale, loss_masks)])
    metrics |= {"async/behaviour_weight_mean": float(picked.mean()), "async/behaviour_weight_max": float(picked.max()),
                "async/behaviour_weight_min": float(picked.min())}
    return {**extras, IS_WEIGHTS: weights}, metrics


def behaviour_weights_in_update(extras: dict[str, torch.Tensor], logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                                loss_mask: torch.Tensor, threshold: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`apply_behaviour_weights` without an old-log-prob pass: the stale tokens' weights
    min(pi_old / pi_behaviour, C) with pi_old the update's own log-probs, detached (a single
    on-policy optimizer step: the policy before it is the proximal policy). Nothing when the
    batch marks no stale token.

    Args:
        extras: the batch's extras over the pack, Shape [K] each; ``behaviour_stale`` (bool) is
            replaced by ``rollout_is_weights`` (float32, 1 at tokens of this step's policy).
        logprobs: the update's log-probs, Shape [K], float32, nats.
        rollout_logprobs: the engine's log-probs over the pack, Shape [K] (None: none returned).
        loss_mask: True = a loss token, Shape [K].
        threshold: C, ``rollout_is_threshold``.

    Returns:
        ``(extras, sums)``: sums ``async/behaviour_weight_sum`` and ``async/behaviour_stale_tokens``
        over the stale loss tokens (their ratio is ``async/behaviour_weight_mean``).

    Raises:
        ValueError: stale tokens marked but no engine log-probs.
    """
    stale = extras.get(BEHAVIOUR_STALE)
    if stale is None:
        return extras, {}
    if rollout_logprobs is None:
        raise ValueError("stale tokens need the engine's log-probs (rollout.return_logprobs); the async modes turn them on")
    stale = stale.bool()
    ratio = rollout_is_weights(logprobs.detach(), rollout_logprobs, threshold)
    weights = torch.where(stale, ratio, torch.ones_like(ratio))
    kept = stale & loss_mask
    out = {k: v for k, v in extras.items() if k != BEHAVIOUR_STALE} | {IS_WEIGHTS: weights}
    return out, {"async/behaviour_weight_sum": (weights * kept).sum(), "async/behaviour_stale_tokens": kept.sum().float()}


def weighted_token_loss(token_loss: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """The policy's token loss times the truncated importance weights when the controller set
    them (``extras["rollout_is_weights"]``, Shape [K]); else unchanged. The weights are constants
    (no gradient), as in verl's decoupled mode. Shape [K]."""
    weights = extras.get(IS_WEIGHTS)
    return token_loss if weights is None else token_loss * weights.to(token_loss.dtype)


@FILTERS.register("rollout_correction")
def rollout_correction(inputs: FilterInputs) -> FilterOutput:
    """The loss filter of ``algorithm.rollout_correction`` (in every run's chain, its settings that
    section's: `packrl.capabilities.FilterInfo.settings_key`): rejection (`apply_rollout_correction`),
    then the importance weights and the behaviour weights of tokens carried from earlier steps
    (`apply_behaviour_weights`) as extras; nothing when off and nothing is carried."""
    cfg: RolloutCorrectionConfig = inputs.options
    scored = inputs.scored
    responses = scored.rollout.responses
    masks, extras, metrics = apply_rollout_correction(responses, inputs.old_logprobs, inputs.masks, cfg)
    extras, stale_metrics = apply_behaviour_weights(responses, inputs.old_logprobs, masks, extras, scored.rollout.policy_version,
                                                    cfg.rollout_is_threshold)
    keep = tuple(bool(after.any()) or not bool(before.any()) for before, after in zip(inputs.masks, masks))
    return FilterOutput(keep=keep, metrics=metrics | stale_metrics, extras=extras)
