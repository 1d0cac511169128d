"""The hf engine's copy of the policy: what generation runs on when ``model.dtype=bf16``, and how
new weights reach it (`HFEngine.load_weights`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import profile

from packrl.rollout.hf_engine import HFEngine
from packrl.rollout.weights import rollout_copy
from tests.conftest import tiny_llama

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)


def test_rollout_copy_casts_parameters_only_and_follows_loaded_weights():
    model = tiny_llama()
    twin = rollout_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters())
    assert all(b.dtype == torch.float32 for b in twin.buffers())  # RoPE frequencies as in training
    # packrl_sdpa: grouped KV heads stay grouped under a padding mask on the CPU (transformers' SDPA repeats them)
    assert twin.config._attn_implementation == "packrl_sdpa" and model.config._attn_implementation == "packrl_sdpa"
    plain = tiny_llama(attn="eager")
    plain.config._attn_implementation = "sdpa"  # a policy left on plain SDPA: its copy gets packrl_sdpa too
    assert rollout_copy(plain, torch.bfloat16).config._attn_implementation == "packrl_sdpa"
    assert not twin.training and rollout_copy(model, None) is model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    engine = HFEngine(twin, TOKENIZER, max_context_tokens=64, max_num_seqs=4)
    engine.load_weights(model.named_parameters())
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(b, a.to(torch.bfloat16))
    with pytest.raises(ValueError, match="has no parameter 'nope.weight'"):
        engine.load_weights([("nope.weight", torch.zeros(1))])


def test_an_engine_on_the_policy_itself_reads_no_weights():
    model = tiny_llama()
    engine = HFEngine(model, TOKENIZER, max_context_tokens=64, max_num_seqs=4, shares_policy=True)

    def weights():
        raise AssertionError("a shared engine must not read the weights")
        yield

    engine.load_weights(weights())


def test_prefill_lm_head_never_expands_the_weight():
    # Frozen weights send the LM head on strided hidden states through a bmm over a copy of
    # the weight expanded per row; the copy must keep the plain matmul.
    model = tiny_llama(vocab_size=4096)
    twin = rollout_copy(model, torch.bfloat16)
    ids = torch.randint(4, 4096, (8, 12))
    with torch.no_grad(), profile(record_shapes=True) as prof:
        twin.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not [e for e in prof.events() if e.name == "aten::bmm" and 4096 in (e.input_shapes[1] or [0])[-1:]]
