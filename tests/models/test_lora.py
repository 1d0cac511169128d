"""LoRA through peft: targets, trainable parameters, the base policy, the merged copy, adapter
files, and gradient checkpointing on the packed update path."""

from __future__ import annotations

import contextlib

import pytest
import torch

from packrl.config.schema import LoraConfig
from packrl.models.loading import enable_gradient_checkpointing
from packrl.models.logprobs import pack_logprobs
from packrl.models.lora import apply_lora, base_policy, load_adapter, merged_copy, merged_weights, parameter_counts
from packrl.seqlen.packing import pack_sequences
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch
from tests.builders import pass_config
from tests.conftest import minibatch_grads, tiny_llama

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(rank: int = 4, targets=PROJECTIONS, seed: int = 0) -> torch.nn.Module:
    return apply_lora(tiny_llama(seed=seed), LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=list(targets)))


def _perturb_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the adapter is then a no-op); give it values, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _pack():
    g = torch.Generator().manual_seed(0)
    return pack_sequences([torch.randint(3, 97, (n,), generator=g) for n in (7, 12, 5)])


def _logprobs(model, pack) -> torch.Tensor:
    with torch.no_grad():
        return pack_logprobs(model, pack).token_logprobs


def test_only_adapters_train_and_the_wrapped_model_starts_as_the_base():
    base = tiny_llama()
    pack = _pack()
    before = _logprobs(base, pack)
    model = apply_lora(base, LoraConfig(rank=4, alpha=8.0, target_modules=PROJECTIONS))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x (q 4*(32+32) + k 4*(32+16) + v 4*(32+16) + o 4*(32+32) + 3 MLP 4*(32+64)) = 2 x 2048
    assert parameter_counts(model) == (4096, parameter_counts(tiny_llama())[1] + 4096)
    torch.testing.assert_close(_logprobs(model, pack), before, rtol=0, atol=0)  # B = 0


def test_all_linear_passes_through_and_leaves_the_lm_head_alone():
    model = apply_lora(tiny_llama(), LoraConfig(rank=2, target_modules=["all-linear"]))
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    from peft.tuners.lora import LoraLayer

    adapted = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)})
    assert adapted == sorted(PROJECTIONS) and sum(isinstance(m, LoraLayer) for m in model.modules()) == 14


@pytest.mark.parametrize(("targets", "message"), [
    (["q_proj", "qkv_proj"], r"\['qkv_proj'\] match no Linear module.*\['down_proj', 'gate_proj', 'k_proj'.*model.lora.target_modules"),
    (["lm_head"], r"LM head 'lm_head'.*set model.lora.target_modules"),
])
def test_bad_targets_name_the_model_linear_modules(targets, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(tiny_llama(), LoraConfig(rank=2, target_modules=targets))


def test_base_policy_runs_without_the_adapter_and_restores_it():
    model = _lora()
    _perturb_adapters(model)
    pack = _pack()
    base = _logprobs(tiny_llama(), pack)
    adapted = _logprobs(model, pack)
    assert (adapted - base).abs().max() > 1e-3
    with base_policy(model):
        torch.testing.assert_close(_logprobs(model, pack), base, rtol=0, atol=0)
    torch.testing.assert_close(_logprobs(model, pack), adapted, rtol=0, atol=0)
    assert isinstance(base_policy(tiny_llama()), contextlib.nullcontext)


def test_merged_copy_equals_the_adapted_model_and_follows_the_merged_weights():
    model = _lora()
    _perturb_adapters(model, seed=1)
    twin = merged_copy(model)
    assert type(twin).__name__ == "LlamaForCausalLM" and all(p.requires_grad for p in twin.parameters())
    pack = _pack()
    torch.testing.assert_close(_logprobs(twin, pack), _logprobs(model, pack), rtol=1e-5, atol=1e-5)
    _perturb_adapters(model, seed=2)
    assert (_logprobs(twin, pack) - _logprobs(model, pack)).abs().max() > 1e-3  # stale until synced
    params = dict(twin.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        names = [name for name, value in merged_weights(model) if params[name].copy_(value) is not None]
    assert sorted(names) == sorted(params)  # every weight of the plain model under its own name, no adapter
    torch.testing.assert_close(_logprobs(twin, pack), _logprobs(model, pack), rtol=1e-5, atol=1e-5)
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    expected = layer.base_layer.weight + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(twin.model.layers[1].mlp.down_proj.weight, expected, rtol=0, atol=1e-7)  # Hu et al. 2021, Eq. 3


def test_adapter_files_round_trip_exactly_and_reject_another_rank(tmp_path):
    model = _lora()
    _perturb_adapters(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}
    fresh = _lora()
    load_adapter(fresh, tmp_path / "ckpt")
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match=r"r=4, but this model has 8; set model.lora.rank=4"):
        load_adapter(_lora(rank=8), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"adapters on .*set model.lora.target_modules"):
        load_adapter(_lora(targets=["q_proj", "v_proj"]), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        load_adapter(fresh, tmp_path)


def test_an_adapter_file_without_every_tensor_of_the_model_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from packrl.models.lora import read_adapter

    model = _lora()
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(read_adapter(_lora(), tmp_path)) == {n for n, _ in model.named_parameters() if n.endswith("default.weight")}
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"does not match the model's adapters: missing \['{dropped}'\], unexpected \[\]"):
        load_adapter(_lora(), tmp_path)
    save_file(tensors | {"base_model.model.extra.lora_A.weight": tensors[dropped].clone()}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['base_model.model.extra.lora_A.weight'\]"):
        load_adapter(_lora(), tmp_path)


# --- gradient checkpointing on the packed update ---------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = PromptBatch(((5, 6, 7), (8, 9)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(tuple(torch.randint(3, 97, (n,), generator=g).tolist()), "eos") for n in (4, 7, 2, 5))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    cfg = pass_config(batch_size=2, n=4, max_prompt_tokens=4, max_response_tokens=8, update_tokens=16)
    batch, _ = build_train_batch(ScoredBatch(RolloutBatch(prompts, 2, responses), rewards, rewards), None, None, cfg.algorithm)
    return batch, cfg


def _grads(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one packed mini-batch (two micro-batches), and how often layer 0's
    attention ran (twice per micro-batch when its activations are recomputed in the backward)."""
    batch, cfg = _batch()
    calls = []
    decoder = model.get_decoder()
    handle = decoder.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    minibatch_grads(model, batch, cfg)
    handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, len(calls)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_gradients(lora):
    def build():
        model = _lora() if lora else tiny_llama()
        if lora:
            _perturb_adapters(model)
        return model.train()

    plain, plain_calls = _grads(build())
    checkpointed = build()
    enable_gradient_checkpointing(checkpointed)
    grads, calls = _grads(checkpointed)
    assert calls == 2 * plain_calls > 0  # the backward recomputed the layer: checkpointing was on
    assert grads.keys() == plain.keys() and all(g.abs().sum() > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-6, atol=1e-7, msg=name)
