"""The cross-field rules of `packrl sft`: the supervised recipe's own rule set.

`packrl sft` trains with the ``sft`` section's loss, batch and budgets on the shared sections
(``model``, ``train``'s micro-batch budgets and optimizer knobs, ``trainer``); the RL rules of
`packrl.config.relations` check a config for `packrl train` and never see a setting of the SFT
recipe, and these rules check a config for `packrl sft` only (`sft_problems`, run by
`packrl.trainer.sft.sft` before anything is written). A rule is ``rule(<sections>) ->
list[ConfigProblem]`` as in `packrl.config.relations`.
"""

from __future__ import annotations

from collections.abc import Callable

from packrl.config.schema import DataConfig, RolloutConfig, RunConfig, TrainerConfig
from packrl.config.sft import SftConfig
from packrl.config.tasks import task_source_problems
from packrl.config.train import TrainConfig
from packrl.errors import ConfigProblem
from packrl.registry import call_with_sections

SftRule = Callable[..., list[ConfigProblem]]
"""A rule: its parameters name the `RunConfig` sections it reads (`packrl.registry.call_with_sections`)."""


def trace_budgets(data: DataConfig, rollout: RolloutConfig, sft: SftConfig) -> tuple[int, int]:
    """A trace's ``(prompt, response)`` token budgets: ``sft.max_prompt_tokens`` and
    ``sft.max_response_tokens``, each null one the RL budget (``data.max_prompt_tokens``,
    ``rollout.max_response_tokens``), as before the keys existed."""
    return sft.trace_budgets(data.max_prompt_tokens, rollout.max_response_tokens)


def sft_steps(sft: SftConfig) -> list[ConfigProblem]:
    """`packrl sft` trains at least one step (``sft.total_steps`` is 0 in an RL preset without SFT)."""
    if sft.total_steps >= 1:
        return []
    return [ConfigProblem("sft.total_steps", sft.total_steps, "leaves packrl sft nothing to train",
                          "set sft.total_steps (e.g. sft.total_steps=50)")]


def sft_microbatch_budget(train: TrainConfig, data: DataConfig, rollout: RolloutConfig, sft: SftConfig) -> list[ConfigProblem]:
    """The longest trace the budgets keep fits one update micro-batch."""
    prompt, response = trace_budgets(data, rollout, sft)
    budget = train.max_tokens_per_microbatch
    if prompt + response <= budget:
        return []
    return [ConfigProblem("train.max_tokens_per_microbatch", budget, f"is smaller than the longest trace packrl sft keeps, "
                          f"sft.max_prompt_tokens + sft.max_response_tokens = {prompt:,} + {response:,} = {prompt + response:,} "
                          "(null: data.max_prompt_tokens / rollout.max_response_tokens)",
                          f"raise train.max_tokens_per_microbatch to >= {prompt + response:,} or lower sft.max_response_tokens",
                          keys=("train.max_tokens_per_microbatch", "sft.max_prompt_tokens", "sft.max_response_tokens",
                                "data.max_prompt_tokens", "rollout.max_response_tokens"))]


def sft_ranks_have_work(trainer: TrainerConfig, sft: SftConfig) -> list[ConfigProblem]:
    """Every data-parallel rank gets at least one trace of each step."""
    workers = trainer.num_workers
    data_parallel = workers // max(1, trainer.sequence_parallel_size)
    if not (data_parallel > 1 and 1 <= sft.batch_size < data_parallel):
        return []
    return [ConfigProblem("trainer.num_workers", workers, f"makes {data_parallel} data-parallel ranks, more than the "
                          f"sft.batch_size={sft.batch_size} traces of a step; every rank needs at least one",
                          "lower trainer.num_workers or raise sft.batch_size", keys=("trainer.num_workers", "sft.batch_size"))]


def sft_restarts(trainer: TrainerConfig) -> list[ConfigProblem]:
    """``trainer.max_restarts`` restarts lost Ray ranks; `packrl sft` in one process has none (it
    starts no rollout workers either, whatever ``trainer.rollout_mode`` says for RL)."""
    if trainer.max_restarts == 0 or trainer.num_workers > 1:
        return []
    return [ConfigProblem("trainer.max_restarts", trainer.max_restarts, "has no effect in packrl sft with trainer.num_workers=1: "
                          "it trains in this process, with no Ray actor to lose", "set trainer.max_restarts=0 for packrl sft, or "
                          "trainer.num_workers > 1", keys=("trainer.max_restarts", "trainer.num_workers"))]


def sft_task_sources(sft: SftConfig) -> list[ConfigProblem]:
    """Each ``task:`` source of ``sft.train_files`` names a registered task that makes traces
    (`packrl.registry.TASKS`: ``task:tool_traces``, ``task:char_count_traces`` or a plugin's)."""
    return task_source_problems("sft.train_files", sft.train_files, "traces")


SFT_RULES: tuple[SftRule, ...] = (sft_steps, sft_microbatch_budget, sft_ranks_have_work, sft_restarts, sft_task_sources)
"""Every rule of `packrl sft`, in the order their problems are reported."""


def sft_load_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """What `packrl.config.load_config` checks for `packrl sft` (its ``rules=``): every section's own
    problems. RL's cross-field rules (`packrl.config.relations.RULES`) do not apply to the
    supervised recipe; its own (`sft_problems`) run in `packrl.trainer.sft.sft`, before anything
    is written."""
    return cfg.section_problems()


def sft_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """The ``sft`` section's own problems, then every rule of `SFT_RULES` (a rule's problem is left
    out when a key it depends on has a problem of its own)."""
    own = cfg.sft.problems("sft")
    invalid = {problem.key for problem in own}
    return own + [problem for rule in SFT_RULES for problem in call_with_sections(rule, cfg)
                  if not invalid.intersection(problem.involved_keys)]


def sft_context_problems(budgets: tuple[int, int], max_context_tokens: int) -> list[ConfigProblem]:
    """The longest trace the ``(prompt, response)`` budgets keep (`trace_budgets`) fits the model
    context (``max_context_tokens``, RoPE scaling included; known once the model is read)."""
    prompt, response = budgets
    if prompt + response <= max_context_tokens:
        return []
    return [ConfigProblem("sft.max_response_tokens", response, f"with sft.max_prompt_tokens={prompt:,} keeps traces of up to "
                          f"{prompt + response:,} tokens, over the model context of {max_context_tokens:,} (null: "
                          "data.max_prompt_tokens / rollout.max_response_tokens)",
                          f"set sft.max_prompt_tokens + sft.max_response_tokens <= {max_context_tokens:,}",
                          keys=("sft.max_response_tokens", "sft.max_prompt_tokens", "data.max_prompt_tokens",
                                "rollout.max_response_tokens", "model.path"))]
