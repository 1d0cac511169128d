"""Policy losses (``algorithm.policy_loss``): registered functions from one micro-batch's tokens to a
loss per token.

Shapes: ``K`` positions of a pack (the micro-batch's sequences, concatenated). Prompt positions
carry zeros and are False in ``loss_mask``.

A policy loss receives `PolicyLossInputs` (current, old, reference and rollout log-probs,
advantages, the loss mask, each token's sequence and the mini-batch's denominators) and returns
a `PolicyLossOutput`: the loss of every token, where its clip is active (optional) and metrics.
The worker turns the token loss into the micro-batch's share of the mini-batch loss with
``algorithm.loss_agg_mode`` (`packrl.algos.loss_agg.aggregate_loss`, exact under micro-batching
and ranks), adds the KL and entropy terms, and sums the metrics over micro-batches and ranks.
Register one with ``@packrl.registry.POLICY_LOSSES.register("name")`` (see `packrl.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from packrl.algos.losses import ppo_clip_loss
from packrl.config.schema import AlgorithmConfig
from packrl.registry import POLICY_LOSSES
from packrl.seqlen.denominators import LossDenominators


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's tokens.

    Attributes:
        logprobs: log pi_theta of each token. Shape [K], float32 nats, differentiable.
        old_logprobs: log pi_old (the policy that sampled, or the detached current one on-policy).
            Shape [K], float32 nats.
        advantages: Shape [K], float32.
        loss_mask: True = the token counts in the loss. Shape [K], bool.
        sequence_ids: index of each token's sequence in the pack. Shape [K], int64.
        denominators: loss tokens and sequences of the whole mini-batch.
        cfg: the ``algorithm`` section (clip ranges and any loss parameters).
        ref_logprobs: log pi_ref, Shape [K], float32 nats; None without a reference policy.
        rollout_logprobs: the engine's log-probs of the sampled tokens, Shape [K], float32 nats;
            None unless the engine returned them (``rollout.return_logprobs``).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    sequence_ids: torch.Tensor
    denominators: LossDenominators
    cfg: AlgorithmConfig
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyLossOutput:
    """What a policy loss returns.

    Attributes:
        token_loss: the loss of every token. Shape [K], float (masked positions are ignored).
        clipped: True where the token's clip is active, Shape [K] bool, or None for a loss
            without a clip; it gives ``actor/pg_clipfrac`` and ``bucket/clipfrac/*``.
        metrics: ``name -> 0-d tensor or float``, each this micro-batch's share of a mini-batch
            value (normalise with the denominators, e.g. `LossDenominators.token_share`): the
            worker sums them over micro-batches and ranks and averages over optimizer steps.
    """

    token_loss: torch.Tensor
    clipped: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)


PolicyLossFn = Callable[[PolicyLossInputs], PolicyLossOutput]


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """The PPO clipped surrogate (`packrl.algos.losses.ppo_clip_loss`) with
    ``algorithm.clip_ratio_low|high``."""
    loss, clipped = ppo_clip_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages,
                                  clip_ratio_low=inputs.cfg.clip_ratio_low, clip_ratio_high=inputs.cfg.clip_ratio_high)
    return PolicyLossOutput(loss, clipped)
