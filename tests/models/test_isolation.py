"""Packing for every layer type: tiny random models of the hybrid families the installed
transformers builds (LFM2 short convolutions, Jamba and Mamba state-space layers, Qwen3-Next
linear attention). A pack would leak one sequence's state into the next; packrl finds out at load
(config layer types and a self-check), trains them one sequence per micro-batch, and the
log-probs the training path computes equal each sequence alone. Attention-only models keep packing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from packrl.config import load_config
from packrl.models.isolation import TOLERANCE, check_packing, config_packing
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.packing import pack_sequences
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch
from tests.builders import FAMILIES, hybrid_model
from tests.conftest import tiny_llama

TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)


def _sequences():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g) for n in (11, 7, 9)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_hybrid_model_is_found_out_and_trained_one_sequence_per_micro_batch(family):
    model = hybrid_model(family)
    assert not config_packing(model.config).packs  # preflight says so from the config alone
    check = check_packing(model, "varlen")
    assert not check.packs and check.stateful_types and "packing: off" in check.describe()
    if check.max_diff is not None:  # the model took a packed row: the leak the check measured
        assert check.max_diff > 10 * TOLERANCE
    else:  # the model refused a packed row
        assert "refuses a packed forward" in check.detail
    seqs = _sequences()
    with torch.no_grad():
        alone = [pack_logprobs(model, pack_sequences([s]), attention="varlen").token_logprobs for s in seqs]

    # through packrl's training path: the worker group plans one sequence per micro-batch
    from packrl.distributed.local import local_group

    cfg = load_config("demo", ["model.dtype=fp32", "data.batch_size=3", "rollout.n=2", "train.ppo_epochs=2",
                               "train.max_tokens_per_logprob_microbatch=1000"])
    workers = local_group(cfg, model, TOKENIZER)
    assert not workers.packing.packs and "packing: off" in workers.model_summary
    assert "shared prompts: off (this model trains one sequence per micro-batch" in workers.model_summary
    prompts = PromptBatch(tuple(tuple(s[:4].tolist()) for s in seqs), ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3)
    responses = tuple(Response(tuple(s[4:].tolist()), "eos") for s in seqs for _ in range(2))
    rollout = RolloutBatch(prompts, 2, responses)
    result = workers.compute_logprobs(rollout, "actor")
    assert len(result.microbatches) == 6 and all(len(mb) == 1 for mb in result.microbatches)
    for i, got in enumerate(result.logprobs):
        torch.testing.assert_close(got, alone[i // 2][4:].float(), atol=1e-5, rtol=0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    from packrl.trainer.batch import build_train_batch

    batch, _ = build_train_batch(ScoredBatch(rollout, rewards, rewards), result.logprobs, None, cfg.algorithm)
    metrics = workers.update(batch)
    assert metrics["seqlen/num_microbatches"] == 2 * 6 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))


def test_an_attention_model_keeps_packing():
    model = tiny_llama()
    assert config_packing(model.config).packs
    check = check_packing(model, "varlen")
    assert check.packs and check.max_diff < TOLERANCE and "packing: on" in check.describe()


def test_a_pack_that_leaks_is_caught_by_the_self_check(monkeypatch):
    """Even with attention-only layer types, a packed forward that leaks turns packing off."""
    model = tiny_llama()

    def leaking(model, pack, attention="varlen"):  # a plain causal forward over the whole row: later sequences see earlier ones
        return model.get_decoder()(input_ids=pack.input_ids, use_cache=False).last_hidden_state[0]

    monkeypatch.setattr("packrl.models.attention.packed_forward", leaking)
    check = check_packing(model, "varlen")
    assert not check.packs and not check.stateful_types and check.max_diff > 100 * TOLERANCE
