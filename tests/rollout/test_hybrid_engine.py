"""The HF engine on every hybrid family the installed transformers builds (LFM2 convolutions, Jamba
and Mamba SSM layers, Qwen3-Next and Qwen3.5 linear attention) and a Llama control: groups of 3
share a prefilled prompt, prompts of different lengths are left-padded in one batch, and rows that
finish leave the batch between rounds. Each response's engine log-probs equal the log-probs of
the sequence scored alone, as training scores it.

Tolerance: both sides are float32 computations of the same function (the engine's incremental
decode against one full forward), which agree to about 1e-6 nats here (9.5e-7 for every family
and the control). A cache row selected wrongly moves a log-prob by whole nats; a pure-Mamba cache
carried into a second generate call (it re-prefills on top of its own states) by 5e-4 to 4e-2.
1e-4 nats sits 100x above rounding and 5x below the smallest of those faults."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from packrl.models.logprobs import pack_logprobs
from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.rollout.kv_cache import cache_reuse, select_rows
from packrl.seqlen.packing import pack_sequences
from tests.builders import HYBRIDS, hybrid_model
from tests.conftest import tiny_llama

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
LIMIT_NATS = 1e-4  # see the module docstring
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [9, 10, 11], [13, 14, 15, 16, 17]]


def _model(family: str):
    return tiny_llama() if family == "llama" else hybrid_model(family)


@pytest.mark.parametrize("family", ["llama", *sorted(HYBRIDS)])
def test_engine_logprobs_equal_each_sequence_scored_alone(family):
    model = _model(family)
    engine = HFEngine(model, TOKENIZER, max_context_tokens=512, max_num_seqs=8)
    engine.options = replace(engine.options, round_tokens=8)  # several rounds within 48 tokens
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_response_tokens=48, return_logprobs=True), seeds=[1, 2, 3])
    lengths = sorted(len(r.response_ids) for group in out for r in group)
    assert lengths[0] < lengths[-1] and lengths[-1] > 2 * engine.options.round_tokens, "rows must leave the batch across rounds"
    worst = 0.0
    for prompt, group in zip(PROMPTS, out):
        for response in group:
            sequence = torch.tensor(prompt + list(response.response_ids))
            with torch.no_grad():
                alone = pack_logprobs(model, pack_sequences([sequence]), attention="varlen").token_logprobs
            got = torch.tensor(response.rollout_logprobs)
            worst = max(worst, float((alone[-len(got):] - got).abs().max()))
    assert worst <= LIMIT_NATS, f"{family}: engine vs trainer log-probs differ by {worst:.3g} nats"
    assert ("one generate call per batch" in engine.describe()) == (family == "mamba")


def test_a_cache_of_states_alone_is_never_carried_across_calls():
    """Pure Mamba: its cache cannot say how many positions it holds, so the engine lets the model
    build its own cache per batch, and says why."""
    reuse = cache_reuse(hybrid_model("mamba"))
    assert not reuse.reuses and "recurrent states" in reuse.reason
    assert cache_reuse(hybrid_model("lfm2")).reuses and cache_reuse(tiny_llama()).reuses


def test_select_rows_moves_conv_and_recurrent_states_with_their_rows():
    """After a prefill of two different rows, selecting rows [1, 1, 0] gives every layer's keys,
    values, conv and recurrent states of those rows, in that order."""
    model = _model("qwen3_next")
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), use_cache=True, past_key_values=cache)
    before = [_states(layer) for layer in cache.layers]
    select_rows(cache, torch.tensor([1, 1, 0]))
    for layer, old in zip(cache.layers, before, strict=True):
        new = _states(layer)
        assert new.keys() == old.keys() and new
        for name in new:
            torch.testing.assert_close(new[name], old[name][[1, 1, 0]], rtol=0, atol=0)


def _states(layer) -> dict[str, torch.Tensor]:
    """Every per-row tensor a cache layer holds, by name."""
    out = {}
    for name in ("keys", "values"):
        if isinstance(getattr(layer, name, None), torch.Tensor):
            out[name] = getattr(layer, name)
    for kind in ("conv_states", "recurrent_states"):
        for index, state in (getattr(layer, kind, None) or {}).items():
            if state is not None:
                out[f"{kind}[{index}]"] = state
    return out
