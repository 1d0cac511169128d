"""Sequence-length management, the length core: budgets, prompt policy, packing, micro-batching,
balancing, the update plan with its loss denominators, chunked log-probs and length statistics.
Pure functions on lengths and tensors, unit-testable on CPU; nothing here imports the rest of
packrl but its bottom layer (`packrl.types`, `packrl.errors`); the tools that inspect data and
configs before a run live in `packrl.inspect`.

Names are imported on first use, so config-only tools (``packrl config``) do not load torch.
"""

from packrl._lazy import lazy_exports

_EXPORTS = {
    "Budgets": "budgets",
    "BudgetViolation": "budgets",
    "model_context_tokens": "budgets",
    "ResponseBudgetSchedule": "curriculum",
    "PolicyResult": "prompt_policy",
    "Prompt": "prompt_policy",
    "PromptAccounting": "prompt_policy",
    "RowOutcome": "prompt_policy",
    "apply_prompt_policy": "prompt_policy",
    "Pack": "packing",
    "pack_sequences": "packing",
    "MicrobatchPlan": "microbatch",
    "plan_microbatches": "microbatch",
    "sequence_costs": "microbatch",
    "RankPlan": "balance",
    "balance_ranks": "balance",
    "karmarkar_karp": "balance",
    "refine_partition": "balance",
    "LossDenominators": "denominators",
    "MinibatchPlan": "update_plan",
    "UpdatePlan": "update_plan",
    "plan_ranks": "update_plan",
    "plan_update": "update_plan",
    "trained_sequences": "update_plan",
    "length_percentiles": "stats",
    "chunked_logprobs": "chunked",
    "full_logprobs": "chunked",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("packrl.seqlen", _EXPORTS)
