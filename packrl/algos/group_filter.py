"""Group filtering, GFPO (Shrivastava et al. 2025, "Sample More to Think Less: Group Filtered Policy
Optimization", arXiv 2508.09726): of each group's ``G = rollout.n`` responses keep the best ``k``
(``algorithm.group_filter.keep``) by a metric and train on those alone.

Shapes: ``N = B*G`` responses (groups contiguous) · ``K = B*k`` kept.

- ``shortest``: the k responses with the fewest generated tokens;
- ``reward_per_token``: the k with the highest reward / generated tokens (token efficiency).
Ties go to the earlier response. The advantages are computed over the kept set only (the
estimator sees groups of k, `kept_groups`), and a filtered response gets no loss tokens and
advantage 0, so it leaves the update's denominators. Filtered responses stay in the rollout: they
are scored, dumped (``filtered`` in ``rollouts/step_N.jsonl``) and counted
(``train/group_filter/*``), never lost.

It runs after dynamic sampling (which keeps groups whose values vary over all G) and on the
complete groups a partial-rollout step trains; under over-provisioning a group is filtered when it
is trained, with all its G members finished.
"""

from __future__ import annotations

import torch

from packrl.config.length_control import GroupFilterConfig
from packrl.types import ScoredBatch


def kept_indices(scored: ScoredBatch, cfg: GroupFilterConfig) -> list[int]:
    """The responses GFPO keeps, in input order, ``k`` of each group (all when off).

    Args:
        scored: the scored rollout (rewards after shaping, the responses).
        cfg: ``algorithm.group_filter``.

    Returns:
        Indices into the ``N`` responses, ascending; groups of ``k`` in group order.
    """
    size = scored.rollout.group_size
    if cfg.keep is None or cfg.keep >= size:
        return list(range(len(scored.rollout.responses)))
    lengths = torch.tensor([float(r.generated_mask().sum()) for r in scored.rollout.responses]).view(-1, size)  # [B, G]
    if cfg.metric == "shortest":
        key = lengths
    else:  # reward_per_token, highest first: sort by its negation
        key = -(scored.rewards.float().view(-1, size) / lengths.clamp(min=1.0))
    order = torch.argsort(key, dim=1, stable=True)[:, : cfg.keep]  # [B, k]: ties go to the earlier response
    chosen = torch.sort(order, dim=1).values + torch.arange(order.shape[0]).unsqueeze(1) * size
    return chosen.reshape(-1).tolist()


def filter_metrics(scored: ScoredBatch, kept: list[int]) -> dict[str, float]:
    """``train/group_filter/kept_responses`` and ``filtered_responses`` (counts), and the mean
    generated tokens of each set (``kept_length_mean``, ``filtered_length_mean``)."""
    keep = set(kept)
    lengths = [float(r.generated_mask().sum()) for r in scored.rollout.responses]
    filtered = [n for i, n in enumerate(lengths) if i not in keep]
    kept_lengths = [lengths[i] for i in kept]
    return {
        "train/group_filter/kept_responses": float(len(kept)),
        "train/group_filter/filtered_responses": float(len(filtered)),
        "train/group_filter/kept_length_mean": sum(kept_lengths) / max(1, len(kept_lengths)),
        "train/group_filter/filtered_length_mean": sum(filtered) / max(1, len(filtered)),
    }
