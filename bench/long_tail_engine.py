"""A rollout engine for `bench/bench_long_tail.py`: the HF engine on the real model, with a scripted
long tail. Loaded as a plugin (``trainer.plugins=[bench/long_tail_engine.py]``), it registers
``rollout.engine=hf_long_tail``.

Every response is the model's own sample, except that a fixed fraction of them may not end: for
those the EOS ids are banned at every step, so they run to their cap (``rollout.max_response_tokens``,
finish reason ``length``). Which responses are long is a function of the request's sampling seed
alone (`packrl.rollout.engine.request_seed`), so a response cut by a partial rollout and resumed
later stays long, and both arms of the benchmark draw the same share. The fraction comes from the
environment variable ``PACKRL_BENCH_TAIL_FRACTION`` (default 0.03).

This is the workload the long tail is about (most responses short, a few at the budget), made
repeatable on a model whose own lengths do not reach a 1,024-token budget.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from packrl.capabilities import HF_ENGINE
from packrl.registry import ROLLOUT_ENGINES
from packrl.rollout.engine import EngineContext, SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.rollout.weights import rollout_copy

TAIL_FRACTION = float(os.environ.get("PACKRL_BENCH_TAIL_FRACTION", "0.03"))


def is_long(seed: int, fraction: float = TAIL_FRACTION) -> bool:
    """Whether the response sampled under request seed ``seed`` runs to its cap."""
    return random.Random(seed).random() < fraction


class _BanEos(LogitsProcessor):
    """Scores of the EOS ids set to -inf for the batch rows ``rows``."""

    def __init__(self, rows: Sequence[int], eos_ids: Sequence[int]) -> None:
        self.rows = torch.tensor(list(rows), dtype=torch.long)
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = self.rows.to(scores.device)
        scores[rows[:, None], self.eos.to(scores.device)[None, :]] = float("-inf")
        return scores


class LongTailEngine(HFEngine):
    """`HFEngine` whose responses under a "long" seed (`is_long`) cannot end before their cap."""

    def _generate_kwargs(self, params: SamplingParams, *, max_new_tokens: int, generators: Sequence[torch.Generator],
                         seeds: Sequence[int], positions: Sequence[int]) -> dict[str, Any]:
        kwargs = super()._generate_kwargs(params, max_new_tokens=max_new_tokens, generators=generators, seeds=seeds,
                                          positions=positions)
        rows = [i for i, seed in enumerate(seeds) if is_long(seed)]
        if rows:
            processors = kwargs.get("logits_processor") or LogitsProcessorList()
            processors.insert(0, _BanEos(rows, sorted(self.eos_ids)))  # before the sampler draws
            kwargs["logits_processor"] = processors
        return kwargs


@ROLLOUT_ENGINES.register("hf_long_tail", info=HF_ENGINE)
def build_long_tail_engine(context: EngineContext) -> LongTailEngine:
    """As the ``hf`` engine (`packrl.rollout.hf_engine.build_hf_engine`), with the scripted tail."""
    compute = context.compute_dtype
    dtype = compute.torch_dtype() if compute.autocast or not context.may_share_policy else None
    model = rollout_copy(context.policy, dtype)
    return LongTailEngine(model, context.tokenizer, max_context_tokens=context.max_context_tokens,
                          max_num_seqs=context.options.max_num_seqs, shares_policy=model is context.policy)
