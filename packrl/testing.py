"""What packrl's tests, its benches and a plugin's tests share: a tiny random Llama and the
mini-batch loss and gradients of the update's own micro-batch path.

- `tiny_llama_config` / `tiny_llama`: a 2-layer Llama with grouped-query attention (hidden 32, 4
  heads, 2 KV heads, 512 positions), small enough for a CPU test, random from a seed.
- `minibatch_grads`: one mini-batch forwarded and back-propagated as the update does it
  (`packrl.worker.actor.actor_microbatches` over the micro-batches `packrl.seqlen.update_plan`
  plans), for one or several simulated ranks; returns the mini-batch loss.
- `minibatch_objective`: that loss from a micro-batch pass's metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.config.plan import BatchPlan
from packrl.config.schema import AlgorithmConfig, RunConfig
from packrl.models.attention import use_packed_attention
from packrl.registry import Registry, import_plugins
from packrl.seqlen.update_plan import groups_of
from packrl.types import TrainBatch
from packrl.worker.actor import MicrobatchLoss, ResponseSums, actor_microbatches

TINY_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
"""The tiny Llama's dimensions (`tiny_llama_config`)."""


def tiny_llama_config(vocab_size: int = 97, *, tokenizer: Any = None, **overrides: Any) -> LlamaConfig:
    """The tiny Llama's config (`TINY_SHAPE`, then ``overrides``). With ``tokenizer`` (a Hugging
    Face tokenizer) the vocabulary is the tokenizer's, the embeddings are tied and the BOS, EOS and
    pad ids are the tokenizer's, so the model saves as a folder the workers load. The config keeps
    transformers' default ``use_cache=True``, the setting under which naive packing leaks across
    sequences."""
    fields: dict[str, Any] = {"vocab_size": vocab_size, **TINY_SHAPE}
    if tokenizer is not None:
        fields |= {"vocab_size": len(tokenizer), "tie_word_embeddings": True, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    return LlamaConfig(**(fields | overrides))


def tiny_llama(vocab_size: int = 97, *, tokenizer: Any = None, seed: int = 0, dtype: torch.dtype = torch.float32,
               attn: str = "sdpa", **overrides: Any) -> LlamaForCausalLM:
    """A random tiny Llama (`tiny_llama_config`) initialised after ``torch.manual_seed(seed)``, in
    ``dtype``, with attention ``attn``; under ``sdpa`` packrl's packed attention is installed
    (`packrl.models.attention.use_packed_attention`), so packed sequences stay apart."""
    torch.manual_seed(seed)
    config = tiny_llama_config(vocab_size, tokenizer=tokenizer, **overrides)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers types .to as a model method wrapper
    if attn == "sdpa":
        use_packed_attention(model)
    return model


def minibatch_objective(metrics: Mapping[str, Any], algorithm: AlgorithmConfig) -> float:
    """The mini-batch loss a micro-batch pass minimised, from its metrics: ``actor/pg_loss`` +
    ``algorithm.kl_coef`` x ``actor/kl_loss`` (0 when the KL is in the reward) -
    ``algorithm.entropy_coeff`` x ``actor/entropy`` (`packrl.worker.actor.microbatch_loss`)."""
    kl, entropy = metrics["actor/kl_loss"], metrics["actor/entropy"]
    return float(metrics["actor/pg_loss"] + algorithm.kl_coef * kl - algorithm.entropy_coeff * entropy)


def minibatch_grads(model: torch.nn.Module, batch: TrainBatch, cfg: RunConfig, context: Callable[[], Any] | None = None, *,
                    num_ranks: int = 1, groups: Sequence[int] | None = None, units: Sequence[int] | None = None,
                    share_prompts: bool = False, keep_masked: bool = False, draw: int = 0) -> float:
    """Forward and backward the first mini-batch of ``batch`` through the update's micro-batch
    path (`packrl.worker.actor.actor_microbatches`) as the controller plans it
    (`packrl.seqlen.update_plan.PassPlanner.update`; with ``keep_masked``, sequences without a
    loss token stay in the micro-batches) for ``num_ranks`` simulated ranks, each rank's
    micro-batches in turn, gradients summed in ``model`` as an all-reduce SUM sums them; LoRA
    dropout masks of ``draw``, the optimizer steps before it; no optimizer step.

    Returns:
        The mini-batch loss (`minibatch_objective`), summed over the ranks.
    """
    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=share_prompts), num_ranks=num_ranks, num_epochs=1)
    rollout = batch.rollout
    groups = groups_of(len(rollout), rollout.group_size) if groups is None else groups
    update = planner.update(rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                            [rollout.prompt_ids_of(i) for i in range(len(rollout))], groups=groups, units=units,
                            caps=planner.grouped_caps(*rollout.grouped_loads()), keep_masked=keep_masked)
    loss = MicrobatchLoss.from_config(cfg, share_prompts)
    minibatch = update.minibatches[0]
    sums = ResponseSums.zeros(len(rollout))
    total = 0.0
    for rank in range(num_ranks):
        totals = actor_microbatches(model, batch, minibatch.microbatches(rank), den=minibatch.denominators, loss=loss,
                                    context=context or contextlib.nullcontext, sums=sums, draw=draw)
        total += minibatch_objective(totals.metrics, cfg.algorithm)
    return total


def write_plugin(directory: Path, filename: str, text: str) -> Path:
    """Write ``text`` to ``directory / filename`` and import it as ``trainer.plugins`` does (its
    parts register); the file's path, for ``trainer.plugins=[...]``. A part's name registers once
    per process, so a test module writes its plugin once (a module-scoped fixture).

    Raises:
        ValueError: the file cannot be imported (the message holds `import_plugins`'s error).
    """
    path = directory / filename
    path.write_text(text)
    if failed := import_plugins([str(path)]):
        raise ValueError(f"plugin {path} cannot be imported: {failed}")
    return path


def forget_parts(registry: Registry, *names: str) -> None:
    """Unregister the parts ``names`` a test registered in ``registry`` (each part, its options and
    its declaration), so the tests after it see the built-in parts alone."""
    for table in (registry._parts, registry._options, registry._info):
        for name in names:
            table.pop(name, None)
