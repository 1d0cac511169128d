"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617; verl ``loss_mode=clip_cov|kl_cov``): entropy
collapse is driven by tokens whose log-prob and advantage co-vary strongly, so a small share of
those tokens has its update cut (Clip-Cov) or penalised (KL-Cov).

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``M`` loss tokens of a
mini-batch · ``K`` positions of a pack.

Token covariance, over the loss tokens of one mini-batch:

    cov_t = (A_t - mean A) * (logp_t - mean logp)

verl takes the means and the top-k / random pick over each micro-batch, so the tokens chosen
change with the micro-batch split and the rank count. Here the choice is made once per update on
the controller (`select_cov_tokens`, the losses' ``prepare``) over each WHOLE mini-batch (every
micro-batch, every rank) and travels to the workers as the per-token extra ``cov_selected``;
the loss is then the same whole, micro-batched or over ranks. It uses the old log-probs (the
old-log-prob pass runs for these losses): at the first mini-batch of an update the current policy
is pi_old, so they are verl's values there; later mini-batches and epochs keep that choice
instead of re-drawing it from the drifting policy. Clip-Cov's random pick is seeded by the step's
seed and the mini-batch index, so a rerun or a resumed run draws the same tokens.

- Clip-Cov: candidates are loss tokens with ``clip_cov_lb < cov < clip_cov_ub`` (verl also
  requires the PPO clip to be inactive; at selection time the ratio is 1, so no candidate is
  clipped); ``max(1, int(clip_cov_ratio * M))`` of them, drawn at random, get a zero loss
  (no gradient). The other tokens take the PPO clipped surrogate.
- KL-Cov: the ``max(1, int(kl_cov_ratio * M))`` tokens of largest cov (ties: earlier token) get
  ``-A r + ppo_kl_coef * |logp - old_logp|``; every other token ``-A r``, with no clipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from packrl.algos.losses import ppo_clip_loss
from packrl.algos.policy_losses import PolicyLossInputs, PolicyLossOutput
from packrl.config.schema import AlgorithmConfig
from packrl.registry import POLICY_LOSSES
from packrl.types import TrainBatch

