"""Sequence-length management: budgets, prompt policy, packing, micro-batching, balancing,
chunked log-probs. Pure functions, unit-testable on CPU.

Names are imported on first use, so config-only tools (``packrl config``) do not load torch.
"""

from importlib import import_module

_EXPORTS = {
    "Budgets": "budgets",
    "model_context_tokens": "budgets",
    "PolicyResult": "prompt_policy",
    "Prompt": "prompt_policy",
    "PromptAccounting": "prompt_policy",
    "RowOutcome": "prompt_policy",
    "apply_prompt_policy": "prompt_policy",
    "Pack": "packing",
    "pack_sequences": "packing",
    "restore_order": "packing",
    "MicrobatchPlan": "microbatch",
    "plan_microbatches": "microbatch",
    "sequence_costs": "microbatch",
    "RankPlan": "balance",
    "balance_ranks": "balance",
    "karmarkar_karp": "balance",
    "refine_partition": "balance",
    "chunked_logprobs": "chunked_logprobs",
    "full_logprobs": "chunked_logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'packrl.seqlen' has no attribute {name!r}")
    return getattr(import_module(f"packrl.seqlen.{_EXPORTS[name]}"), name)
