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
Register one with ``@packrl.registry.POLICY_LOSSES.register("name")`` (see `packrl.registry`); a
loss with knobs of its own registers a dataclass of them with it (``register("name",
options=MyOptions)``): the config sets them under ``algorithm.policy_loss_args``, they are checked
at load, and the loss reads the built value as ``inputs.options``.

What a loss needs beyond one micro-batch's tokens it declares with its registration, a
`packrl.capabilities.LossInfo` (``register("name", info=LossInfo(...))``), read without importing
the loss: whether it reads the old log-probs even on-policy (so their pass runs,
`packrl.config.plan.BatchPlan.needs_old_logprobs`), and, for a loss whose token choice needs the
whole mini-batch (Clip-Cov, KL-Cov: `packrl.algos.cov_losses`), its ``prepare``: a `PrepareFn` the
controller runs once per update on the batch and its mini-batches (`prepare_update`), returning
per-token ``extras`` that reach every micro-batch, so what it chose does not depend on the
micro-batch split or the rank count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from packrl.algos.losses import dual_clip, ppo_clip_loss
from packrl.config.load import build_options
from packrl.config.schema import AlgorithmConfig
from packrl.errors import ConfigError, ConfigProblem
from packrl.registry import POLICY_LOSSES, resolve_target
from packrl.seqlen.denominators import LossDenominators
from packrl.types import TrainBatch

_GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's sequence log-ratio at 10 before exp()


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
        cfg: the ``algorithm`` section (clip ranges, the KL and entropy weights).
        ref_logprobs: log pi_ref, Shape [K], float32 nats; None without a reference policy.
        rollout_logprobs: the engine's log-probs of the sampled tokens, Shape [K], float32 nats;
            None unless the engine returned them (``rollout.return_logprobs``).
        extras: the controller's per-token values (`packrl.types.TrainBatch.extras`) laid over
            the pack, name -> Shape [K] (prompt positions hold 0 / False).
        options: the loss's own options (the dataclass it registered with, built from
            ``algorithm.policy_loss_args``, `loss_options`); None for a loss registered without.
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
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    options: Any = None


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
PrepareFn = Callable[[TrainBatch, Sequence[Sequence[int]], AlgorithmConfig, int], tuple[TrainBatch, dict[str, float]]]
"""``prepare(batch, minibatches, cfg, seed) -> (batch with extras, metrics)``: ``minibatches`` are
the sequence indices of each mini-batch of the update; ``seed`` the step's seed."""


def loss_options(cfg: AlgorithmConfig) -> Any:
    """The options of ``algorithm.policy_loss``: its registered dataclass built from
    ``algorithm.policy_loss_args`` (defaults where a key is not set), or None for a loss
    registered without options. Build it once per run, not per micro-batch.

    Raises:
        ValueError: the loss is not registered; ConfigError (a ValueError): the args do not fit
            its options (a config that passed `packrl.config.load.load_config` always fits).
    """
    cls = POLICY_LOSSES.options_class(cfg.policy_loss)
    if cls is None:
        if cfg.policy_loss_args:
            raise ConfigError([ConfigProblem("algorithm.policy_loss_args", cfg.policy_loss_args,
                                             f"has no effect: algorithm.policy_loss={cfg.policy_loss} reads no options",
                                             "remove algorithm.policy_loss_args")])
        return None
    options, problems = build_options(cls, cfg.policy_loss_args, "algorithm.policy_loss_args.")
    if problems:
        raise ConfigError(problems)
    return options


def prepare_update(batch: TrainBatch, minibatches: Sequence[Sequence[int]], cfg: AlgorithmConfig,
                   seed: int) -> tuple[TrainBatch, dict[str, float]]:
    """Run the ``prepare`` that ``algorithm.policy_loss`` declares (`packrl.capabilities.LossInfo.prepare`,
    a `PrepareFn`) on the controller, once per update; ``(batch, {})`` for a loss without one.

    Raises:
        ValueError: ``algorithm.policy_loss`` is not registered, or the ``prepare`` it declares
            cannot be imported (the message names the loss and the ``"module:function"``).
    """
    target = POLICY_LOSSES.info(cfg.policy_loss).prepare
    if target is None:
        return batch, {}
    prepare: PrepareFn = resolve_target(target, f"algorithm.policy_loss={cfg.policy_loss}'s LossInfo(prepare=)")
    return prepare(batch, minibatches, cfg, seed)


