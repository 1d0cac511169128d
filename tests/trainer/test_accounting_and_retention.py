"""RUN_DIR/data_accounting.json accounts for every row; train.keep_last prunes only after a newer checkpoint is complete."""

from __future__ import annotations

import pytest

from packrl.config import ConfigError, load_config
from packrl.seqlen.prompt_policy import PromptAccounting, RowOutcome
from packrl.worker.checkpoint import prune_checkpoints


def test_accounting_dict_has_every_row_and_totals_that_sum():
    acc = PromptAccounting((RowOutcome(0, "kept", "", 10), RowOutcome(1, "truncated", "20 -> 16 tokens (left)", 20, 4),
                            RowOutcome(2, "filtered", "30 tokens > 16", 30), RowOutcome(3, "rejected", "missing field 'answer'")))
    d = acc.to_dict()
    t = d["totals"]
    assert t == {"num_rows": 4, "num_kept": 1, "num_truncated": 1, "num_filtered": 1, "num_rejected": 1, "num_tokens_removed": 4}
    assert t["num_kept"] + t["num_truncated"] + t["num_filtered"] + t["num_rejected"] == t["num_rows"]
    assert [r["row"] for r in d["rows"]] == [0, 1, 2, 3] and d["rows"][3]["reason"] == "missing field 'answer'"


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 10, 3):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / ".tmp-step_11").mkdir()  # an interrupted write: not a checkpoint
    deleted = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_11", "step_10", "step_3"]


@pytest.mark.parametrize("value", [0, -1])
def test_keep_last_must_be_positive(value):
    with pytest.raises(ConfigError, match="train.keep_last"):
        load_config("demo", [f"train.keep_last={value}"])


def test_skip_counter_counts_and_stops_after_max_consecutive(caplog):
    from packrl.worker.optim import SkipCounter

    skips = SkipCounter(max_consecutive=3)
    assert skips.record(1.5) is False
    assert skips.record(float("nan")) is True and skips.record(float("inf")) is True
    assert skips.record(0.7) is False and (skips.total, skips.consecutive) == (2, 0)  # a finite step resets the run
    assert skips.record(float("nan")) and skips.record(float("nan"))
    with pytest.raises(ValueError, match=r"3 optimizer steps in a row .*train.max_consecutive_skips=3"):
        skips.record(float("nan"))
    assert skips.total == 5
    assert "optimizer step skipped" in caplog.text


def test_skip_counter_state_round_trips():
    from packrl.worker.optim import SkipCounter

    skips = SkipCounter(max_consecutive=5)
    skips.record(float("nan")), skips.record(1.0), skips.record(float("inf"))
    restored = SkipCounter(max_consecutive=5)
    restored.load_state_dict(skips.state_dict())
    assert (restored.total, restored.consecutive) == (2, 1)
    restored.load_state_dict({})  # a checkpoint written before the counter was saved
    assert (restored.total, restored.consecutive) == (0, 0)


def test_a_nan_loss_skips_the_optimizer_step_counts_it_and_stops_the_run():
    import dataclasses
    from types import SimpleNamespace

    import torch

    from packrl.distributed.local import local_group
    from packrl.trainer.batch import build_train_batch
    from tests.builders import scored_batch
    from tests.conftest import tiny_llama

    cfg = load_config("demo", ["model.dtype=fp32", "train.lr=1e-2", "data.batch_size=2", "train.max_consecutive_skips=2"])
    model = tiny_llama()
    workers = local_group(cfg, model, SimpleNamespace(eos_token_id=2, pad_token_id=0))
    before = [p.detach().clone() for p in model.parameters()]
    batch, _ = build_train_batch(scored_batch(), None, None, cfg.algorithm)
    nan_batch = dataclasses.replace(batch, advantages=tuple(torch.full_like(a, float("nan")) for a in batch.advantages))
    metrics = workers.update(nan_batch)
    assert metrics["train/skipped_steps"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step taken
    metrics = workers.update(batch)  # finite: resets the run of skips
    assert metrics["train/skipped_steps"] == 1.0 and workers.transport.worker.opt.skips.consecutive == 0
    workers.update(nan_batch)
    with pytest.raises(ValueError, match="train.max_consecutive_skips=2"):
        workers.update(nan_batch)


@pytest.mark.parametrize("value", [0, -2])
def test_max_consecutive_skips_must_be_positive(value):
    with pytest.raises(ConfigError, match="train.max_consecutive_skips"):
        load_config("demo", [f"train.max_consecutive_skips={value}"])


def test_disk_too_small_for_one_checkpoint_fails_before_the_model_loads(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from packrl.distributed import open_worker_group
    from packrl.testing import tiny_llama_config
    from packrl.worker import policy
    from packrl.worker.checkpoint import checkpoint_bytes

    tiny_llama_config().save_pretrained(tmp_path / "model")
    cfg = load_config("demo", [f"model.path={tmp_path / 'model'}"])
    needed = checkpoint_bytes(cfg)
    lora = checkpoint_bytes(load_config("demo", [f"model.path={tmp_path / 'model'}", "model.lora.rank=2"]))
    assert lora < needed
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * needed, 9 * needed, needed - 1))
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(ValueError, match=rf"train.out_dir=.* \({needed - 1:,} bytes\) free, less than the .* \({needed:,} bytes\) "
                                         r"one checkpoint needs.*model.lora.rank=16"):
        with open_worker_group(cfg, tmp_path):
            pass
    lora_cfg = load_config("demo", [f"model.path={tmp_path / 'model'}", "model.lora.rank=2"])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * needed, 9 * needed, lora - 1))
    with pytest.raises(ValueError, match="one checkpoint needs") as err:
        with open_worker_group(lora_cfg, tmp_path):
            pass
    assert "model.lora.rank" not in str(err.value)  # LoRA is on already


