"""Advantage estimators for outcome rewards: one registered pure function each.

Shapes: ``B`` prompts · ``G`` responses per prompt · ``N = B*G`` (groups contiguous).

- ``grpo``: A_i = (r_i - mean_group) / (std_group + eps) (Shao et al. 2024, DeepSeekMath,
  arXiv 2402.03300); without the std division it is Dr. GRPO (Liu et al. 2025, arXiv 2503.20783).
  The std is the unbiased sample std, as verl's ``torch.std``.
- ``rloo``: A_i = r_i - mean of the other G-1 rewards of the group (Ahmadian et al. 2024,
  arXiv 2402.14740).

A group of one response has advantage 0 under both (no baseline to compare against).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator ``fn(rewards [N], group_size, *, norm_by_std) -> [N]`` under ``name``."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES[name] = fn
        return fn

    return wrap


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ValueError listing the known names otherwise."""
    if name not in ADVANTAGES:
        raise ValueError(f"algorithm.adv_estimator={name!r} is not registered; known: {', '.join(sorted(ADVANTAGES))}")
    return ADVANTAGES[name]


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of rollout.n={group_size}")
    return rewards.float().view(-1, group_size)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: one scalar reward per response. Shape [N], float.
        group_size: G (``rollout.n``).
        norm_by_std: divide by the group std (``algorithm.norm_adv_by_std``).
        eps: added to the std.

    Returns:
        Shape [N], float32.

    Raises:
        ValueError: N is not a multiple of G.
    """
    r = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int, **_: object) -> torch.Tensor:
    """Leave-one-out baseline: r_i minus the mean of the group's other rewards.

    Args:
        rewards: Shape [N], float. group_size: G.

    Returns:
        Shape [N], float32 (``G/(G-1) * (r_i - mean)``).
    """
    r = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)
    return ((r - r.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).view(-1)
