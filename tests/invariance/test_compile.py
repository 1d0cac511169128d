"""Compiled decoder layers (``model.compile``, `packrl.models.compile`) join the invariance suite:
the compiled log-prob and update passes give the eager passes' log-probs (1e-5, float32) and
gradients, over shared-prompt packs split across micro-batches, with and without gradient
activation offload; generation outside them stays eager. Gradient checkpointing cannot combine
with them (torch.utils.checkpoint disables torch.compile inside), so that is refused."""

from __future__ import annotations

import pytest
import torch

from packrl.config import load_config
from packrl.errors import ConfigError
from packrl.models.compile import CompiledLayers, active, decoder_layers
from packrl.seqlen import chunked
from packrl.worker.policy import ActivationOffload
from tests.builders import shared_prompt_batch, shared_prompt_config
from tests.conftest import minibatch_grads, score_of, tiny_llama


def _grads(model, batch, cfg, compiled=None, context=None):
    model.zero_grad(set_to_none=True)
    with active(compiled):
        loss = minibatch_grads(model, batch, cfg, context=context, share_prompts=True)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("offload", [False, True])
def test_compiled_layers_give_the_eager_logprobs_and_gradients(offload):
    batch = shared_prompt_batch()
    cfg = shared_prompt_config("seq-mean-token-mean", budget=40)  # several micro-batches; groups split across them
    model = tiny_llama()
    model.train()
    context = (lambda: ActivationOffload("cpu")) if offload else None
    eager_lp, eager_ent = score_of(model, batch.rollout, cfg, share_prompts=True)
    eager_loss, eager_grads = _grads(model, batch, cfg, context=context)
    compiled = CompiledLayers(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with active(compiled):
        lp, ent = score_of(model, batch.rollout, cfg, share_prompts=True)
    loss, grads = _grads(model, batch, cfg, compiled, context=context)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    for a, b in zip(lp + ent, eager_lp + eager_ent):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert loss == pytest.approx(eager_loss, rel=1e-5, abs=1e-6)
    scale = max(g.abs().max().item() for g in eager_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))  # eager again outside


def test_generation_outside_the_passes_stays_eager():
    model = tiny_llama()
    compiled = CompiledLayers(model)
    with active(compiled):
        assert all(layer.forward is f for layer, f in zip(decoder_layers(model), compiled.forwards))
        assert chunked._COMPILED.get()  # the LM head's softmax math too
    assert not chunked._COMPILED.get()
    counts = torch._dynamo.utils.counters["stats"]["calls_captured"]
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == counts


def test_a_model_without_a_layer_stack_is_refused():
    with pytest.raises(ValueError, match="no ModuleList named 'layers' or 'h'; set model.compile=false"):
        CompiledLayers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_compile_where_it_cannot_run_is_refused_unless_left_to_packrl():
    with pytest.raises(ConfigError,
                       match=r"cannot run with trainer.num_workers=2 .*set model.compile=null \(on where it can run\) or false"):
        load_config("demo", ["model.compile=true", "trainer.num_workers=2"])
    with pytest.raises(ConfigError, match="model.gradient_checkpointing=true .torch.utils.checkpoint runs its layers with torch.compile"):
        load_config("demo", ["model.compile=true", "model.gradient_checkpointing=true"])
    for blocker in ("trainer.num_workers=2", "model.gradient_checkpointing=true"):  # the preset's null: eager there
        cfg = load_config("gsm8k", [blocker])
        assert cfg.model.compile is None and cfg.model.compile_blocker(cfg.trainer.num_workers)
    assert load_config("gsm8k").model.compile_blocker(1) is None


def test_the_compiled_critic_gives_the_eager_values():
    import contextlib

    from packrl.worker.critic import ValueModel, compute_values
    from packrl.worker.packs import PackForward

    lm = tiny_llama()
    critic = ValueModel(lm.get_decoder(), lm.config, head_std=0.02)
    rollout = shared_prompt_batch().rollout
    run = lambda: compute_values(critic, rollout, [tuple(range(len(rollout)))], context=contextlib.nullcontext,  # noqa: E731
                                 forward=PackForward("varlen", 1024, 1.0, share_prompts=True))
    eager = run()
    with active(CompiledLayers(critic)):
        compiled = run()
    for (values, bootstrap), (eager_values, eager_bootstrap) in zip(compiled, eager):
        torch.testing.assert_close(values, eager_values, atol=1e-5, rtol=1e-5)
        assert bootstrap == pytest.approx(eager_bootstrap, abs=1e-5)


def test_compiled_lora_layers_give_the_eager_adapter_gradients_and_base_logprobs():
    """A LoRA policy compiles through peft's layers; its reference (the same model with the adapter
    off, `base_policy`) runs the same compiled twins."""
    from packrl.config.schema import LoraConfig
    from packrl.models.lora import apply_lora, base_policy

    batch = shared_prompt_batch()
    cfg = shared_prompt_config("token-mean", budget=40)
    model = apply_lora(tiny_llama(), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # adapters that change the output
    model.train()
    eager_loss, eager_grads = _grads(model, batch, cfg)
    with base_policy(model):
        eager_base = score_of(model, batch.rollout, cfg, share_prompts=True)[0]
    compiled = CompiledLayers(model)
    loss, grads = _grads(model, batch, cfg, compiled)
    with base_policy(model), active(compiled):
        base = score_of(model, batch.rollout, cfg, share_prompts=True)[0]
    assert loss == pytest.approx(eager_loss, rel=1e-5, abs=1e-6)
    assert grads.keys() == eager_grads.keys() and all("lora_" in name for name in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    for a, b in zip(base, eager_base):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
