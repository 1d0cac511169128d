"""End to end with every memory feature on: a tiny model directory trained for two GRPO steps with
LoRA rank 4, gradient checkpointing and activation offload; the KL reference is the base model
(adapter disabled), and the checkpoint restores the adapter exactly."""

from __future__ import annotations

import json
import math
import shutil

import torch
from transformers import LlamaForCausalLM

import tests.diagnostics.tiny_run  # noqa: F401  (registers the reward test_letter_e these runs train with)
from packrl.config import load_config
from packrl.config.schema import ModelConfig
from packrl.distributed.local import local_group
from packrl.models.loading import load_policy
from packrl.testing import tiny_llama_config
from packrl.trainer.loop import train
from packrl.types import PromptBatch, Response, RolloutBatch
from tests.conftest import SMOLLM_DIR, score_of


def _tiny_dir(d, tokenizer):
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer=tokenizer)).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(SMOLLM_DIR / name, d / name)
    return d


def _rollout() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    prompts = PromptBatch(((5, 60, 700), (8000, 9)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(tuple(torch.randint(3, 49152, (n,), generator=g).tolist()), "eos") for n in (4, 7, 2, 5))
    return RolloutBatch(prompts, 2, responses)


def test_lora_checkpointing_offload_two_steps(tmp_path, tokenizer):
    model_dir = _tiny_dir(tmp_path / "tiny", tokenizer)
    cfg = load_config("demo", [
        f"model.path={model_dir}", "model.lora.rank=4", "model.lora.alpha=8", "model.gradient_checkpointing=true",
        "model.activation_offload=true", "model.dtype=bf16", f"train.out_dir={tmp_path / 'run'}", "train.total_steps=2",
        "train.save_every=1", "data.batch_size=2", "data.val_files=[]", "rollout.n=3", "rollout.max_response_tokens=12",
        "algorithm.kl_coef=0.01", "train.lr=1e-2", "train.mini_batch_size=1", "train.max_tokens_per_microbatch=192",
        "reward.name=test_letter_e",
    ])
    workers = local_group(cfg)
    worker = workers.transport.worker
    model = worker.model
    assert worker.reference is model  # the reference is the adapter-disabled policy, not a copy
    assert model.get_base_model().model.layers[0].gradient_checkpointing
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert {id(p) for p in worker.optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters() if p.requires_grad}

    run_dir = train(cfg, workers)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(line[key]), key
    assert lines[1]["actor/kl_loss"] != 0.0  # the adapter moved the policy away from the base model
    assert all(line["perf/offloaded_activation_gib"] > 0 for line in lines)  # the saved activations went to host memory
    summary = (run_dir / "model.txt").read_text()
    assert "LoRA rank 4, alpha 8 on 14 Linear layers" in summary and "gradient checkpointing on" in summary
    assert "activation offload on" in summary

    # only the adapters changed; the base weights are bit-identical
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    assert any(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if n in adapters)

    # the bf16 rollout copy holds the merged weights W + (alpha / r) B A of the trained adapter
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    merged = layer.base_layer.weight + layer.get_delta_weight("default")
    twin_weight = worker.engine.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(twin_weight, merged.detach().to(torch.bfloat16))
    assert not torch.equal(twin_weight, layer.base_layer.weight.detach().to(torch.bfloat16))

    # the reference log-probs are the base model's, bit for bit: scored with the packs the worker
    # group uses (shared prompts), the two passes multiply the same operands in the same order
    rollout = _rollout()
    base_model, _ = load_policy(ModelConfig(path=str(model_dir)))
    expected = score_of(base_model, rollout, cfg, worker.autocast, share_prompts=workers.share_prompts)[0]
    for a, b in zip(workers.compute_logprobs(rollout, "ref").logprobs, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    trained = score_of(model, rollout, cfg, worker.autocast, share_prompts=workers.share_prompts)[0]
    assert max((a - b).abs().max() for a, b in zip(trained, expected)) > 0

    # the checkpoint holds the adapter alone and restores it exactly
    checkpoint = run_dir / "checkpoints" / "step_2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= files
    assert "model.safetensors" not in files
    restored_group = local_group(cfg)
    restored = restored_group.transport.worker
    assert restored_group.load_checkpoint(checkpoint)["step"] == 2
    for (name, a), b in zip(model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    again = score_of(restored.model, rollout, cfg, restored.autocast, share_prompts=workers.share_prompts)[0]
    for a, b in zip(again, trained, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(restored.engine.model.parameters(), worker.engine.model.parameters(), strict=True):
        assert torch.equal(a, b)
