"""Length-bucketed metrics, masked-token counts, train/rollout mismatch and the logger check,
each against a direct computation on a small known batch."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from packrl.algos.losses import kl_penalty
from packrl.config import load_config
from packrl.config.schema import AlgorithmConfig
from packrl.diagnostics.buckets import bucket_means, length_buckets
from packrl.diagnostics.metrics import bucket_metrics, rollout_mismatch_metrics
from packrl.distributed.local import local_group
from packrl.errors import ConfigError
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch
from tests.conftest import score_of, tiny_llama

M = 12  # rollout.max_response_tokens: buckets 0-3, 3-6, 6-9, 9-13
LENGTHS = (2, 4, 5, 12, 7, 11)
REASONS = ("eos", "eos", "stop", "length", "eos", "context")
SCORES = (1.0, 0.0, 1.0, 0.0, 0.5, 0.25)


def _scored(rollout_logprobs: bool = False) -> ScoredBatch:
    g = torch.Generator().manual_seed(0)
    prompts = PromptBatch(((5, 6, 7), (8, 9)), ("1", "2"), ("t", "t"), (0, 1), (False, True))
    responses = []
    for n, reason in zip(LENGTHS, REASONS):
        lps = tuple((-torch.rand(n, generator=g)).tolist()) if rollout_logprobs else None
        responses.append(Response(tuple(torch.randint(3, 97, (n,), generator=g).tolist()), reason, lps))
    scores = torch.tensor(SCORES)
    return ScoredBatch(RolloutBatch(prompts, 3, tuple(responses)), scores, scores)


def _cfg(*overrides: str):
    return load_config("demo", ["model.dtype=fp32", "data.batch_size=2", "rollout.n=3", f"rollout.max_response_tokens={M}",
                                "train.loggers=[]", *overrides])


def test_length_buckets_table():
    assert length_buckets(64) == [(0, 16), (16, 32), (32, 48), (48, 65)]
    assert length_buckets(12) == [(0, 3), (3, 6), (6, 9), (9, 13)]
    assert bucket_means("x", [1.0, None, 3.0, 5.0], [0, 1, 12, 9], 12) == {"bucket/x/0-3": 1.0, "bucket/x/9-13": 4.0}


def test_score_and_advantage_buckets_equal_direct_means():
    batch, _ = build_train_batch(_scored(), None, None, AlgorithmConfig(truncated="mask"))
    got = bucket_metrics(batch, M)
    adv = [float(a[0]) for a in batch.advantages]
    # lengths 2 | 4, 5 | 7 | 12, 11 (the two last truncated: no loss tokens, no advantage)
    assert got == pytest.approx({
        "bucket/score/0-3": 1.0, "bucket/score/3-6": 0.5, "bucket/score/6-9": 0.5, "bucket/score/9-13": 0.125,
        "bucket/advantage/0-3": adv[0], "bucket/advantage/3-6": (adv[1] + adv[2]) / 2, "bucket/advantage/6-9": adv[4],
    })


@pytest.mark.parametrize("truncated, expected", [("mask", 12 + 11), ("keep", 0)])
def test_masked_token_counts(truncated, expected):
    batch, metrics = build_train_batch(_scored(), None, None, AlgorithmConfig(truncated=truncated))
    assert metrics["seqlen/masked_tokens/truncated"] == expected
    assert sum(int((~m).sum()) for m in batch.loss_masks) == expected


def test_update_buckets_equal_direct_computation():
    cfg = _cfg("algorithm.kl_coef=0.1", "algorithm.kl_estimator=k3")
    model, scored = tiny_llama(), _scored()
    logprobs, entropy = score_of(model, scored.rollout, cfg)
    ref = tuple(lp - 0.1 * torch.arange(len(lp)) for lp in logprobs)  # a reference that differs per token
    old = tuple(lp + 0.3 * (-1) ** torch.arange(len(lp)) for lp in logprobs)  # clip active on some tokens
    batch, _ = build_train_batch(scored, old, ref, cfg.algorithm)
    got = local_group(cfg, model, SimpleNamespace(eos_token_id=2, pad_token_id=0)).update(batch)  # metrics before the step
    expected: dict[str, float] = {}
    per_kl, per_clip = [], []
    for lp, o, r, a in zip(logprobs, old, ref, batch.advantages):
        ratio = torch.exp(lp - o)
        clipped = -a * ratio.clamp(0.8, 1.2) > -a * ratio
        per_kl.append(kl_penalty(lp, r, "k3").mean().item())
        per_clip.append(clipped.float().mean().item())
    per_ent = [e.mean().item() for e in entropy]
    for name, values in (("kl", per_kl), ("entropy", per_ent), ("clipfrac", per_clip)):
        expected |= bucket_means(name, values, LENGTHS, M)
    assert {k: v for k, v in got.items() if k.startswith("bucket/")} == pytest.approx(expected, abs=1e-5)
    assert any(v > 0 for k, v in expected.items() if k.startswith("bucket/clipfrac/"))


def test_mismatch_zero_when_equal_positive_otherwise():
    rollout = _scored(rollout_logprobs=True).rollout
    same = tuple(torch.tensor(r.rollout_logprobs) for r in rollout.responses)
    zero = rollout_mismatch_metrics(rollout, same, M)
    assert zero["training/rollout_probs_diff_mean"] == 0.0 and zero["training/rollout_probs_diff_max"] == 0.0
    assert zero["training/rollout_probs_diff_std"] == 0.0
    assert {k for k in zero if "/pos_" in k} == {f"training/rollout_probs_diff_mean/pos_{lo}-{hi}" for lo, hi in length_buckets(M)}
    shifted = tuple(lp - 0.5 * (torch.arange(len(lp)) >= 6) for lp in same)  # mismatch only from position 6 on
    diff = rollout_mismatch_metrics(rollout, shifted, M)
    flat = torch.cat([(s.exp() - t.exp()).abs() for s, t in zip(same, shifted)])
    assert diff["training/rollout_probs_diff_mean"] == pytest.approx(flat.mean().item()) and diff["training/rollout_probs_diff_mean"] > 0
    assert diff["training/rollout_probs_diff_max"] == pytest.approx(flat.max().item())
    assert diff["training/rollout_probs_diff_std"] == pytest.approx(flat.std().item())
    assert diff["training/rollout_probs_diff_mean/pos_0-3"] == 0.0 and diff["training/rollout_probs_diff_mean/pos_9-13"] > 0
    assert rollout_mismatch_metrics(_scored().rollout, same, M) == {}  # no rollout log-probs
    assert rollout_mismatch_metrics(rollout, None, M) == {}  # no training log-probs


def test_missing_logger_package_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train\.loggers.*tensorboard package is not installed.*packrl\[tensorboard\]"):
        load_config("demo", ["train.loggers=[console,tensorboard]"])
    with pytest.raises(ConfigError, match=r"train\.loggers.*must be one of"):
        load_config("demo", ["train.loggers=[jsonll]"])
