"""Skipping the old-log-prob forward on-policy changes nothing: the update with old log-probs
recomputed equals the update that uses its own detached log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from packrl.config import load_config
from packrl.distributed.local import local_group
from packrl.trainer.batch import build_train_batch
from tests.builders import scored_batch
from tests.conftest import logprobs_of, tiny_llama


def _step(with_old: bool) -> list[torch.Tensor]:
    cfg = load_config("demo", ["model.dtype=fp32", "train.lr=1e-2", "data.batch_size=2"])
    model = tiny_llama()
    workers = local_group(cfg, model, SimpleNamespace(eos_token_id=2, pad_token_id=0))
    assert not workers.plan.needs_old_logprobs
    scored = scored_batch()
    old = tuple(logprobs_of(model, scored.rollout, cfg)) if with_old else None
    batch, _ = build_train_batch(scored, old, None, cfg.algorithm)
    workers.update(batch)
    return [p.detach().clone() for p in model.parameters()]


def test_on_policy_update_equals_update_with_recomputed_old_logprobs():
    for a, b in zip(_step(with_old=True), _step(with_old=False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
