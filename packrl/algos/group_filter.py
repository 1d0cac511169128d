"""Group filtering, GFPO (Shrivastava et al. 2025, "Sample More to Think Less: Group Filtered Policy
Optimization", arXiv 2508.09726): of each group's ``G = rollout.n`` responses keep the best ``k``
(``algorithm.group_filter.keep``) by a metric and train on those alone.

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
