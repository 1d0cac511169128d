"""End to end on a tiny random model: two GRPO steps through the real loop, metrics, checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from packrl.config import load_config
from packrl.config.schema import ModelConfig
from packrl.distributed.local import local_group
from packrl.models.loading import load_policy
from packrl.trainer.loop import train
from tests.diagnostics.tiny_run import tiny_policy  # also registers the reward test_letter_e

REQUIRED_KEYS = [
    "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/max", "prompt_length/min", "critic/score/mean",
    "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv", "timing_s/update_actor",
    "perf/throughput", "perf/total_num_tokens", "seqlen/pad_fraction", "seqlen/num_microbatches",
    "seqlen/microbatch_tokens_max", "response/finish_reason/eos", "response/finish_reason/length",
    "response/finish_reason/context", "response/finish_reason/stop", "prompt/kept", "val/accuracy",
]


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_two_steps_train_log_and_checkpoint(tmp_path, tokenizer, loss_agg_mode):
    cfg = load_config("demo", [
        f"train.out_dir={tmp_path / 'run'}", "train.total_steps=2", "train.save_every=1", "train.val_every=2",
        "data.batch_size=2", "data.max_val_rows=3", "rollout.n=3", "rollout.max_response_tokens=12",
        "model.dtype=fp32", "algorithm.kl_coef=0.01", "train.lr=1e-3", "train.mini_batch_size=1",
        "train.max_tokens_per_microbatch=192", f"algorithm.loss_agg_mode={loss_agg_mode}", "reward.name=test_letter_e",
        "train.keep_last=1",
    ])
    model = tiny_policy(tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    workers = local_group(cfg, model, tokenizer)
    run_dir = train(cfg, workers)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    accounting = json.loads((run_dir / "data_accounting.json").read_text())
    for split in ("train", "val"):  # length invariant 6, in the run's own record
        totals, rows = accounting[split]["totals"], accounting[split]["rows"]
        assert len(rows) == totals["num_rows"] == sum(totals[k] for k in ("num_kept", "num_truncated", "num_filtered", "num_rejected"))
    for line in lines:
        missing = [k for k in REQUIRED_KEYS if k not in line and not (k.startswith("val/") and line["step"] == 1)]
        assert not missing, f"step {line['step']} lacks {missing}"
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(line[key]), key
        assert line["seqlen/pad_fraction"] == 0.0
        assert line["seqlen/microbatch_tokens_max"] <= 192
        reasons = sum(line[f"response/finish_reason/{r}"] for r in ("eos", "stop", "length", "context", "abort"))
        assert reasons == pytest.approx(1.0)
    assert lines[1]["actor/kl_loss"] != 0.0  # the policy moved away from the reference
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    checkpoint = run_dir / "checkpoints" / "step_2"
    assert not (run_dir / "checkpoints" / "step_1").exists() and checkpoint.is_dir()  # train.keep_last=1
    assert not any(p.name.startswith(".tmp") for p in (run_dir / "checkpoints").iterdir())
    reloaded, reloaded_tokenizer = load_policy(ModelConfig(path=str(checkpoint)))
    for name, param in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], param, rtol=0, atol=0, msg=name)
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    restored = local_group(cfg, reloaded, reloaded_tokenizer).load_checkpoint(checkpoint)
    assert restored["step"] == 2 and "sampler" in restored


def test_bf16_generation_copy_follows_the_trained_weights(tmp_path, tokenizer):
    cfg = load_config("demo", [
        f"train.out_dir={tmp_path / 'run'}", "train.total_steps=1", "data.batch_size=2", "rollout.n=2",
        "rollout.max_response_tokens=8", "model.dtype=bf16", "train.lr=1e-2", "reward.name=test_letter_e",
        "data.val_files=[]",
    ])
    model = tiny_policy(tokenizer)
    workers = local_group(cfg, model, tokenizer)
    engine_model = workers.transport.worker.engine.model
    assert engine_model is not model and next(engine_model.parameters()).dtype == torch.bfloat16
    assert not workers.plan.needs_old_logprobs
    before = [p.detach().clone() for p in engine_model.parameters()]
    train(cfg, workers)
    for twin, param in zip(engine_model.parameters(), model.parameters()):
        assert torch.equal(twin, param.detach().to(torch.bfloat16))
    assert any(not torch.equal(a, b) for a, b in zip(before, engine_model.parameters()))


def test_compiled_layers_train_as_the_eager_run(tmp_path, tokenizer):
    """``model.compile=true`` through the real loop (float32: the engine generates on the policy
    itself, eagerly): step 1's losses and gradient norm match an eager run's."""
    runs = {}
    for compiled in (False, True):
        cfg = load_config("demo", [
            f"train.out_dir={tmp_path / str(compiled)}", "train.total_steps=2", "train.save_every=0", "train.val_every=0",
            "data.batch_size=2", "data.val_files=[]", "rollout.n=3", "rollout.max_response_tokens=12", "model.dtype=fp32",
            "algorithm.kl_coef=0.01", "train.lr=1e-3", "reward.name=test_letter_e", f"model.compile={str(compiled).lower()}",
        ])
        model = tiny_policy(tokenizer)
        torch._dynamo.reset()  # compiles afresh, so the run's own compiled frames are counted
        torch._dynamo.utils.counters.clear()
        run_dir = train(cfg, local_group(cfg, model, tokenizer))
        assert bool(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == compiled
        runs[compiled] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(runs[True]) == 2
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "response_length/mean"):
        assert runs[True][0][key] == pytest.approx(runs[False][0][key], rel=1e-4, abs=1e-6), key
