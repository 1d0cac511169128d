"""Generalized Advantage Estimation (Schulman et al. 2016, arXiv 1506.02438) over the policy's
tokens, the ``gae`` estimator of PPO with a critic (verl's ``algorithm.adv_estimator=gae``).

Shapes: ``N`` responses · ``R_i`` tokens of response i · ``M`` policy tokens of the longest response.

The time steps are the tokens the policy generated (`Response.response_mask`; tool answers of a
multi-turn trajectory are not steps: the value of the state before a tool answer looks through it
to the next policy token). The reward of step j is the token reward ``r_j``
(`AdvantageInputs.token_rewards`): the response's reward on its last policy token, and with
``algorithm.kl_in_reward`` minus ``kl_coef x KL_j`` on every policy token, as verl's
``apply_kl_penalty`` gives ``token_level_rewards``. With ``V_j`` the critic's value of the state
before policy token j:

    delta_j = r_j + gamma * V_{j+1} - V_j            A_j = delta_j + gamma * lam * A_{j+1}
    returns_j = A_j + V_j                            (the critic's regression targets)

and after the last token ``V_{m+1}`` is the value of the state after it when the response was cut
by a budget (finish reason ``length`` or ``context``: the episode did not end, so its value
bootstraps), and 0 when it ended on its own (EOS, a stop string, an answer). The finish reason
decides, never the tensor width. Advantages are then whitened over every policy token of the batch
(`whiten`, verl's ``masked_whiten``), as verl's ``compute_gae_advantage_return`` does; returns are not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from packrl.algos.advantages import AdvantageInputs
from packrl.registry import ADVANTAGE_ESTIMATORS


def gae(token_rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], bootstrap: torch.Tensor, truncated: Sequence[bool],
        policy_masks: Sequence[torch.Tensor], *, gamma: float, lam: float) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Raw (unwhitened) GAE advantages and returns of every response token.

    Args:
        token_rewards: the reward of each response token (read at the policy's tokens only).
            ``N`` tensors of Shape [R_i], float.
        values: V of the state before each response token. ``N`` tensors of Shape [R_i], float32.
        bootstrap: V of the state after each response's last token. Shape [N], float32.
        truncated: per response, whether a budget cut it (then ``bootstrap`` is used, else 0).
        policy_masks: True = a token the policy generated (a time step). ``N`` x Shape [R_i], bool.
        gamma / lam: ``algorithm.gamma`` and ``algorithm.lam``.

    Returns:
        ``(advantages, returns)``: ``N`` tensors of Shape [R_i], float32, 0 at non-policy tokens.
    """
    steps = [m.nonzero().squeeze(1) for m in policy_masks]  # positions of the policy tokens
    num, width = len(steps), max((len(s) for s in steps), default=0)
    v = torch.zeros(num, width + 1)  # [N, M + 1]: the step values, then the value after the last step
    r = torch.zeros(num, width)
    alive = torch.zeros(num, width, dtype=torch.bool)
    for i, s in enumerate(steps):
        if len(s):
            v[i, : len(s)] = values[i].float()[s]
            v[i, len(s)] = float(bootstrap[i]) if truncated[i] else 0.0
            r[i, : len(s)] = token_rewards[i].float()[s]
            alive[i, : len(s)] = True
    adv = torch.zeros(num, width)
    last = torch.zeros(num)
    for j in range(width - 1, -1, -1):  # backwards over steps, every response at once
        delta = r[:, j] + gamma * v[:, j + 1] - v[:, j]
        last = torch.where(alive[:, j], delta + gamma * lam * last, torch.zeros_like(last))
        adv[:, j] = last
    out_adv, out_ret = [], []
    for i, (s, mask) in enumerate(zip(steps, policy_masks)):
        a, ret = torch.zeros(mask.shape[0]), torch.zeros(mask.shape[0])
        a[s] = adv[i, : len(s)]
        ret[s] = adv[i, : len(s)] + v[i, : len(s)]
        out_adv.append(a)
        out_ret.append(ret)
    return tuple(out_adv), tuple(out_ret)


def whiten(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], eps: float = 1e-8) -> tuple[torch.Tensor, ...]:
    """``values`` whitened over the masked tokens of all of them: ``(x - mean) / sqrt(var + eps)``
    with the unbiased variance, verl's ``masked_whiten`` (``verl/utils/torch_functional.py``);
    unmasked tokens become 0. Shapes as given, float32.

    The epsilon sits under the square root, so a batch whose values are nearly equal keeps its
    small spread small (input std 1e-6 -> output std about 0.01) instead of having rounding noise
    scaled up to std 1, as ``/ (std + eps)`` would; with one masked token only the mean is removed.
    """
    chosen = torch.cat([v[m] for v, m in zip(values, masks)]).float() if values else torch.zeros(0)
    if chosen.numel() < 2:
        return tuple(torch.where(m, v - chosen.mean() if chosen.numel() else v, 0.0) for v, m in zip(values, masks))
    mean, var = chosen.mean(), chosen.var()
    return tuple(torch.where(m, (v.float() - mean) * torch.rsqrt(var + eps), 0.0) for v, m in zip(values, masks))


def gae_of(inputs: AdvantageInputs) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """`gae` of an advantage stage's inputs: ``(raw advantages, returns)``.

    Raises:
        ValueError: the inputs hold no critic values (``algorithm.adv_estimator=gae`` without a critic).
    """
    if inputs.values is None or inputs.bootstrap_values is None:
        raise ValueError(f"algorithm.adv_estimator={inputs.cfg.adv_estimator!r} needs the critic's values, and this run has no "
                         "critic; set critic.enable=true (or use algorithm.adv_estimator=grpo)")
    truncated = [r.truncated for r in inputs.scored.rollout.responses]
    return gae(inputs.token_rewards, inputs.values, inputs.bootstrap_values, truncated, inputs.response_masks,
               gamma=inputs.cfg.gamma, lam=inputs.cfg.lam)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, ...]:
    """The ``gae`` estimator: `gae` advantages, whitened over the batch's policy tokens (`whiten`)."""
    advantages, _ = gae_of(inputs)
    return whiten(advantages, inputs.response_masks)
