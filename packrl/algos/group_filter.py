"""Group filtering, GFPO (Shrivastava et al. 2025, "Sample More to Think Less: Group Filtered Policy
Optimization", arXiv 2508.09726), the advantage filter ``algorithm.filters.gfpo``: of each group's
``G = rollout.n`` responses keep the best ``k`` (``algorithm.filters.gfpo.keep``) by a metric and
train on those alone (`packrl.algos.filters`).

Shapes: ``N = B*G`` responses (groups contiguous) · ``K = B*k`` kept.

- ``shortest``: the k responses with the fewest generated tokens (ties: the earlier response);
- ``reward_per_token``: the k with the highest ``(reward - the group's lowest reward) / generated
  tokens`` (token efficiency; ties: the shorter, then the earlier response).

The paper ranks on ``reward / tokens``, which reverses for negative rewards: at rewards -0.2,
-0.2, 0, 0 and lengths 20, 200, 50, 60 it ranks the 200-token response above the 20-token one
(-0.001 > -0.01 per token). Negative rewards are common here: the length parts, the overlong ramp
and in-reward KL all subtract. Shifted by the group's lowest reward, the ranking is the paper's in
a group whose lowest reward is 0 (a wrong answer's score), and of two equal rewards the shorter
response always ranks higher: the responses at the group's lowest reward tie at 0 and the shorter
are kept (a group of equal rewards keeps its k shortest). That case: kept 0, 2, 3.

The advantages are computed over the kept set only (the estimator sees groups of k,
`kept_groups`), and a filtered response gets no loss tokens and
advantage 0, so it leaves the update's denominators and its micro-batches (not packed, forwarded
or back-propagated: `packrl.seqlen.update_plan.trained_sequences`); it still takes part in the
log-prob passes, which run before the filter. Filtered responses stay in the rollout: they
are scored, dumped (``filtered: "gfpo"`` in ``rollouts/step_N.jsonl``) and counted
(``filter/gfpo/*``), never lost.

It runs after dynamic sampling (which keeps groups whose values vary over all G) and on the
complete groups a partial-rollout step trains; under over-provisioning a group is filtered when it
is trained, with all its G members finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from packrl.algos.filters import FilterInputs, FilterOutput
from packrl.config.schema import AlgorithmConfig, RolloutConfig
from packrl.errors import ConfigProblem
from packrl.registry import FILTERS
from packrl.types import ScoredBatch

KEY = "algorithm.filters.gfpo"

GroupFilterMetric = Literal["shortest", "reward_per_token"]


@dataclass(frozen=True, kw_only=True)
class GfpoOptions:
    """``algorithm.filters.gfpo``'s knobs."""

    keep: int | None = None
    """k: responses per group trained (2 <= k < rollout.n; GFPO keeps 4-8 of 8-24). Required."""

    metric: GroupFilterMetric = "shortest"
    """``shortest``: the k fewest generated tokens (ties: the earlier response); ``reward_per_token``:
    the k highest (reward - the group's lowest reward) / tokens (GFPO's token efficiency, shifted so
    that negative rewards do not favour long responses; ties: the shorter, then the earlier response)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if self.keep is None:
            return [ConfigProblem(f"{prefix}.keep", None, "is required: the responses of each group GFPO trains",
                                  f"set {prefix}.keep to k < rollout.n (e.g. 4 of rollout.n=8), or {prefix}=null (off)")]
        if self.keep < 1:
            return [ConfigProblem(f"{prefix}.keep", self.keep, "must be >= 1", f"set {prefix}.keep to k < rollout.n")]
        return []


@FILTERS.register("gfpo", options=GfpoOptions)
def gfpo(inputs: FilterInputs) -> FilterOutput:
    """Keep each group's best ``keep`` responses by ``metric`` (`kept_indices`)."""
    kept = set(kept_indices(inputs.scored, inputs.options))
    return FilterOutput(keep=tuple(i in kept for i in range(len(inputs.masks))), metrics=filter_metrics(inputs.scored, sorted(kept)))


def config_problems(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """GFPO keeps fewer than ``rollout.n`` responses, and enough for a group-relative baseline."""
    keep, n, estimator = (algorithm.filters.get("gfpo") or {}).get("keep"), rollout.n, algorithm.adv_estimator
    key = f"{KEY}.keep"
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        return []
    if keep > n:
        return [ConfigProblem(key, keep, f"> rollout.n={n}: a group has only {n} response{'s' if n != 1 else ''} to keep",
                              f"set {key} < rollout.n (GFPO samples more than it trains: raise rollout.n)", keys=(key, "rollout.n"))]
    if keep == n:
        return [ConfigProblem(key, keep, f"has no effect: it keeps all rollout.n={n} responses of a group",
                              f"set {key} < rollout.n, or {KEY}=null (off)", keys=(key, "rollout.n"))]
    if keep < 2 and estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        return [ConfigProblem(key, keep, f"leaves a group of one, whose advantage under {estimator} is 0 (no baseline)",
                              f"set {key} >= 2", keys=(key, "algorithm.adv_estimator"))]
    return []


def kept_indices(scored: ScoredBatch, cfg: GfpoOptions) -> list[int]:
    """The responses GFPO keeps, in input order, ``k`` of each group (all when off).

    Args:
        scored: the scored rollout (rewards after shaping, the responses).
        cfg: ``algorithm.filters.gfpo``.

    Returns:
        Indices into the ``N`` responses, ascending; groups of ``k`` in group order.
    """
    size = scored.rollout.group_size
    if cfg.keep is None or cfg.keep >= size:
        return list(range(len(scored.rollout.responses)))
    lengths = torch.tensor([float(r.generated_mask().sum()) for r in scored.rollout.responses]).view(-1, size)  # [B, G]
    by_length = torch.argsort(lengths, dim=1, stable=True)  # [B, G]: ties go to the earlier response
    if cfg.metric == "shortest":
        order = by_length[:, : cfg.keep]
    else:  # reward_per_token, highest first; a stable sort of the length order breaks ties by length
        rewards = scored.rewards.float().view(-1, size)
        per_token = (rewards - rewards.amin(dim=1, keepdim=True)) / lengths.clamp(min=1.0)
        order = by_length.gather(1, torch.argsort(-per_token.gather(1, by_length), dim=1, stable=True))[:, : cfg.keep]  # [B, k]
    chosen = torch.sort(order, dim=1).values + torch.arange(order.shape[0]).unsqueeze(1) * size
    return chosen.reshape(-1).tolist()


def filter_metrics(scored: ScoredBatch, kept: list[int]) -> dict[str, float]:
    """``filter/gfpo/kept_length_mean`` and ``filtered_length_mean``: the mean generated tokens of
    the kept and the filtered responses (the seam counts them: ``filter/gfpo/dropped``)."""
    keep = set(kept)
    lengths = [float(r.generated_mask().sum()) for r in scored.rollout.responses]
    filtered = [n for i, n in enumerate(lengths) if i not in keep]
    kept_lengths = [lengths[i] for i in kept]
    return {
        "filter/gfpo/kept_length_mean": sum(kept_lengths) / max(1, len(kept_lengths)),
        "filter/gfpo/filtered_length_mean": sum(filtered) / max(1, len(filtered)),
    }
