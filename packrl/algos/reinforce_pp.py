"""REINFORCE++ and REINFORCE++-baseline (Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with
Robustness to Both Prompt and Reward Models", arXiv 2501.03262): critic-free estimators whose
advantages are normalised over the whole batch rather than within a group. Registered under
verl's names, ``algorithm.adv_estimator=reinforce_plus_plus|reinforce_plus_plus_baseline``
(verl ``core_algos.compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage``; OpenRLHF ``--advantage_estimator
reinforce|reinforce_baseline``).

Shapes: ``N`` responses (groups of ``G`` contiguous) · ``R_i`` tokens of response i.

- ``reinforce_plus_plus``: the discounted return of every policy token,
  ``G_t = sum_{t' >= t} gamma^(t' - t) r_t'`` over the token rewards (the response's reward on its
  last policy token, minus ``kl_coef x KL_t`` on each policy token with ``algorithm.kl_in_reward``:
  the paper's token-level KL penalty), then whitened over every policy token of the batch
  (`packrl.algos.gae.whiten`, verl's ``masked_whiten``). ``algorithm.gamma`` discounts.
- ``reinforce_plus_plus_baseline``: each response's reward minus its group's mean reward, given to
  every policy token, then whitened over every policy token of the batch. A group of one response
  is refused at config load (its own reward is its baseline, so every advantage would be 0).

Both are computed on the controller over the whole batch before the update is planned, so they
do not depend on micro-batching or ranks. The time steps are the policy's tokens: a return looks
through a multi-turn trajectory's tool answers to the next policy token, discounted once per
policy token, as verl 0.9.1's running return passes a masked token unchanged
(``verl/trainer/ppo/core_algos.py:721-726``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from packrl.algos.advantages import AdvantageInputs, grouped_rewards
from packrl.algos.gae import whiten
from packrl.registry import ADVANTAGE_ESTIMATORS


def discounted_returns(token_rewards: Sequence[torch.Tensor], policy_masks: Sequence[torch.Tensor], *,
                       gamma: float) -> tuple[torch.Tensor, ...]:
    """``G_t = r_t + gamma x G_{t+1}`` over each response's policy tokens, from its last one back.

    Args:
        token_rewards: the reward of each token (read at policy tokens only). ``N`` x Shape [R_i], float.
        policy_masks: True = a token the policy generated (a time step). ``N`` x Shape [R_i], bool.
        gamma: the discount per policy token, in [0, 1].

    Returns:
        ``N`` tensors of Shape [R_i], float32, 0 at tokens the policy did not generate.
    """
    out = []
    for rewards, mask in zip(token_rewards, policy_masks):
        steps = mask.nonzero().squeeze(1).tolist()
        returns = torch.zeros(mask.shape[0])
        running = 0.0
        for t in reversed(steps):
            running = float(rewards[t]) + gamma * running
            returns[t] = running
        out.append(returns)
    return tuple(out)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """REINFORCE++: `discounted_returns` of the token rewards with ``algorithm.gamma``, whitened
    over the batch's policy tokens. ``N`` tensors of Shape [R_i], float32."""
    returns = discounted_returns(inputs.token_rewards, inputs.response_masks, gamma=inputs.cfg.gamma)
    return whiten(returns, inputs.response_masks)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """REINFORCE++-baseline: ``r_i - mean of r over i's group`` on every policy token of response
    i, whitened over the batch's policy tokens. ``N`` tensors of Shape [R_i], float32.

    Raises:
        ValueError: the rewards do not split into groups of ``rollout.n``.
    """
    grouped = grouped_rewards(inputs.rewards, inputs.group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    tiled = tuple(torch.where(mask, float(a), 0.0) for a, mask in zip(centred, inputs.response_masks))
    return whiten(tiled, inputs.response_masks)
