"""The policy worker's side of the memory features: activation offload in the update's context,
the LoRA reference with adapters disabled, and checkpoints of the wrong kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from packrl.config import load_config
from packrl.config.schema import LoraConfig
from packrl.distributed.local import local_group
from packrl.models.lora import apply_lora
from packrl.trainer.batch import build_train_batch
from packrl.worker.checkpoint import load_weights
from tests.builders import scored_batch
from tests.conftest import logprobs_of, tiny_llama

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
SIZES = ["model.dtype=fp32", "data.batch_size=2", "data.max_prompt_tokens=4", "rollout.max_response_tokens=8",
         "train.max_tokens_per_microbatch=16"]


def _update(offload: bool) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One real update of the tiny policy: parameters after it, metrics, bytes offloaded."""
    cfg = load_config("demo", [*SIZES, f"model.activation_offload={str(offload).lower()}"])
    workers = local_group(cfg, tiny_llama(), TOKENIZER)
    batch, _ = build_train_batch(scored_batch(), None, None, cfg.algorithm)
    metrics = workers.update(batch)
    worker = workers.transport.worker
    return {n: p.detach().clone() for n, p in worker.model.named_parameters()}, metrics, worker.offloaded_bytes


def test_activation_offload_moves_saved_tensors_and_keeps_the_update():
    plain, plain_metrics, none = _update(offload=False)
    assert none == 0 and "perf/offloaded_activation_gib" not in plain_metrics
    offloaded, metrics, moved = _update(offload=True)
    assert moved > 100_000  # every tensor the forwards saved for the backward went through the hook
    assert metrics["perf/offloaded_activation_gib"] == pytest.approx(moved / 2**30)
    for name, p in offloaded.items():
        torch.testing.assert_close(p, plain[name], rtol=0, atol=0, msg=name)


def test_activation_offload_on_cpu_warns_that_it_only_copies(caplog):
    cfg = load_config("demo", [*SIZES, "model.activation_offload=true"])
    with caplog.at_level("WARNING"):
        local_group(cfg, tiny_llama(), TOKENIZER)
    assert "model.activation_offload=true on cpu" in caplog.text


def _adapted_policy() -> torch.nn.Module:
    """The tiny policy with rank-4 adapters whose B is random (so the adapters change the outputs)."""
    model = apply_lora(tiny_llama(), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_lora_reference_is_the_policy_with_its_adapter_disabled():
    cfg = load_config("demo", [*SIZES, "model.lora.rank=4", "algorithm.kl_coef=0.1"])
    model = _adapted_policy()
    workers = local_group(cfg, model, TOKENIZER)
    worker = workers.transport.worker
    assert worker.reference is model  # no second copy of the weights
    assert worker.optimizer.param_groups[0]["params"] == [p for p in model.parameters() if p.requires_grad]
    assert "policy: 4,096 trainable of 28,896 parameters (14.17%); LoRA rank 4" in workers.model_summary
    rollout = scored_batch().rollout
    ref = workers.compute_logprobs(rollout, "ref").logprobs
    expected = logprobs_of(tiny_llama(), rollout, cfg)  # the base model the adapters were put on
    for a, b in zip(ref, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    actor = logprobs_of(model, rollout, cfg)  # the adapter is back on
    assert max((a - b).abs().max() for a, b in zip(actor, expected)) > 1e-3


def test_lora_config_with_a_plain_model_is_an_error():
    cfg = load_config("demo", [*SIZES, "model.lora.rank=4"])
    with pytest.raises(ValueError, match=r"model.lora.rank=4 but the model given has no LoRA adapters.*load_policy"):
        local_group(cfg, tiny_llama(), TOKENIZER)


def test_an_adapter_checkpoint_names_the_lora_keys_for_a_full_model(tmp_path):
    model = apply_lora(tiny_llama(), LoraConfig(rank=8))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter instead: set model.lora.rank=8"):
        load_weights(tiny_llama(), tmp_path)


def test_fp32_lora_generation_runs_on_the_adapted_policy():
    from packrl.models.lora import merged_copy
    from packrl.rollout.engine import SamplingParams

    cfg = load_config("demo", [*SIZES, "model.lora.rank=4"])
    model = _adapted_policy()
    workers = local_group(cfg, model, TOKENIZER)
    assert workers.transport.worker.engine.model is model  # float32: the peft model itself generates, adapters on
    prompts = scored_batch().rollout.prompts
    greedy = SamplingParams(n=1, temperature=0.0, max_response_tokens=8)
    responses = [r.response_ids for r in workers.generate(prompts, greedy).responses]
    merged = [r.response_ids for r in local_group(load_config("demo", SIZES), merged_copy(model), TOKENIZER)
              .generate(prompts, greedy).responses]
    base = [r.response_ids for r in local_group(load_config("demo", SIZES), tiny_llama(), TOKENIZER)
            .generate(prompts, greedy).responses]
    assert responses == merged and responses != base
