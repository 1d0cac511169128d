"""packrl.testing: the shared tiny model and the mini-batch objective."""

from __future__ import annotations

import torch

from packrl.config.schema import AlgorithmConfig
from packrl.testing import minibatch_objective, tiny_llama, tiny_llama_config


def test_the_tiny_llama_is_the_seeds_and_the_tokenizers(smollm_tokenizer):
    a, b, c = tiny_llama(seed=3), tiny_llama(seed=3), tiny_llama(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    config = tiny_llama_config(tokenizer=smollm_tokenizer, num_hidden_layers=1)
    assert (config.vocab_size, config.tie_word_embeddings) == (len(smollm_tokenizer), True)
    assert config.eos_token_id == smollm_tokenizer.eos_token_id
    assert config.num_hidden_layers == 1 and config.num_key_value_heads == 2  # overrides win, the rest is the tiny shape
    assert tiny_llama(dtype=torch.float64).model.embed_tokens.weight.dtype == torch.float64


def test_the_objective_is_the_policy_loss_plus_kl_minus_entropy():
    metrics = {"actor/pg_loss": 0.5, "actor/kl_loss": 2.0, "actor/entropy": 3.0}
    assert minibatch_objective(metrics, AlgorithmConfig(kl_coef=0.1, entropy_coeff=0.01)) == 0.5 + 0.1 * 2.0 - 0.01 * 3.0
