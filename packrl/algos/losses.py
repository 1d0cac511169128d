"""Token-level losses: PPO clipped surrogate and KL estimators. Pure tensor functions.

Shapes: ``M`` tokens (any layout; all inputs share it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LOG_RATIO_CLAMP = 20.0  # keeps exp() finite; verl clamps its vanilla loss's log-ratios the same way
_KL_CLAMP = 10.0  # verl's bound for the k3 (low_var_kl) estimator


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (Schulman et al. 2017, arXiv 1707.06347), with separate
    lower and upper clip ranges (DAPO "clip-higher", arXiv 2503.14476).

    loss = max(-A * r, -A * clip(r, 1 - low, 1 + high)), r = exp(logprobs - old_logprobs).

    Args:
        logprobs: log pi_theta of each token. Shape [M], float, nats (differentiable).
        old_logprobs: log pi_old. Shape [M], float, nats.
        advantages: Shape [M], float.
        clip_ratio_low / clip_ratio_high: the clip range (``algorithm.clip_ratio_low|high``).

    Returns:
        ``(token_loss, clipped)``: Shape [M] float, and Shape [M] bool (True where the clipped
        term is the larger, i.e. the clip is active: ``actor/pg_clipfrac``).
    """
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def dual_clip(token_loss: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning", arXiv 1912.09729; verl's ``clip_ratio_c``): for a token with A < 0 the
    clipped surrogate is bounded above by ``-c x A``, so a ratio that has run far above 1 on a bad
    token cannot grow the loss (or its gradient) without bound; tokens with A >= 0 are unchanged.

    loss' = min(loss, -c x A) where A < 0, loss elsewhere.

    Args:
        token_loss: the PPO clipped surrogate per token (`ppo_clip_loss`). Shape [M], float.
        advantages: Shape [M], float.
        clip_ratio_c: c > 1 (``algorithm.policy_loss_args.clip_ratio_c`` of ``ppo_clip``; verl's default 3.0).

    Returns:
        ``(token_loss, bound)``: Shape [M] float, and Shape [M] bool (True where the bound is
        active: A < 0 and ``loss > -c x A``, i.e. a ratio above c; ``actor/pg_clipfrac_lower``).
    """
    cap = -advantages * clip_ratio_c
    bound = (advantages < 0) & (token_loss > cap)
    return torch.where(bound, cap, token_loss), bound


def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-_KL_CLAMP, _KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (Schulman, "Approximating KL Divergence", 2020),
    with r = pi_ref / pi the ratio of the reference to the policy at the sampled token:

    ``k1`` = log pi - log pi_ref = -log r (unbiased, high variance); ``k2`` = (log r)^2 / 2;
    ``k3`` = r - 1 - log r (unbiased, low variance, >= 0; verl's ``low_var_kl``, clamped to [-10, 10]).

    Args:
        logprobs: Shape [M], float, nats. ref_logprobs: Shape [M], float, nats.
        estimator: ``algorithm.kl_estimator``.

    Returns:
        Shape [M], float.

    Raises:
        ValueError: unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"algorithm.kl_estimator={estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
