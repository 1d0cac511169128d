"""Pre-packed bf16 Linear layers for CPU generation (`packrl.rollout.packed_linear`): the same
products up to bf16 rounding, the newest weights at every call, the plain layers back afterwards,
and nothing changed where it does not apply."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import profile

from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.rollout.packed_linear import packed_linears, packs
from packrl.rollout.weights import rollout_copy
from tests.conftest import tiny_llama

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU's oneDNN runs no bf16 matmuls")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@needs_bf16
def test_packed_layers_give_the_plain_products_up_to_bf16_rounding_and_leave_no_trace():
    policy = tiny_llama(vocab_size=512)
    twin = rollout_copy(policy, torch.bfloat16)
    ids = torch.randint(3, 512, (5, 9))
    plain, exact = _logits(twin, ids), _logits(policy, ids)
    with packed_linears(twin, num_rows=5):
        assert all("forward" in layer.__dict__ for layer in _linears(twin))
        packed = _logits(twin, ids)
    assert all("forward" not in layer.__dict__ for layer in _linears(twin))
    torch.testing.assert_close(packed, plain, atol=0.05, rtol=0.05)
    # no further from the float32 model than the plain bf16 layers are
    assert (packed - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-3
    torch.testing.assert_close(_logits(twin, ids), plain, atol=0, rtol=0)


@needs_bf16
def test_each_call_packs_the_weights_it_finds():
    twin = rollout_copy(tiny_llama(vocab_size=512), torch.bfloat16)
    ids = torch.randint(3, 512, (3, 7))
    with packed_linears(twin, num_rows=3):
        before = _logits(twin, ids)
    with torch.no_grad():
        for layer in _linears(twin):
            layer.weight.mul_(-1.5)
    with packed_linears(twin, num_rows=3):
        after = _logits(twin, ids)
    assert (after - before).abs().max() > 0.1
    torch.testing.assert_close(after, _logits(twin, ids), atol=0.05, rtol=0.05)


def test_nothing_packs_in_float32_and_plain_layers_run():
    model = tiny_llama()
    assert not packs(model)
    ids = torch.randint(3, 97, (2, 5))
    with packed_linears(model, num_rows=2):
        assert all("forward" not in layer.__dict__ for layer in _linears(model))
        torch.testing.assert_close(_logits(model, ids), _logits(tiny_llama(), ids))


@needs_bf16
def test_a_float32_input_meets_the_plain_layer_and_its_dtype_error():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with packed_linears(layer, num_rows=2), pytest.raises(RuntimeError):
        layer(torch.randn(2, 8))
    with packed_linears(layer, num_rows=2), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 8)).dtype == torch.bfloat16


@needs_bf16
@pytest.mark.parametrize(("pack", "min_tokens", "used"), [(True, 4, True), (False, 4, False), (True, 5, False)])
def test_the_engine_generates_on_packed_layers_when_asked_and_long_enough(pack, min_tokens, used):
    policy = tiny_llama(vocab_size=512)
    engine = HFEngine(rollout_copy(policy, torch.bfloat16), TOKENIZER, max_context_tokens=64, max_num_seqs=4)
    engine.options = replace(engine.options, pack_linears=pack, pack_min_tokens=min_tokens)
    with profile() as prof:
        groups = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, temperature=1.0, max_response_tokens=4), [1, 2])
    assert all(len(r.response_ids) >= 1 for g in groups for r in g)
    assert any(e.name == "mkldnn::_linear_pointwise" for e in prof.events()) is used
    assert all("forward" not in layer.__dict__ for layer in _linears(engine.model))


@needs_bf16
def test_contexts_nest_and_a_forward_of_its_own_is_kept():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    model = torch.nn.Sequential(layer, torch.nn.ReLU(), torch.nn.Linear(4, 4).to(torch.bfloat16))
    calls = []
    wrapper = model[2].forward = lambda x: calls.append(1) or torch.nn.Linear.forward(model[2], x)
    with packed_linears(model, 2):
        inner = layer.forward
        with packed_linears(model, 2):
            assert layer.forward is inner
        assert layer.forward is inner
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    assert "forward" not in layer.__dict__ and model[2].forward is wrapper and calls == [1]


@needs_bf16
def test_a_failure_while_packing_restores_the_layers_packed_so_far(monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8).to(torch.bfloat16) for _ in range(3)])
    reorder, count = torch.ops.mkldnn._reorder_linear_weight, []

    def failing(weight, rows):
        count.append(1)
        if len(count) == 3:
            raise RuntimeError("out of memory")
        return reorder(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", failing)
    with pytest.raises(RuntimeError, match="out of memory"), packed_linears(model, 2):
        pass
    assert all("forward" not in layer.__dict__ for layer in model)


@needs_bf16
def test_with_gradients_enabled_the_plain_layer_runs_and_gradients_flow():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    with packed_linears(layer, 3):
        layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@needs_bf16
def test_a_layer_with_a_float32_bias_is_not_packed():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    layer.bias.data = layer.bias.data.float()
    assert not packs(layer)