def test_a_flaky_reward_is_retried_once_and_a_broken_one_names_the_response(caplog):
    from packrl.config.schema import RewardConfig
    from packrl.reward.registry import register_reward
    from packrl.reward.score import score_rollout
    from tests.builders import scored_batch

    calls = {"flaky": 0}

    @register_reward("test_flaky_once")
    def flaky(text, truth, **kw):
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise TimeoutError("verifier timed out")
        return 1.0

    @register_reward("test_always_broken")
    def broken(text, truth, **kw):
        raise KeyError("boxed")

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x"] * len(ids)

    rollout = scored_batch().rollout
    cfg = RewardConfig(name="test_flaky_once")
    scored = score_rollout(rollout, Tok(), cfg, 64)
    assert scored.scores.tolist() == [1.0] * len(rollout) and calls["flaky"] == len(rollout) + 1
    assert "retrying once" in caplog.text
    cfg = RewardConfig(name="test_always_broken")
    with pytest.raises(RuntimeError, match=r"failed twice on response 0 \(data_source='t', ground truth '1'\): KeyError"):
        score_rollout(rollout, Tok(), cfg, 64)


def test_generation_is_retried_once_then_names_the_rows():
    from packrl.config.plan import BatchPlan
    from packrl.config.update_spec import UpdateSpec
    from packrl.distributed.group import WorkerGroup
    from packrl.distributed.local import InProcess
    from packrl.rollout.engine import SamplingParams
    from packrl.types import Response
    from packrl.worker.policy import WorkerInfo
    from tests.builders import scored_batch

    prompts = scored_batch().rollout.prompts
    attempts = []

    class Worker:  # only generation is needed
        def __init__(self, failures):
            self.failures = failures

        def generate(self, prompt_ids, params, seeds):
            attempts.append(1)
            if len(attempts) <= self.failures:
                raise MemoryError("out of memory")
            return [[Response((3,), "eos")] * params.n for _ in prompt_ids]

    def group(failures: int) -> WorkerGroup:  # the demo preset's sizes: 8 prompts x 4 responses, one process, on-policy
        plan = BatchPlan(num_prompts=8, group_size=4, update=UpdateSpec(mini_batch_size=8), num_ranks=1, sequence_parallel_size=1,
                         loss_scale_factor=64, has_reference=False, needs_old_logprobs=False, max_response_tokens=64)
        return WorkerGroup(plan=plan, tokenizer=None, transport=InProcess(Worker(failures)),
                           info=WorkerInfo(512, 1.0, "test"))

    out = group(failures=1).generate(prompts, SamplingParams(n=2, max_response_tokens=4))
    assert len(out) == 4 and len(attempts) == 2
    attempts.clear()
    with pytest.raises(RuntimeError, match=r"generation failed twice for data rows \[0, 1\]: MemoryError"):
        group(failures=2).generate(prompts, SamplingParams(n=2, max_response_tokens=4))


def test_the_training_data_errors_know_the_model_context(tmp_path, smollm_tokenizer):
    """`packrl train` reads the model's config before its data: a prompt longer than the context
    leaves (8,192 - 64 response tokens) gets no prompt budget it cannot hold as its fix."""
    import json
    import shutil

    from packrl.models.loading import resolve_policy
    from packrl.trainer.loop import _datasets
    from tests.conftest import SMOLLM_DIR

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(SMOLLM_DIR / "config.json", model / "config.json")
    rows = [{"question": "Tom has " + "many apples and " * 3000 + "one pear. How many fruits?", "answer": "#### 2"},
            {"question": "What is 2 + 2?", "answer": "#### 4"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("demo", [f"model.path={model}", f"data.train_files=[{data}]", "data.overlong_prompt=error",
                               "data.batch_size=1", "rollout.max_response_tokens=64"])
    with pytest.raises(ValueError, match=r"no data\.max_prompt_tokens fits a [\d,]+-token prompt \(the model context 8,192 - "
                                         r"rollout\.max_response_tokens=64 leaves 8,128\)"):
        _datasets(cfg, resolve_policy(cfg.model, smollm_tokenizer))
