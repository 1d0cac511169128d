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
the controller (`select_cov_tokens`, the ``prepare`` both losses declare with
`packrl.capabilities.COV_LOSS`) over each WHOLE mini-batch (every micro-batch, every rank) and
travels to the workers as the per-token extra ``cov_selected``; the loss is then the same whole,
micro-batched or over ranks. It uses the old log-probs (the losses declare them read, so the
old-log-prob pass runs for them): at the first mini-batch of an update the current policy
is pi_old, so they are verl's values there; later mini-batches and epochs keep that choice
instead of re-drawing it from the drifting policy. Clip-Cov's random pick is seeded by the step's
seed and the mini-batch index, so a rerun or a resumed run draws the same tokens.

Their knobs (`ClipCovOptions`, `KlCovOptions`) are set under ``algorithm.policy_loss_args``.
Log-ratios are clamped to +-20 before exp() as in ``ppo_clip``; verl clamps them in its vanilla
loss but not in Clip-Cov or KL-Cov, so the two differ only where |log r| > 20 (where verl's
ratio is e^20 or more, or overflows).

- Clip-Cov: candidates are loss tokens with ``clip_cov_lb < cov < clip_cov_ub`` (verl also
  requires the PPO clip to be inactive; at selection time the ratio is 1, so no candidate is
  clipped); ``max(1, int(clip_cov_ratio * M))`` of them, drawn at random, get a zero loss
  (no gradient). The other tokens take the PPO clipped surrogate.
- KL-Cov: the ``max(1, int(kl_cov_ratio * M))`` tokens of largest cov (ties: earlier token) get
  ``-A r + ppo_kl_coef * |logp - old_logp|``; every other token ``-A r``, with no clipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from packrl.algos.losses import ppo_clip_loss
from packrl.algos.policy_losses import PolicyLossInputs, PolicyLossOutput, loss_options
from packrl.capabilities import COV_LOSS
from packrl.config.schema import AlgorithmConfig
from packrl.errors import ConfigProblem
from packrl.registry import POLICY_LOSSES
from packrl.types import TrainBatch

SELECTED = "cov_selected"
"""The `packrl.types.TrainBatch.extras` key of the selected tokens (bool)."""
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipCovOptions:
    """Clip-Cov's knobs (``algorithm.policy_loss_args`` with ``policy_loss=clip_cov``; verl's
    ``actor.policy_loss.*`` names and defaults)."""

    clip_cov_ratio: float = 0.0002
    """Share of a mini-batch's loss tokens whose gradient is cut, drawn among the candidates."""

    clip_cov_lb: float = 1.0
    """Lower bound of a candidate's token covariance (A - mean A)(logp - mean logp)."""

    clip_cov_ub: float = 5.0
    """Upper bound of a candidate's token covariance."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = _share_problems(f"{prefix}.clip_cov_ratio", self.clip_cov_ratio)
        if not -math.inf < self.clip_cov_lb < self.clip_cov_ub < math.inf:
            out.append(ConfigProblem(f"{prefix}.clip_cov_lb", self.clip_cov_lb,
                                     f"must be finite and < {prefix}.clip_cov_ub={self.clip_cov_ub}",
                                     f"set {prefix}.clip_cov_lb=1.0 and {prefix}.clip_cov_ub=5.0",
                                     keys=(f"{prefix}.clip_cov_lb", f"{prefix}.clip_cov_ub")))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class KlCovOptions:
    """KL-Cov's knobs (``algorithm.policy_loss_args`` with ``policy_loss=kl_cov``; verl's names and defaults)."""

    kl_cov_ratio: float = 0.0002
    """Share of a mini-batch's loss tokens, those of largest cov, that are penalised."""

    ppo_kl_coef: float = 0.1
    """Weight of the |logp - old_logp| penalty on the selected tokens."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = _share_problems(f"{prefix}.kl_cov_ratio", self.kl_cov_ratio)
        if not 0.0 <= self.ppo_kl_coef < math.inf:
            out.append(ConfigProblem(f"{prefix}.ppo_kl_coef", self.ppo_kl_coef, "must be a finite number >= 0",
                                     f"set {prefix}.ppo_kl_coef=0.1"))
        return out


def _share_problems(key: str, value: float) -> list[ConfigProblem]:
    if 0.0 < value <= 1.0:
        return []
    return [ConfigProblem(key, value, "must be in (0, 1] (a share of the mini-batch's loss tokens)", f"set {key}=0.0002")]


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the given tokens.

    Args:
        advantages: Shape [M], float. logprobs: Shape [M], float, nats (the loss tokens only).

    Returns:
        Shape [M], float64.
    """
    a, lp = advantages.double(), logprobs.double()
    return (a - a.mean()) * (lp - lp.mean())


