"""Length-control metrics of a scored rollout (docs/metrics.md, docs/algorithms/length_control.md):
how long correct and wrong responses are, what a correct answer costs in tokens, how close
responses come to the length their prompt asked for, and what was forced.

Lengths are the tokens the policy generated (`packrl.types.Response.generated_mask`), the length
the length objectives see (`packrl.reward.length`). Training metrics are prefixed ``length/``,
validation ones ``val/length/`` (`length_metrics`' ``prefix``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from packrl.types import ScoredBatch

logger = logging.getLogger(__name__)

TARGET_BUCKETS = 4
"""Targets are reported in this many equal-width ranges from the smallest to the largest asked for."""


def _quantiles(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor([float(v) for v in values])
    return {f"{prefix}/mean": t.mean().item(), f"{prefix}/p50": torch.quantile(t, 0.5).item(),
            f"{prefix}/p95": torch.quantile(t, 0.95).item()}


def length_metrics(scored: ScoredBatch, prefix: str = "length", *, forced_tokens_key: str = "seqlen/forced_tokens",
                   warn_all_wrong: bool = True) -> dict[str, float]:
    """The length metrics of ``scored``.

    Returns:
        ``<prefix>/correct/mean|p50|p95`` and ``<prefix>/wrong/...`` (generated tokens of correct /
        wrong responses, when the reward knows correct), ``<prefix>/tokens_per_correct``
        (generated tokens of all responses / correct ones; absent with none correct),
        ``<prefix>/score_per_1k_tokens`` (task score per 1,000 generated tokens),
        ``<prefix>/all_cut_or_wrong`` (1.0 when no response is correct: the length objectives then
        reward nothing, logged as a warning), with targets ``<prefix>/target_error/mean`` and per
        target range ``<prefix>/target_error/<lo>-<hi>`` (``|len - N| / N``), and
        ``<prefix>/forced_responses`` (fraction) and ``forced_tokens_key`` (sum; a training step's
        ``seqlen/forced_tokens``) where thinking budgets forced an end. ``warn_all_wrong``: log a
        warning when no response is correct (a training step: its rewards carry no signal).
    """
    responses = scored.rollout.responses
    lengths = [float(r.generated_mask().sum()) for r in responses]
    total = sum(lengths)
    out = {f"{prefix}/score_per_1k_tokens": 1000.0 * float(scored.scores.sum()) / max(total, 1.0)}
    if scored.correct is not None:
        correct = scored.correct.tolist()
        out |= _quantiles(f"{prefix}/correct", [n for n, c in zip(lengths, correct) if c])
        out |= _quantiles(f"{prefix}/wrong", [n for n, c in zip(lengths, correct) if not c])
        if any(correct):
            out[f"{prefix}/tokens_per_correct"] = total / sum(correct)
        out[f"{prefix}/all_cut_or_wrong"] = float(not any(correct))
        if not any(correct) and responses and warn_all_wrong:
            logger.warning("no response of this step is correct (%d responses, %d cut by a budget): rewards that depend on "
                           "correctness (the task score, the length objectives) carry no signal this step", len(responses),
                           sum(r.truncated for r in responses))
    out |= _target_metrics(scored, lengths, prefix)
    forced = [r.forced_tokens() for r in responses]
    if any(forced):
        out[f"{prefix}/forced_responses"] = sum(f > 0 for f in forced) / len(forced)
        out[forced_tokens_key] = float(sum(forced))
    return out


def _target_metrics(scored: ScoredBatch, lengths: list[float], prefix: str) -> dict[str, float]:
    targets = scored.rollout.prompts.length_targets
    if targets is None:
        return {}
    size = scored.rollout.group_size
    per = [(float(targets[i // size]), n) for i, n in enumerate(lengths)]
    errors = [abs(n - t) / t for t, n in per]
    out = {f"{prefix}/target_error/mean": sum(errors) / max(1, len(errors))}
    low, high = min(t for t, _ in per), max(t for t, _ in per)
    width = max(1.0, (high - low + 1) / TARGET_BUCKETS)
    for k in range(TARGET_BUCKETS):
        lo, hi = low + k * width, low + (k + 1) * width
        inside = [e for (t, _), e in zip(per, errors) if lo <= t < hi or (k == TARGET_BUCKETS - 1 and t == high)]
        if inside:
            out[f"{prefix}/target_error/{int(lo)}-{int(hi) - 1}"] = sum(inside) / len(inside)
    return out
