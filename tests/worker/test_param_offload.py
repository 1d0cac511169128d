"""``model.param_offload``: refused without FSDP2 (config) or without CUDA (set-up), counted in
host memory by the estimate; on a CUDA machine, one FSDP2 rank trains with its shards on the CPU."""

from __future__ import annotations

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.config.plan import BatchPlan
from packrl.inspect.memory import GIB, ModelShape, estimate_memory
from packrl.inspect.preflight import preflight
from packrl.testing import tiny_llama_config
from packrl.worker.optim import Optimization, SkipCounter, adamw, clip_grad_norm, optimizer_step
from packrl.worker.policy import PolicyWorker
from packrl.worker.strategy import FSDP2, weight_layout
from tests.conftest import tiny_llama

OFFLOADED = ("parameters", "gradients", "optimizer states (AdamW)")


def _shape() -> ModelShape:
    return ModelShape.from_config(tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4))


def test_one_process_is_refused_at_config_time_with_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["model.param_offload=true"])
    (problem,) = [p for p in err.value.problems if p.key == "model.param_offload"]
    assert "trainer.num_workers=1" in problem.message and "trainer.num_workers >= 2" in problem.fix
    assert load_config("demo", ["model.param_offload=true", "trainer.num_workers=2"]).model.param_offload


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for ranks without CUDA")
def test_a_rank_without_cuda_is_refused_at_set_up_with_the_reason_and_the_fix():
    cfg = load_config("demo", ["model.param_offload=true", "trainer.num_workers=2"])
    with pytest.raises(ValueError, match=r"model.param_offload=true .* rank 1 runs on cpu .* set model.param_offload=false"):
        PolicyWorker(cfg, BatchPlan.from_config(cfg), rank=1, world_size=2)
    assert FSDP2(0, 2, True).param_offload is False  # without the setting nothing changes


@pytest.mark.parametrize("workers", [2, 4])
def test_the_estimate_moves_shards_gradients_and_states_to_host_memory(workers):
    shape = _shape()
    base = ["model.dtype=fp32", f"trainer.num_workers={workers}"]
    sharded = load_config("demo", base)
    offloaded = load_config("demo", [*base, "model.param_offload=true"])
    assert weight_layout(workers, param_offload=True).params_on_host and not weight_layout(workers, param_offload=False).params_on_host
    assert not weight_layout(1, param_offload=True).params_on_host, "one process holds no shards to offload"
    on_device = estimate_memory(sharded, shape, device="cuda", tokens_per_microbatch=1024)
    off = estimate_memory(offloaded, shape, device="cuda", tokens_per_microbatch=1024)
    for part in OFFLOADED:
        assert off.parts[part] == 0 and off.host[part] == on_device.parts[part] > 0, part
    assert off.host["optimizer step temporaries"] == 4 * shape.num_params // workers
    for part in ("gathered parameters (FSDP2)", "rollout engine copy", "activations", "logits chunk"):
        assert off.parts[part] == on_device.parts[part], part  # these stay on the device
    assert not on_device.host and "host memory per rank" in off.table() and off.to_dict()["host_bytes"] == off.host
    held = sum(v for k, v in off.host.items() if k not in ("gradients", "optimizer step temporaries"))
    assert on_device.phases["generation"] - off.phases["generation"] == held  # weights, reference, moments
    assert off.phases["update"] < on_device.phases["update"]
    assert estimate_memory(offloaded, shape, device="cpu", tokens_per_microbatch=1024).host == {}  # RSS holds all


def test_preflight_proposes_offload_when_fsdp2_weights_do_not_fit(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    over = [f"model.path={tmp_path}", "trainer.num_workers=2"]
    report = preflight("demo", over, device_memory_gib=0.01, device="cuda")
    problem = next(p for p in report.problems if p.key == "train.max_tokens_per_microbatch")
    assert "model.param_offload=true" in problem.fix
    cpu = preflight("demo", over, device_memory_gib=0.01, device="cpu")
    assert "param_offload" not in next(p for p in cpu.problems if p.key == "train.max_tokens_per_microbatch").fix


def test_clip_grad_norm_is_torchs_for_tensors_on_their_device():
    model, twin = tiny_llama(), tiny_llama()
    for m in (model, twin):
        m(input_ids=torch.arange(12)[None]).logits.square().mean().backward()
    norm = clip_grad_norm(list(model.parameters()), 0.01)
    expected = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.01)
    assert norm == pytest.approx(float(expected))
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_offloaded_fsdp2_rank_trains_with_its_shards_in_host_memory():
    strategy = FSDP2(0, 1, True, param_offload=True)
    strategy.join(strategy.listen())
    try:
        model = tiny_llama().to(strategy.device)
        reference = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        strategy.wrap(model)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        optimizer = adamw(list(model.parameters()), lr=1e-2, weight_decay=0.0)  # fused over CPU DTensor shards
        opt = Optimization(optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                           skips=SkipCounter(3), grad_clip=1.0)
        model(input_ids=torch.arange(12, device=strategy.device)[None]).logits.float().square().mean().backward()
        grad_norm, _ = optimizer_step(model, opt)
        assert grad_norm > 0 and torch.cuda.memory_allocated() < 10 * GIB
        weights = dict(strategy.rollout_weights(model))
        assert {w.device.type for w in weights.values()} == {"cuda"}
        assert any(not torch.equal(weights[n].cpu(), reference[n]) for n in reference)
    finally:
        strategy.close()
