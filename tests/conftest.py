"""Shared fixtures: a tiny random Llama (float32) and the SmolLM2 tokenizer from ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.models.attention import use_packed_attention

SHARED = Path(os.environ.get("PACKRL_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SMOLLM_DIR = SHARED / "models" / "smollm2-135m-instruct"


def tiny_llama(*, attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 97) -> LlamaForCausalLM:
    """A 2-layer random Llama with GQA. Its config keeps transformers' default use_cache=True,
    the setting under which naive packing leaks across sequences."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype)
    if attn == "sdpa":
        use_packed_attention(model)
    return model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    if not (SMOLLM_DIR / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 tokenizer not found under {SMOLLM_DIR} (set PACKRL_SHARED to the shared/ folder)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM_DIR)



def score_of(model, rollout, cfg, context=None, share_prompts: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs and entropy of every response of ``rollout`` under ``model``, planned and restored
    to rollout order as the worker group does for one rank (`packrl.seqlen.update_plan.PassPlanner.scoring`)."""
    import contextlib
    from dataclasses import replace

    from packrl.config.plan import BatchPlan
    from packrl.worker.actor import compute_logprobs
    from packrl.worker.packs import PackForward

    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=share_prompts), num_ranks=1)
    patches = rollout.image_patches()
    plan = planner.scoring(rollout.sequence_lengths(), [rollout.prompt_ids_of(i) for i in range(len(rollout))],
                           None if patches is None else planner.vision(*patches))
    forward = PackForward.from_config(cfg, share_prompts)
    values = plan.restore([compute_logprobs(model, rollout, plan.ranks[0].microbatches, forward=forward,
                                           context=context or contextlib.nullcontext)])
    return [lp for lp, _ in values], [ent for _, ent in values]


def logprobs_of(model, rollout, cfg, context=None) -> list[torch.Tensor]:
    """The log-probs of `score_of`."""
    return score_of(model, rollout, cfg, context)[0]


def minibatch_grads(model, batch, cfg, context=None, num_ranks: int = 1, groups=None, units=None, share_prompts: bool = False) -> float:
    """Forward and backward the first mini-batch of ``batch`` through the update's micro-batch path
    (`packrl.worker.actor.actor_microbatches`) as the controller's planner plans it
    (`packrl.seqlen.update_plan.PassPlanner.update`) for ``num_ranks`` simulated ranks (each
    rank's micro-batches in turn, gradients summed as an all-reduce SUM does); no optimizer step.
    Returns the mini-batch loss (policy loss + KL - entropy bonus, summed over micro-batches and ranks)."""
    import contextlib
    from dataclasses import replace

    from packrl.config.plan import BatchPlan
    from packrl.seqlen.update_plan import groups_of
    from packrl.worker.actor import MicrobatchLoss, ResponseSums, actor_microbatches

    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=share_prompts), num_ranks=num_ranks, num_epochs=1)
    rollout = batch.rollout
    groups = groups_of(len(rollout), rollout.group_size) if groups is None else groups
    patches = rollout.image_patches()
    update = planner.update(rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                            [rollout.prompt_ids_of(i) for i in range(len(rollout))], groups=groups, units=units,
                            vision=None if patches is None else planner.vision(*patches))
    loss = MicrobatchLoss.from_config(cfg, share_prompts)
    minibatch = update.minibatches[0]
    sums = ResponseSums.zeros(len(batch.rollout))
    total = 0.0
    for rank in range(num_ranks):
        totals = actor_microbatches(model, batch, minibatch.microbatches(rank), den=minibatch.denominators, loss=loss,
                                  context=context or contextlib.nullcontext, sums=sums)
        metrics = totals.metrics
        algo = cfg.algorithm
        total += metrics["actor/pg_loss"] + algo.kl_coef * metrics["actor/kl_loss"] - algo.entropy_coeff * metrics["actor/entropy"]
    return total


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer):
    """The tiny random policy (tests/diagnostics/tiny_run.py) saved as an HF model folder, as the workers load it."""
    from tests.diagnostics.tiny_run import tiny_policy  # it imports this module

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_policy(smollm_tokenizer).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path