def pick_tokens(cov: torch.Tensor, options: ClipCovOptions | KlCovOptions, generator: torch.Generator) -> torch.Tensor:
    """Indices (into ``cov``, Shape [M]) of the tokens the loss whose ``options`` are given selects:
    Clip-Cov draws ``max(1, int(clip_cov_ratio * M))`` at random among lb < cov < ub (with
    ``generator``); KL-Cov takes the ``max(1, int(kl_cov_ratio * M))`` largest (stable order).
    Returns Shape [k], int64 (k may be 0 for Clip-Cov without candidates)."""
    if cov.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if isinstance(options, KlCovOptions):
        count = max(1, int(cov.numel() * options.kl_cov_ratio))
        return torch.argsort(-cov, stable=True)[:count]
    count = max(1, int(cov.numel() * options.clip_cov_ratio))
    candidates = torch.nonzero((cov > options.clip_cov_lb) & (cov < options.clip_cov_ub)).reshape(-1)
    return candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]


def select_cov_tokens(batch: TrainBatch, minibatches: Sequence[Sequence[int]], cfg: AlgorithmConfig,
                      seed: int) -> tuple[TrainBatch, dict[str, float]]:
    """The ``prepare`` of ``clip_cov`` and ``kl_cov`` (`packrl.algos.policy_losses.PrepareFn`):
    per mini-batch, the covariance over all its loss tokens and the tokens selected.

    Args:
        batch: the batch the update trains, with old log-probs.
        minibatches: sequence indices of each mini-batch (`packrl.seqlen.update_plan.MinibatchPlan.sequences`).
        cfg: the ``algorithm`` section (``policy_loss`` and its ``policy_loss_args``, `ClipCovOptions` / `KlCovOptions`).
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
    options = loss_options(cfg)
    selected = [torch.zeros_like(m) for m in batch.loss_masks]
    num_tokens = num_selected = num_candidates = 0
    for k, indices in enumerate(minibatches):
        masks = [batch.loss_masks[i] for i in indices]
        cov = token_covariance(torch.cat([batch.advantages[i][m] for i, m in zip(indices, masks)]),
                               torch.cat([batch.old_logprobs[i][m] for i, m in zip(indices, masks)]))
        generator = torch.Generator().manual_seed((seed * 1_000_003 + k) % 2**63)
        picked = torch.zeros(cov.numel(), dtype=torch.bool)
        picked[pick_tokens(cov, options, generator)] = True
        offset = 0
        for i, m in zip(indices, masks):
            n = int(m.sum())
            selected[i][m] = picked[offset:offset + n]
            offset += n
        num_tokens += cov.numel()
        num_selected += int(picked.sum())
        if isinstance(options, ClipCovOptions):
            num_candidates += int(((cov > options.clip_cov_lb) & (cov < options.clip_cov_ub)).sum())
    metrics = {"actor/cov_selected_fraction": num_selected / max(1, num_tokens)}
    if isinstance(options, ClipCovOptions):
        metrics["actor/cov_candidate_fraction"] = num_candidates / max(1, num_tokens)
    return replace(batch, extras={**batch.extras, SELECTED: tuple(selected)}), metrics


def _selected(inputs: PolicyLossInputs) -> torch.Tensor:
    chosen = inputs.extras.get(SELECTED)
    if chosen is None:
        raise ValueError(f"algorithm.policy_loss={inputs.cfg.policy_loss} needs the controller's token selection "
                         f"(PolicyLossInputs.extras[{SELECTED!r}]); run packrl.algos.policy_losses.prepare_update on the batch first")
    return chosen.bool() & inputs.loss_mask


@POLICY_LOSSES.register("clip_cov", options=ClipCovOptions, info=COV_LOSS)
def clip_cov(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Clip-Cov: the PPO clipped surrogate (``clip_ratio_low|high``, no dual clip), with zero loss
    at the selected tokens (`select_cov_tokens`). ``clipped`` is True where the PPO clip is active
    or the token was selected (its gradient is cut either way)."""
    chosen = _selected(inputs)
    loss, clipped = ppo_clip_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages,
                                  clip_ratio_low=inputs.cfg.clip_ratio_low, clip_ratio_high=inputs.cfg.clip_ratio_high)
    return PolicyLossOutput(loss * (~chosen).to(loss.dtype), clipped | chosen)


@POLICY_LOSSES.register("kl_cov", options=KlCovOptions, info=COV_LOSS)
def kl_cov(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """KL-Cov: -A r on every token (no clip) plus ``ppo_kl_coef`` x |logp - old_logp| on the
    selected ones. Metric ``actor/kl_cov_penalty``: the penalty's token mean over the mini-batch."""
    chosen = _selected(inputs)
    diff = inputs.logprobs - inputs.old_logprobs
    pg = -inputs.advantages * torch.exp(diff.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    penalty = torch.where(chosen, inputs.options.ppo_kl_coef * diff.abs(), torch.zeros_like(diff))
    metrics: dict[str, torch.Tensor | float] = {
        "actor/kl_cov_penalty": inputs.denominators.token_share(penalty.detach(), inputs.loss_mask)}
    return PolicyLossOutput(pg + penalty, None, metrics)

