"""The worker group's side of the memory features: activation offload in the update's context,
the LoRA reference with adapters disabled, and checkpoints of the wrong kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from packrl.config import load_config
from packrl.config.schema import LoraConfig
from packrl.distributed import local
from packrl.distributed.local import LocalWorkerGroup, load_weights
from packrl.models.loading import load_reference
from packrl.models.lora import apply_lora
from packrl.trainer.actor import update_minibatch
from packrl.trainer.batch import build_train_batch
from tests.conftest import tiny_llama
from tests.trainer.test_on_policy import _scored

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
SIZES = ["model.dtype=fp32", "data.batch_size=2", "data.max_prompt_tokens=4", "rollout.max_response_tokens=8",
         "train.max_tokens_per_microbatch=16"]


def spy_on_offload(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Replace the group's `save_on_cpu` by one that records each entry (its pin_memory) and
    each tensor it packs; it offloads exactly as the real one."""
    record = SimpleNamespace(entries=[], packed=0)

    class Spy(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
            inner = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory, device_type=device_type)
            record.entries.append(pin_memory)

            def pack(tensor):
                record.packed += 1
                return inner.pack_hook(tensor)

            super().__init__(pack, inner.unpack_hook)

    monkeypatch.setattr(local, "save_on_cpu", Spy)
    return record


@pytest.fixture
def offload_spy(monkeypatch):
    return spy_on_offload(monkeypatch)


def _update_grads(offload: bool) -> dict[str, torch.Tensor]:
    cfg = load_config("demo", [*SIZES, f"model.activation_offload={str(offload).lower()}"])
    workers = LocalWorkerGroup(cfg, tiny_llama(), TOKENIZER)
    batch, _ = build_train_batch(_scored(), None, None, cfg.algorithm)
    update_minibatch(workers.model, batch, list(range(4)), cfg, workers.update_context)
    return {n: p.grad.clone() for n, p in workers.model.named_parameters()}


def test_activation_offload_packs_saved_tensors_and_keeps_the_gradients(offload_spy):
    plain = _update_grads(offload=False)
    assert offload_spy.entries == [] and offload_spy.packed == 0
    offloaded = _update_grads(offload=True)
    assert offload_spy.entries == [False, False]  # one entry per micro-batch; pinned only on CUDA
    assert offload_spy.packed > 50  # every tensor the forwards saved went through it
    for name, g in offloaded.items():
        torch.testing.assert_close(g, plain[name], rtol=0, atol=0, msg=name)


def test_the_update_runs_its_forwards_in_the_offload_context(offload_spy, caplog):
    cfg = load_config("demo", [*SIZES, "model.activation_offload=true"])
    with caplog.at_level("WARNING"):
        workers = LocalWorkerGroup(cfg, tiny_llama(), TOKENIZER)
    assert "model.activation_offload=true on cpu" in caplog.text
    batch, _ = build_train_batch(_scored(), None, None, cfg.algorithm)
    metrics = workers.update(batch)
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])) and offload_spy.packed > 0


def test_lora_reference_is_the_policy_with_its_adapter_disabled():
    cfg = load_config("demo", [*SIZES, "model.lora.rank=4", "algorithm.kl_coef=0.1"])
    model = apply_lora(tiny_llama(), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    reference = load_reference(model)
    assert reference is model  # no second copy of the weights
    workers = LocalWorkerGroup(cfg, model, TOKENIZER, reference)
    assert workers.optimizer.param_groups[0]["params"] == [p for p in model.parameters() if p.requires_grad]
    assert "policy: 4,096 trainable of 28,896 parameters (14.17%); LoRA rank 4" in workers.model_summary
    rollout = _scored().rollout
    ref = workers.compute_logprobs(rollout, "ref").logprobs
    base = LocalWorkerGroup(load_config("demo", SIZES), tiny_llama(), TOKENIZER, tiny_llama())
    expected = base.compute_logprobs(rollout, "ref").logprobs
    for a, b in zip(ref, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    workers.on_policy = False  # score the actor too: the adapter is back on
    actor = workers.compute_logprobs(rollout, "actor").logprobs
    assert max((a - b).abs().max() for a, b in zip(actor, expected)) > 1e-3


def test_lora_config_with_a_plain_model_is_an_error():
    cfg = load_config("demo", [*SIZES, "model.lora.rank=4"])
    with pytest.raises(ValueError, match=r"model.lora.rank=4 but the model given has no LoRA adapters.*load_policy"):
        LocalWorkerGroup(cfg, tiny_llama(), TOKENIZER)


def test_an_adapter_checkpoint_names_the_lora_keys_for_a_full_model(tmp_path):
    model = apply_lora(tiny_llama(), LoraConfig(rank=8))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter instead: set model.lora.rank=8"):
        load_weights(tiny_llama(), tmp_path)


def test_fp32_lora_generation_runs_on_the_adapted_policy():
    from packrl.models.lora import merged_copy
    from packrl.rollout.engine import SamplingParams

    cfg = load_config("demo", [*SIZES, "model.lora.rank=4"])
    model = apply_lora(tiny_llama(), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    workers = LocalWorkerGroup(cfg, model, TOKENIZER)
    assert workers.rollout_model is model  # float32: the peft model itself generates, adapters on
    prompts = _scored().rollout.prompts
    greedy = SamplingParams(n=1, temperature=0.0, max_response_tokens=8)
    responses = [r.response_ids for r in workers.generate(prompts, greedy).responses]
    merged = [r.response_ids for r in LocalWorkerGroup(load_config("demo", SIZES), merged_copy(model), TOKENIZER)
              .generate(prompts, greedy).responses]
    base = [r.response_ids for r in LocalWorkerGroup(load_config("demo", SIZES), tiny_llama(), TOKENIZER)
            .generate(prompts, greedy).responses]
    assert responses == merged and responses != base
