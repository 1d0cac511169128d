"""The HF engine's appending KV cache: the same keys and values as transformers' concatenating
`DynamicLayer`, through growth, row selection, cropping and repeats; the same generation."""

from __future__ import annotations

import torch
from transformers import DynamicCache, MistralConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from packrl.rollout.hf_engine import _CACHE_KEY
from packrl.rollout.kv_cache import AppendingLayer, appending_cache
from tests.conftest import tiny_llama


def _states(rows: int, positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, positions, 4, generator=gen), torch.randn(rows, 2, positions, 4, generator=gen)


def _assert_same(got: DynamicLayer, want: DynamicLayer) -> None:
    assert got.get_seq_length() == want.get_seq_length()
    torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=0)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=0)


def test_appending_layer_holds_what_concatenation_holds(monkeypatch):
    monkeypatch.setattr(AppendingLayer, "GROWTH_TOKENS", 3)  # grow often
    got, want = AppendingLayer(), DynamicLayer()
    assert got.get_seq_length() == 0
    for step, positions in enumerate([5, 1, 1, 4, 1, 7, 1]):
        states = _states(4, positions, step)
        out = got.update(*states)
        assert out[0] is got.keys and out[0].shape == (4, 2, got.get_seq_length(), 4)
        want.update(*states)
        _assert_same(got, want)
    rows = torch.tensor([3, 0, 0])
    got.batch_select_indices(rows)
    want.batch_select_indices(rows)
    _assert_same(got, want)
    for layer in (got, want):
        layer.update(*_states(3, 2, 99))
        layer.crop(-3)
        layer.batch_repeat_interleave(2)
        layer.update(*_states(6, 1, 100))
    _assert_same(got, want)
    got.reset()
    assert got.get_seq_length() == 0 and not got.is_initialized


def test_appending_cache_keeps_sliding_window_layers():
    config = MistralConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, sliding_window=4)
    cache = appending_cache(config)
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)
    llama = appending_cache(tiny_llama().config)
    assert [type(layer) for layer in llama.layers] == [AppendingLayer, AppendingLayer]


def test_generation_over_the_appending_cache_equals_transformers_own(monkeypatch):
    monkeypatch.setattr(AppendingLayer, "GROWTH_TOKENS", 7)
    model = tiny_llama().eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0, eos_token_id=None)
    want = model.generate(**kwargs, **{_CACHE_KEY: DynamicCache(config=model.config)})
    got = model.generate(**kwargs, **{_CACHE_KEY: appending_cache(model.config)})
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-6)