SELECTED = "cov_selected"
"""The `packrl.types.TrainBatch.extras` key of the selected tokens (bool)."""
_LOG_RATIO_CLAMP = 20.0


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the given tokens.

    Args:
        advantages: Shape [M], float. logprobs: Shape [M], float, nats (the loss tokens only).

    Returns:
        Shape [M], float64.
    """
    a, lp = advantages.double(), logprobs.double()
    return (a - a.mean()) * (lp - lp.mean())


def pick_tokens(cov: torch.Tensor, loss: str, cfg: AlgorithmConfig, generator: torch.Generator) -> torch.Tensor:
    """Indices (into ``cov``, Shape [M]) of the tokens ``loss`` (``clip_cov`` or ``kl_cov``) selects:
    Clip-Cov draws ``max(1, int(clip_cov_ratio * M))`` at random among lb < cov < ub (with
    ``generator``); KL-Cov takes the ``max(1, int(kl_cov_ratio * M))`` largest (stable order).
    Returns Shape [k], int64 (k may be 0 for Clip-Cov without candidates)."""
    if cov.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if loss == "kl_cov":
        count = max(1, int(cov.numel() * cfg.kl_cov_ratio))
        return torch.argsort(-cov, stable=True)[:count]
    count = max(1, int(cov.numel() * cfg.clip_cov_ratio))
    candidates = torch.nonzero((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).reshape(-1)
    return candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]


def select_cov_tokens(batch: TrainBatch, minibatches: Sequence[Sequence[int]], cfg: AlgorithmConfig,
                      seed: int) -> tuple[TrainBatch, dict[str, float]]:
    """The ``prepare`` of ``clip_cov`` and ``kl_cov`` (`packrl.algos.policy_losses.PrepareFn`):
    per mini-batch, the covariance over all its loss tokens and the tokens selected.

    Args:
        batch: the batch the update trains, with old log-probs.
        minibatches: sequence indices of each mini-batch (`packrl.seqlen.update_plan.MinibatchPlan.sequences`).
        cfg: the ``algorithm`` section (``policy_loss`` and the Clip-Cov / KL-Cov keys).
        seed: the step's seed (Clip-Cov's random pick).

    Returns:
        ``(batch with extras["cov_selected"]: N x Shape [R_i] bool, metrics)``; metrics
        ``actor/cov_selected_fraction`` (selected / loss tokens, all mini-batches) and, for Clip-Cov,
        ``actor/cov_candidate_fraction`` (tokens within the bounds / loss tokens).

    Raises:
        ValueError: the batch has no old log-probs.
    """
    if batch.old_logprobs is None:
        raise ValueError(f"algorithm.policy_loss={cfg.policy_loss} selects tokens from the old log-probs, but the batch has "
                         "none; the old-log-prob pass must run (BatchPlan.needs_old_logprobs)")
    selected = [torch.zeros_like(m) for m in batch.loss_masks]
    num_tokens = num_selected = num_candidates = 0
    for k, indices in enumerate(minibatches):
        masks = [batch.loss_masks[i] for i in indices]
        cov = token_covariance(torch.cat([batch.advantages[i][m] for i, m in zip(indices, masks)]),
                               torch.cat([batch.old_logprobs[i][m] for i, m in zip(indices, masks)]))
        generator = torch.Generator().manual_seed((seed * 1_000_003 + k) % 2**63)
        picked = torch.zeros(cov.numel(), dtype=torch.bool)
        picked[pick_tokens(cov, cfg.policy_loss, cfg, generator)] = True
        offset = 0
        for i, m in zip(indices, masks):
            n = int(m.sum())
            selected[i][m] = picked[offset:offset + n]
            offset += n
        num_tokens += cov.numel()
        num_selected += int(picked.sum())
        num_candidates += int(((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).sum())
    metrics = {"actor/cov_selected_fraction": num_selected / max(1, num_tokens)}
    if cfg.policy_loss == "clip_cov":
        metrics["actor/cov_candidate_fraction"] = num_candidates / max(1, num_tokens)
    return replace(batch, extras={**batch.extras, SELECTED: tuple(selected)}), metrics


def _selected(inputs: PolicyLossInputs) -> torch.Tensor:
    chosen = inputs.extras.get(SELECTED)
    if chosen is None:
        raise ValueError(f"algorithm.policy_loss={inputs.cfg.policy_loss} needs the controller's token selection "
                         f"(PolicyLossInputs.extras[{SELECTED!r}]); run packrl.algos.policy_losses.prepare_update on the batch first")
    return chosen.bool() & inputs.loss_mask


@POLICY_LOSSES.register("clip_cov")
def clip_cov(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Clip-Cov: the PPO clipped surrogate (``clip_ratio_low|high``, no dual clip), with zero loss
    at the selected tokens (`select_cov_tokens`). ``clipped`` is True where the PPO clip is active
    or the token was selected (its gradient is cut either way)."""
    chosen = _selected(inputs)
    loss, clipped = ppo_clip_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages,
                                  clip_ratio_low=inputs.cfg.clip_ratio_low, clip_ratio_high=inputs.cfg.clip_ratio_high)
    return PolicyLossOutput(loss * (~chosen).to(loss.dtype), clipped | chosen)


@POLICY_LOSSES.register("kl_cov")
def kl_cov(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """KL-Cov: -A r on every token (no clip) plus ``ppo_kl_coef`` x |logp - old_logp| on the
    selected ones. Metric ``actor/kl_cov_penalty``: the penalty's token mean over the mini-batch."""
    chosen = _selected(inputs)
    diff = inputs.logprobs - inputs.old_logprobs
    pg = -inputs.advantages * torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    penalty = torch.where(chosen, inputs.cfg.ppo_kl_coef * diff.abs(), torch.zeros_like(diff))
    metrics: dict[str, torch.Tensor | float] = {
        "actor/kl_cov_penalty": inputs.denominators.token_share(penalty.detach(), inputs.loss_mask)}
    return PolicyLossOutput(pg + penalty, None, metrics)


clip_cov.prepare = select_cov_tokens  # type: ignore[attr-defined]
kl_cov.prepare = select_cov_tokens  # type: ignore[attr-defined]