@dataclass(frozen=True, kw_only=True, slots=True)
class PpoClipOptions:
    """``ppo_clip``'s knobs (``algorithm.policy_loss_args`` with ``policy_loss=ppo_clip``)."""

    clip_ratio_c: float | None = None
    """Dual-clip PPO (arXiv 1912.09729): a token with a negative advantage has its clipped loss
    bounded by `-clip_ratio_c x A`, so a ratio that ran above c stops pushing (> 1; verl's
    `actor.clip_ratio_c`, whose default 3.0 is on in every verl run and which `packrl verl` sets).
    null (packrl's default) = off: on-policy, one mini-batch per step (`train.mini_batch_size`
    null), the ratio is 1 and the bound never binds; it matters once updates go off-policy (several
    mini-batches, partial or asynchronous rollouts)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        value = self.clip_ratio_c
        if value is None or 1.0 < value < math.inf:
            return []
        return [ConfigProblem(f"{prefix}.clip_ratio_c", value, "must be a finite number > 1 (the bound on the ratio of a "
                              "negative-advantage token)", f"set {prefix}.clip_ratio_c=3.0 (verl's default) or null (off)")]


_PPO_CLIP_DEFAULTS = PpoClipOptions()


@POLICY_LOSSES.register("ppo_clip", options=PpoClipOptions)
def ppo_clip(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """The PPO clipped surrogate (`packrl.algos.losses.ppo_clip_loss`) with
    ``algorithm.clip_ratio_low|high``, and with ``algorithm.policy_loss_args.clip_ratio_c``
    (`PpoClipOptions`) the dual clip of negative-advantage tokens (`packrl.algos.losses.dual_clip`,
    as verl's vanilla loss), whose share of the mini-batch's loss tokens is the metric
    ``actor/pg_clipfrac_lower`` (verl's name). ``inputs.options`` None (a plugin loss that calls
    this one) reads the defaults: no dual clip."""
    cfg = inputs.cfg
    options: PpoClipOptions = inputs.options if inputs.options is not None else _PPO_CLIP_DEFAULTS
    loss, clipped = ppo_clip_loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages,
                                  clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high)
    if options.clip_ratio_c is None:
        return PolicyLossOutput(loss, clipped)
    loss, bound = dual_clip(loss, inputs.advantages, options.clip_ratio_c)
    return PolicyLossOutput(loss, clipped, {"actor/pg_clipfrac_lower": inputs.denominators.token_share(bound.float(), inputs.loss_mask)})


@POLICY_LOSSES.register("sft")
def sft_nll(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """Supervised fine-tuning's negative log-likelihood, ``loss_t = -logprobs_t``: the loss of
    `packrl sft` (`packrl.trainer.sft`), which sets it; advantages are not read, so an RL run
    refuses it at config load. Aggregated by ``token-mean`` over the mini-batch's loss tokens (the
    assistant's tokens), it is the mean NLL per target token, exact under any micro-batch split.

    Returns:
        token loss Shape [K], float32 nats; no clip.
    """
    return PolicyLossOutput(-inputs.logprobs)


@POLICY_LOSSES.register("gspo")
def gspo(inputs: PolicyLossInputs) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071; verl
    ``loss_mode=gspo``): the PPO clip applied to a length-normalised sequence ratio.

    s_i = exp(mean_{t in loss tokens of i} (logprobs_t - old_logprobs_t)), and per token
    s_i,t = sg(s_i) * exp(logprobs_t - sg(logprobs_t)) (same value, gradient s_i * grad logprobs_t);
    loss_t = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high)).
    The paper clips at about 3e-4 / 4e-4 (``algorithm.clip_ratio_low|high``), far tighter than
    token-level PPO; its objective averages each sequence's tokens (``loss_agg_mode=
    seq-mean-token-mean``); here, as in verl 0.9, the configured ``algorithm.loss_agg_mode`` is
    used. The log-ratio is clamped at 10 before exp() as verl does.

    A sequence's mean needs all of its loss tokens in this micro-batch, which holds unless
    sequence parallelism splits it or the rolling window cuts a trajectory into samples (both
    refused at config load, `packrl.config.algorithm_variants.gspo_problems`).

    Returns:
        token loss Shape [K]; ``clipped`` where the sequence's clip is active; the metric
        ``actor/gspo_seq_ratio_mean`` (token mean of s_i over the mini-batch's loss tokens).
    """
    mask, seq = inputs.loss_mask, inputs.sequence_ids
    num_seqs = int(seq.max()) + 1 if seq.numel() else 0
    log_ratio = torch.where(mask, inputs.logprobs.detach() - inputs.old_logprobs, 0.0)
    sums = log_ratio.new_zeros(num_seqs).index_add(0, seq, log_ratio)
    counts = log_ratio.new_zeros(num_seqs).index_add(0, seq, mask.to(log_ratio.dtype))
    seq_log_ratio = sums / counts.clamp(min=1)  # [S], detached
    log_s = (inputs.logprobs - inputs.logprobs.detach() + seq_log_ratio[seq]).clamp(max=_GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_s)
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * ratio.clamp(1.0 - inputs.cfg.clip_ratio_low, 1.0 + inputs.cfg.clip_ratio_high)
    metrics: dict[str, torch.Tensor | float] = {"actor/gspo_seq_ratio_mean": inputs.denominators.token_share(ratio.detach(), mask)}
    return PolicyLossOutput(torch.maximum(unclipped, clipped), clipped > unclipped, metrics)
