"""The advantage stage: rewards (optionally KL-shaped) -> advantages, loss masks -> `TrainBatch`.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from packrl.algos.advantages import get_advantage
from packrl.algos.losses import kl_penalty
from packrl.config.schema import AlgorithmConfig
from packrl.types import ScoredBatch, TrainBatch


def loss_masks(scored: ScoredBatch, truncated: str) -> tuple[torch.Tensor, ...]:
    """True = the response token counts in the loss. ``truncated="mask"`` gives responses cut by a
    budget (finish reason ``length``/``context``) no loss tokens at all. ``N`` x Shape [R_i], bool."""
    out = []
    for r in scored.rollout.responses:
        keep = not (truncated == "mask" and r.truncated)
        out.append(torch.full((len(r.response_ids),), keep, dtype=torch.bool))
    return tuple(out)


def build_train_batch(
    scored: ScoredBatch,
    old_logprobs: tuple[torch.Tensor, ...] | None,
    ref_logprobs: tuple[torch.Tensor, ...] | None,
    cfg: AlgorithmConfig,
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages for every response token and the batch the update consumes.

    With ``algorithm.kl_in_reward`` and a reference model, each response's reward is lowered by
    ``kl_coef x sum_t KL_t`` (verl's in-reward KL) before the advantage is estimated.
    ``old_logprobs`` is None when the update is on-policy (see `LocalWorkerGroup`). The batch's
    ``scored.rewards`` are the rewards the advantages were computed from (KL-shaped if asked).

    Returns:
        ``(batch, metrics)``; metrics hold ``seqlen/masked_tokens/truncated`` (loss tokens removed
        by ``algorithm.truncated=mask``) and, with in-reward KL, ``critic/kl_in_reward/mean``.
    """
    rollout = scored.rollout
    rewards = scored.rewards.clone()
    metrics: dict[str, float] = {}
    if cfg.kl_in_reward and ref_logprobs is not None:
        assert old_logprobs is not None, "in-reward KL needs the old log-probs"
        seq_kl = torch.stack([kl_penalty(old, ref, cfg.kl_estimator).sum() for old, ref in zip(old_logprobs, ref_logprobs)])
        rewards = rewards - cfg.kl_coef * seq_kl
        metrics["critic/kl_in_reward/mean"] = seq_kl.mean().item()
    adv = get_advantage(cfg.adv_estimator)(rewards, rollout.group_size, norm_by_std=cfg.norm_adv_by_std)
    masks = loss_masks(scored, cfg.truncated)
    advantages = tuple(torch.full((len(r.response_ids),), float(a)) for r, a in zip(rollout.responses, adv))
    metrics["seqlen/masked_tokens/truncated"] = float(sum(int((~m).sum()) for m in masks))
    batch = TrainBatch(replace(scored, rewards=rewards), advantages, masks, old_logprobs, ref_logprobs)
    return batch, metrics
