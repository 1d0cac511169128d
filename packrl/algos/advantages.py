"""Advantage estimators (``algorithm.adv_estimator``): registered functions from a scored batch
to an advantage per response token.

Shapes: ``B`` prompts · ``G`` responses per prompt · ``N = B*G`` (groups contiguous) · ``R_i``
tokens of response i.

An estimator takes `AdvantageInputs` (the scored batch, its rewards after any in-reward KL, per
response and per token, the response masks and the log-probs known at that point) and returns
``N`` tensors of Shape [R_i], float32: token-level estimators (GAE, REINFORCE++) read the token
rewards and fill each token; outcome estimators read one reward per response and give every token
of a response the same value (`per_token`). Register one with
``@packrl.registry.ADVANTAGE_ESTIMATORS.register("name")`` (see `packrl.registry`).

The outcome estimators built in:

- ``grpo``: A_i = (r_i - mean_group) / (std_group + eps) (Shao et al. 2024, DeepSeekMath,
  arXiv 2402.03300); without the std division it is Dr. GRPO (Liu et al. 2025, arXiv 2503.20783).
  The std is the unbiased sample std, as verl's ``torch.std``.
- ``rloo``: A_i = r_i - mean of the other G-1 rewards of the group (Ahmadian et al. 2024,
  arXiv 2402.14740).

A group of one response has advantage 0 under both (no baseline to compare against).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from packrl.config.schema import AlgorithmConfig
from packrl.registry import ADVANTAGE_ESTIMATORS
from packrl.types import ScoredBatch


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read.

    Attributes:
        scored: the scored rollout (responses, prompts, task scores).
        rewards: one reward per response after shaping and any in-reward KL (the sum of its
            ``token_rewards``). Shape [N], float32.
        token_rewards: the reward of each response token, verl's ``token_level_rewards``: the
            response's reward on its last policy token, minus ``kl_coef x KL_t`` on every policy
            token t with ``algorithm.kl_in_reward``, 0 elsewhere (`token_rewards_of`). ``N``
            tensors of Shape [R_i], float32.
        response_masks: True = a token the policy generated (False for tool output in a
            multi-turn trajectory). ``N`` tensors of Shape [R_i], bool.
        old_logprobs / ref_logprobs: ``N`` tensors of Shape [R_i], float32 nats, or None when
            that pass did not run.
        cfg: the ``algorithm`` section.
        values: the critic's value of the state before each response token, ``N`` tensors of
            Shape [R_i], float32; None without a critic.
        bootstrap_values: the critic's value of the state after each response's last token,
            Shape [N], float32; None without a critic.
    """

    scored: ScoredBatch
    rewards: torch.Tensor
    token_rewards: tuple[torch.Tensor, ...]
    response_masks: tuple[torch.Tensor, ...]
    old_logprobs: tuple[torch.Tensor, ...] | None
    ref_logprobs: tuple[torch.Tensor, ...] | None
    cfg: AlgorithmConfig
    values: tuple[torch.Tensor, ...] | None = None
    bootstrap_values: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return self.scored.rollout.group_size


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, ...]]
"""``fn(inputs) -> N tensors of Shape [R_i], float32`` (advantage of every response token)."""


def token_rewards_of(rewards: torch.Tensor, policy_masks: Sequence[torch.Tensor],
                     token_penalties: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Each response's reward on its last policy token, minus ``token_penalties`` (the in-reward
    KL, ``kl_coef x KL_t``) on its policy tokens.

    Args:
        rewards: one reward per response. Shape [N], float.
        policy_masks: True = a token the policy generated. ``N`` x Shape [R_i], bool.
        token_penalties: subtracted at the policy tokens, ``N`` x Shape [R_i], float; None = none.

    Returns:
        ``N`` tensors of Shape [R_i], float32, 0 at tokens the policy did not generate; each sums
        to its reward minus its penalties. A response with no policy token gets all zeros.
    """
    out = []
    for i, mask in enumerate(policy_masks):
        token = torch.zeros(mask.shape[0])
        steps = mask.nonzero().squeeze(1)
        if len(steps):
            token[steps[-1]] = float(rewards[i])
            if token_penalties is not None:
                token = token - torch.where(mask, token_penalties[i].float(), 0.0)
        out.append(token)
    return tuple(out)


def per_token(per_response: torch.Tensor, inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """Give every token of response i the value ``per_response[i]``. ``N`` tensors of Shape [R_i], float32."""
    return tuple(torch.full((len(r.response_ids),), float(a)) for r, a in zip(inputs.scored.rollout.responses, per_response))


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """`grpo_advantages` of the rewards (``algorithm.norm_adv_by_std``), on every token."""
    return per_token(grpo_advantages(inputs.rewards, inputs.group_size, norm_by_std=inputs.cfg.norm_adv_by_std), inputs)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """`rloo_advantages` of the rewards, on every token."""
    return per_token(rloo_advantages(inputs.rewards, inputs.group_size), inputs)


def check_advantages(advantages: Sequence[torch.Tensor], inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """An estimator's result as float32 tensors, checked against the responses.

    Raises:
        ValueError: not one tensor per response, or a tensor whose shape is not [R_i] (names the
            estimator and the response).
    """
    name, responses = inputs.cfg.adv_estimator, inputs.scored.rollout.responses
    if len(advantages) != len(responses):
        raise ValueError(f"algorithm.adv_estimator={name!r} returned {len(advantages)} advantages for {len(responses)} responses; "
                         "return one tensor of Shape [R_i] per response")
    out = []
    for i, (adv, response) in enumerate(zip(advantages, responses)):
        if not isinstance(adv, torch.Tensor) or tuple(adv.shape) != (len(response.response_ids),):
            raise ValueError(f"algorithm.adv_estimator={name!r} returned Shape {tuple(getattr(adv, 'shape', ()))} for response {i} "
                             f"of {len(response.response_ids)} tokens; return one value per response token")
        out.append(adv.detach().float().cpu())
    return tuple(out)


def grouped_rewards(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of rollout.n={group_size}")
    return rewards.float().view(-1, group_size)


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
    r = grouped_rewards(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int, **_: object) -> torch.Tensor:
    """Leave-one-out baseline: r_i minus the mean of the group's other rewards.

    Args:
        rewards: Shape [N], float. group_size: G.

    Returns:
        Shape [N], float32 (``G/(G-1) * (r_i - mean)``).
    """
    r = grouped_rewards(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(r).view(-1)
    return ((r - r.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)).view(-1)
