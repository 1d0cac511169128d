"""Token-level losses: PPO clipped surrogate and KL estimators. Pure tensor functions.

Shapes: ``M`` tokens (any layout; all inputs share it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LOG_RATIO_CLAMP = 20.0  # keeps exp() finite; verl clamps log-ratios the same way
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


def _k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprobs - ref_logprobs) ** 2


def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-_KL_CLAMP, _KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (Schulman, "Approximating KL Divergence", 2020).

    ``k1`` = log pi - log pi_ref (unbiased, high variance); ``k2`` = (log pi - log pi_ref)^2 / 2;
    ``k3`` = r - 1 - log r with r = pi_ref / pi (unbiased, low variance; verl's ``low_var_kl``,
    clamped to [-10, 10]).

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
