"""Truncation comes from finish reasons (invariant 7): clip ratio, masking, and denominators."""

from __future__ import annotations

import pytest
import torch

from packrl.algos.loss_agg import LossDenominators
from packrl.config.schema import AlgorithmConfig
from packrl.diagnostics.metrics import rollout_metrics
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch


def _scored(reasons=("length", "context", "eos"), lengths=(8, 5, 3)) -> ScoredBatch:
    prompts = PromptBatch(((1, 2, 3),), ("4",), ("openai/gsm8k",), (0,), (False,))
    responses = tuple(Response(tuple(range(10, 10 + n)), reason) for reason, n in zip(reasons, lengths))
    rollout = RolloutBatch(prompts, len(responses), responses)
    rewards = torch.tensor([0.0, 0.0, 1.0])
    return ScoredBatch(rollout, rewards, rewards)


def test_clip_ratio_and_reasons_come_from_the_engine():
    metrics = rollout_metrics(_scored().rollout)
    assert metrics["response_length/clip_ratio"] == pytest.approx(2 / 3)
    assert metrics["response/finish_reason/length"] == pytest.approx(1 / 3)
    assert metrics["response/finish_reason/context"] == pytest.approx(1 / 3)
    assert metrics["response/finish_reason/eos"] == pytest.approx(1 / 3)
    assert metrics["response_length/max"] == 8 and metrics["response_length/min"] == 3


def test_a_cap_that_equals_the_width_is_not_truncation_by_itself():
    """Two responses of the same width: only the one the engine cut counts as clipped."""
    metrics = rollout_metrics(_scored(reasons=("length", "eos", "eos"), lengths=(8, 8, 8)).rollout)
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 3)


def test_mask_removes_truncated_responses_from_loss_and_denominators():
    scored = _scored()
    old = tuple(torch.zeros(len(r.response_ids)) for r in scored.rollout.responses)
    batch, metrics = build_train_batch(scored, old, None, AlgorithmConfig(truncated="mask"))
    assert [int(m.sum()) for m in batch.loss_masks] == [0, 0, 3]
    assert metrics["seqlen/masked_tokens/truncated"] == 13.0
    den = LossDenominators.from_masks(batch.loss_masks, loss_scale_factor=8)
    assert (den.num_tokens, den.num_sequences) == (3, 1)
    kept, _ = build_train_batch(scored, old, None, AlgorithmConfig(truncated="keep"))
    assert [int(m.sum()) for m in kept.loss_masks] == [8, 5, 3]
