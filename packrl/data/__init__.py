"""Prompt data: loaders (jsonl, json, parquet incl. verl's schema, HF hub), the ``task:`` sources
made by registered tasks (`task_sources`; the built-in `task:arithmetic`, `task:char_count`,
`task:shapes` and their traces), row normalisation, and the budgeted prompt dataset with the
epoch sampler every recipe draws with (`sampler.EpochSampler`).

`PromptDataset` and `PromptSampler` (which need torch through `packrl.types`) are imported on
first use, so config-only tools do not load torch.
"""

from packrl._lazy import lazy_exports

_EXPORTS = {
    "VAL_SEED_OFFSET": "tasks",
    "arithmetic_rows": "tasks",
    "char_count_rows": "char_count",
    "shortest_correct_response": "char_count",
    "BadRow": "loaders",
    "load_rows": "loaders",
    "ARITHMETIC_SOURCE": "examples",
    "GSM8K_SOURCE": "examples",
    "Example": "examples",
    "clean_number": "examples",
    "to_example": "examples",
    "DatasetPrompt": "prompts",
    "LoadedRows": "prompts",
    "RowSource": "prompts",
    "account_rows": "prompts",
    "accounting_dict": "prompts",
    "budget_examples": "prompts",
    "load_examples": "prompts",
    "rendered_prompt_lengths": "prompts",
    "PromptDataset": "dataset",
    "PromptSampler": "dataset",
    "EpochSampler": "sampler",
    "check_enough_prompts": "dataset",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("packrl.data", _EXPORTS)
