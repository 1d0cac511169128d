"""The advantage stage: rewards (optionally KL-shaped) -> advantages, loss masks -> `TrainBatch`.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from packrl.algos.advantages import AdvantageInputs, check_advantages
from packrl.algos.losses import kl_penalty
from packrl.config.schema import AlgorithmConfig
from packrl.registry import ADVANTAGE_ESTIMATORS
from packrl.types import ScoredBatch, TrainBatch


def loss_masks(scored: ScoredBatch, truncated: str) -> tuple[torch.Tensor, ...]:
    """True = the response token counts in the loss: a token the policy generated
    (`Response.response_mask`) of a response the truncation policy keeps. ``truncated="mask"``
    gives responses cut by a budget (finish reason ``length``/``context``) no loss tokens at all.
    ``N`` x Shape [R_i], bool."""
    out = []
    for r in scored.rollout.responses:
        keep = not (truncated == "mask" and r.truncated)
        out.append(r.generated_mask() & keep)
    return tuple(out)


def build_train_batch(
    scored: ScoredBatch,
    old_logprobs: tuple[torch.Tensor, ...] | None,
    ref_logprobs: tuple[torch.Tensor, ...] | None,
    cfg: AlgorithmConfig,
) -> tuple[TrainBatch, dict[str, float]]:
    """Advantages for every response token (``algorithm.adv_estimator``, looked up in
    `packrl.registry.ADVANTAGE_ESTIMATORS`) and the batch the update consumes.

    With ``algorithm.kl_in_reward`` and a reference model, each response's reward is lowered by
    ``kl_coef x sum_t KL_t`` over the tokens the policy generated (verl's in-reward KL) before the advantage is estimated.
    ``old_logprobs`` is None when the update is on-policy (`packrl.config.plan.BatchPlan`). The
    batch's ``scored.rewards`` are the rewards the advantages were computed from (KL-shaped if asked).

    Returns:
        ``(batch, metrics)``; metrics hold ``seqlen/masked_tokens/truncated`` (loss tokens removed
        by ``algorithm.truncated=mask``) and, with in-reward KL, ``critic/kl_in_reward/mean``.

    Raises:
        ValueError: an unknown estimator, or one that does not return one value per response token.
    """
    rewards = scored.rewards.clone()
    metrics: dict[str, float] = {}
    generated = tuple(r.generated_mask() for r in scored.rollout.responses)
    if cfg.kl_in_reward and ref_logprobs is not None:
        assert old_logprobs is not None, "in-reward KL needs the old log-probs"
        seq_kl = torch.stack([kl_penalty(old, ref, cfg.kl_estimator)[g].sum()  # the policy's tokens only, not tool answers
                              for old, ref, g in zip(old_logprobs, ref_logprobs, generated)])
        rewards = rewards - cfg.kl_coef * seq_kl
        metrics["critic/kl_in_reward/mean"] = seq_kl.mean().item()
    inputs = AdvantageInputs(scored=scored, rewards=rewards, response_masks=generated, old_logprobs=old_logprobs,
                             ref_logprobs=ref_logprobs, cfg=cfg)
    advantages = check_advantages(ADVANTAGE_ESTIMATORS.lookup(cfg.adv_estimator)(inputs), inputs)
    masks = loss_masks(scored, cfg.truncated)
    metrics["seqlen/masked_tokens/truncated"] = float(sum(int((g & ~m).sum()) for g, m in zip(generated, masks)))
    batch = TrainBatch(replace(scored, rewards=rewards), advantages, masks, old_logprobs, ref_logprobs)
    return batch, metrics
