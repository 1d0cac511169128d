"""Sequence-length management: budgets, prompt policy, packing, micro-batching, balancing,
chunked log-probs. Pure functions, unit-testable on CPU.

Names are imported on first use, so config-only tools (``packrl config``) do not load torch.
"""

from packrl._lazy import lazy_exports

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
    "chunked_logprobs": "chunked",
    "full_logprobs": "chunked",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("packrl.seqlen", _EXPORTS)
