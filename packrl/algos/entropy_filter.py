"""Entropy-based response filter, the loss filter ``algorithm.filters.entropy`` (`packrl.algos.filters`): train only on responses whose
mean token entropy is high, so low-information responses (near-deterministic, mostly copied or
repeated text) stop costing update tokens. In the spirit of Wang et al. 2025, "Beyond the 80/20
Rule: High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning" (arXiv 2506.01939), which
keeps the top 20% of tokens by entropy; here the unit is the response, so whole sequences leave
the update plan and their tokens are never packed.

Shapes: ``N`` responses · ``R_i`` response tokens of response i.

The entropy is the old-log-prob pass's (at the rollout temperature), averaged over each response's
policy tokens (tool messages left out). A filtered response loses its loss tokens on the
controller, before the update is planned, so it counts in no loss denominator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from packrl.algos.filters import FilterInputs, FilterOutput
from packrl.errors import ConfigProblem
from packrl.registry import FILTERS


@dataclass(frozen=True, kw_only=True)
class EntropyFilterOptions:
    """``algorithm.filters.entropy``'s knobs: set exactly one of the two."""

    threshold: float | None = None
    """Keep responses whose mean token entropy is >= this, in nats (>= 0)."""

    quantile: float | None = None
    """Keep the ceil(quantile x n) responses with the highest mean token entropy among the n
    that still have loss tokens (in (0, 1]; ties go to the earlier response)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        if (self.threshold is None) == (self.quantile is None):
            given = {"threshold": self.threshold, "quantile": self.quantile}
            out.append(ConfigProblem(prefix, given, f"sets {'both' if self.threshold is not None else 'neither'} of threshold "
                                     "and quantile; the filter keeps responses by exactly one",
                                     f"set {prefix}.threshold=0.3 or {prefix}.quantile=0.8 (the other null), or {prefix}=null (off)",
                                     keys=(prefix, f"{prefix}.quantile", f"{prefix}.threshold")))
        if self.threshold is not None and not 0.0 <= self.threshold < math.inf:
            out.append(ConfigProblem(f"{prefix}.threshold", self.threshold, "must be a finite number of nats >= 0",
                                     f"set {prefix}.threshold=0.3"))
        if self.quantile is not None and not 0.0 < self.quantile <= 1.0:
            out.append(ConfigProblem(f"{prefix}.quantile", self.quantile, "must be in (0, 1] (the share of responses kept)",
                                     f"set {prefix}.quantile=0.8"))
        return out


@FILTERS.register("entropy", options=EntropyFilterOptions)
def entropy_filter(inputs: FilterInputs) -> FilterOutput:
    """Take the low-entropy responses out of the loss (`apply_entropy_filter`)."""
    policy = [r.generated_mask() for r in inputs.scored.rollout.responses]
    masks, metrics = apply_entropy_filter(inputs.old_entropy, policy, inputs.masks, inputs.options)
    return FilterOutput(keep=tuple(bool(after.any()) or not bool(before.any()) for before, after in zip(inputs.masks, masks)),
                        metrics=metrics)



def mean_entropies(entropy: Sequence[torch.Tensor], policy_masks: Sequence[torch.Tensor]) -> list[float | None]:
    """Each response's mean token entropy over its policy tokens, in nats (None without any).

    Args:
        entropy: per response, Shape [R_i], float32, nats.
        policy_masks: True = a token the policy generated, Shape [R_i], bool.
    """
    return [float(e[m].double().mean()) if bool(m.any()) else None for e, m in zip(entropy, policy_masks)]


def entropy_keep(means: Sequence[float | None], live: Sequence[bool], cfg: EntropyFilterOptions) -> list[bool]:
    """Which responses keep their loss tokens.

    With ``threshold``: those with mean >= threshold. With ``quantile`` q: the ceil(q x n)
    highest means among the n ``live`` responses (those that still have loss tokens; ties go to
    the earlier response). Responses that are not live are returned as kept (nothing to remove).

    Example (quantile 0.5):

        means  [0.1, 0.9, 0.5, 0.7]    live [T, T, T, F]  ->  keep [F, T, T, T]
    """
    if cfg.threshold is not None:
        return [not lv or (m is not None and m >= cfg.threshold) for m, lv in zip(means, live)]
    assert cfg.quantile is not None, "entropy_keep needs the filter on"
    candidates = [i for i, lv in enumerate(live) if lv and means[i] is not None]
    count = math.ceil(cfg.quantile * len(candidates))
    ranked = sorted(candidates, key=lambda i: (-means[i], i))  # type: ignore[operator]
    kept = set(ranked[:count])
    return [not live[i] or i in kept for i in range(len(means))]


def apply_entropy_filter(
    entropy: Sequence[torch.Tensor] | None,
    policy_masks: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    cfg: EntropyFilterOptions,
) -> tuple[tuple[torch.Tensor, ...], dict[str, float]]:
    """The loss masks with filtered responses all False.

    Args:
        entropy: the old-log-prob pass's entropy, ``N`` x Shape [R_i], float32, nats.
        policy_masks: ``N`` x Shape [R_i] bool, True = a token the policy generated.
        loss_masks: the loss masks so far, ``N`` x Shape [R_i] bool.
        cfg: ``algorithm.filters.entropy``.

    Returns:
        ``(loss_masks, metrics)``; metrics ``seqlen/masked_tokens/entropy`` (loss tokens removed),
        ``seqlen/masked_sequences/entropy`` (responses filtered) and ``entropy_filter/mean_entropy``
        (mean over the live responses of their mean token entropy, nats).

    Raises:
        ValueError: the filter is on but no entropy was computed.
    """
    masks = tuple(loss_masks)
    if entropy is None:
        raise ValueError("algorithm.filters.entropy needs the old-log-prob pass's entropy; "
                         "BatchPlan.needs_old_logprobs turns that pass on with the filter")
    means = mean_entropies(entropy, policy_masks)
    live = [bool(m.any()) for m in masks]
    keep = entropy_keep(means, live, cfg)
    removed = [not k for k in keep]
    measured = [m for m, lv in zip(means, live) if lv and m is not None]
    metrics = {
        "seqlen/masked_tokens/entropy": float(sum(int(m.sum()) for m, r in zip(masks, removed) if r)),
        "seqlen/masked_sequences/entropy": float(sum(removed)),
    }
    if measured:
        metrics["entropy_filter/mean_entropy"] = sum(measured) / len(measured)
    return tuple(m & keep_i for m, keep_i in zip(masks, keep)), metrics
