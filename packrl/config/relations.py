"""Cross-field rules: the one home of every check that relates two or more config sections.

A rule is a small named function ``rule(<sections>) -> list[ConfigProblem]`` whose parameters
name the config sections it reads (``def mini_batches(train, data)``, called by
`packrl.registry.call_with_sections`), each problem naming the key, the value seen, the limit and
the fix, with every key it depends on in ``keys`` (so a problem is dropped when one of them did
not parse). `RULES` lists them in the order their problems are reported; `config_problems` runs
each section's own checks, then every rule. `WARNINGS` lists the rules whose findings are warnings
(a setting that runs but defeats another: logged at load, listed by preflight; `config_warnings`).

Adding a rule: write the function below, add it to `RULES`, and test it through
`packrl.config.check_config`. A registered part's own config check (``checks=`` in
`packrl.registry`) is a rule of the same shape that runs only when the part is chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from packrl.capabilities import FilterInfo
from packrl.config.budgets import budget_problems, budgets_of_sections
from packrl.config.critic import CriticConfig
from packrl.config.curriculum import schedule_problems
from packrl.config.model import ModelConfig
from packrl.config.rollout_modes import RolloutModeInfo, mode_info
from packrl.config.schema import AlgorithmConfig, DataConfig, RolloutConfig, RunConfig, TrainerConfig
from packrl.config.tasks import task_source_problems
from packrl.config.train import TrainConfig
from packrl.errors import ConfigProblem
from packrl.registry import FILTERS, ROLLOUT_MODES, call_with_sections, resolve_target

Rule = Callable[..., list[ConfigProblem]]
"""A rule: its parameters name the `RunConfig` sections it reads (`packrl.registry.call_with_sections`)."""


def token_budgets(data: DataConfig, rollout: RolloutConfig, train: TrainConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """The relations among the token budgets, without the model context (the model config gives
    it before step 1: `packrl.config.budgets.budgets_of_model`)."""
    return budget_problems(budgets_of_sections(data, rollout, train, trainer, max_context_tokens=None))


def multi_turn_off(rollout: RolloutConfig) -> list[ConfigProblem]:
    """Multi-turn settings while multi-turn is off (they would have no effect)."""
    mt, key = rollout.multi_turn, "rollout.multi_turn"
    if mt.enabled:
        return []  # the relations to the other budgets: `token_budgets`
    changed = [f.name for f in dataclasses.fields(mt) if f.name != "tools" and getattr(mt, f.name) != f.default]
    return [ConfigProblem(f"{key}.{name}", getattr(mt, name), f"has no effect: multi-turn is off ({key}.tools is empty)",
                          f"name a tool in {key}.tools (e.g. [calculator]) or remove {key}.{name}") for name in changed]


def shared_prompts(model: ModelConfig, train: TrainConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """``train.share_prompts=true`` where it cannot run (known from the config alone)."""
    if train.share_prompts is not True:
        return []
    if model.packed_attention == "position_ids":
        return [ConfigProblem("train.share_prompts", True, "has no effect with model.packed_attention=position_ids (transformers' "
                              "position-id detection cannot let a response see its prompt segment)",
                              "set model.packed_attention=varlen (or block_mask), or train.share_prompts=false",
                              keys=("train.share_prompts", "model.packed_attention"))]
    if trainer.sequence_parallel_size > 1:
        return [ConfigProblem("train.share_prompts", True, "has no effect under sequence parallelism (a pack is split over ranks)",
                              "set train.share_prompts=false or trainer.sequence_parallel_size=1",
                              keys=("train.share_prompts", "trainer.sequence_parallel_size"))]
    return []


def mini_batches(data: DataConfig, train: TrainConfig) -> list[ConfigProblem]:
    """``train.mini_batch_size`` divides ``data.batch_size``."""
    mini, batch = train.mini_batch_size, data.batch_size
    if mini is None or mini < 1 or batch < 1 or batch % mini == 0:
        return []
    return [ConfigProblem("train.mini_batch_size", mini, f"does not divide data.batch_size={batch}",
                          "set train.mini_batch_size to a divisor of data.batch_size", keys=("train.mini_batch_size", "data.batch_size"))]


def ranks_have_work(data: DataConfig, rollout: RolloutConfig, train: TrainConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """Every data-parallel rank gets at least one sequence of each mini-batch."""
    workers = trainer.num_workers
    data_parallel = workers // max(1, trainer.sequence_parallel_size)
    per_step = (train.mini_batch_size or data.batch_size) * rollout.n
    if not (data_parallel > 1 and 1 <= per_step < data_parallel):
        return []
    return [ConfigProblem(
        "trainer.num_workers", workers, f"makes {data_parallel} data-parallel ranks, more than the {per_step} sequences of "
        "a mini-batch (train.mini_batch_size or data.batch_size, times rollout.n); every rank needs at least one",
        "lower trainer.num_workers or raise the batch",
        keys=("trainer.num_workers", "train.mini_batch_size", "data.batch_size", "rollout.n"),
    )]


def sequence_parallel_attention(model: ModelConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """Sequence parallelism splits packs through the varlen attention path only."""
    size, attention = trainer.sequence_parallel_size, model.packed_attention
    if size <= 1 or attention == "varlen":
        return []
    return [ConfigProblem("trainer.sequence_parallel_size", size, f"splits packs through the varlen attention path, not "
                          f"model.packed_attention={attention}", "set model.packed_attention=varlen",
                          keys=("trainer.sequence_parallel_size", "model.packed_attention"))]


def parameter_offload(model: ModelConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """``model.param_offload`` offloads FSDP2 shards, which one process does not have."""
    if not (model.param_offload and trainer.num_workers == 1):
        return []
    return [ConfigProblem("model.param_offload", True, "offloads FSDP2 shards, but trainer.num_workers=1 runs one process without FSDP2",
                          "set trainer.num_workers >= 2 (one per GPU), or model.param_offload=false",
                          keys=("model.param_offload", "trainer.num_workers"))]


def compiled_layers(model: ModelConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """``model.compile=true`` where compiled layers cannot run (`ModelConfig.compile_blocker`)."""
    blocker = model.compile_blocker(trainer.num_workers)
    if model.compile is not True or not blocker:
        return []
    return [ConfigProblem("model.compile", True, f"cannot run with {blocker}", "set model.compile=null (on where it can run) or false",
                          keys=("model.compile", "trainer.num_workers", "model.gradient_checkpointing"))]


def group_size(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """Group-relative estimators need two responses per prompt."""
    estimator = algorithm.adv_estimator
    if rollout.n == 1 and estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        return [ConfigProblem("rollout.n", 1, f"gives every response advantage 0 under {estimator} (one response per group)",
                              "set rollout.n >= 2", keys=("rollout.n", "algorithm.adv_estimator"))]
    return []


def sft_loss(algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """The supervised loss reads no advantages: it is `packrl sft`'s, which sets it itself."""
    if algorithm.policy_loss != "sft":
        return []
    return [ConfigProblem("algorithm.policy_loss", "sft", "is the supervised loss of packrl sft and ignores rewards and advantages",
                          "run packrl sft for supervised fine-tuning, or set algorithm.policy_loss=ppo_clip for RL")]


def kl_in_reward(algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """In-reward KL needs a KL coefficient."""
    if not (algorithm.kl_in_reward and algorithm.kl_coef == 0):
        return []
    return [ConfigProblem("algorithm.kl_in_reward", True, "has no effect with algorithm.kl_coef=0",
                          "set algorithm.kl_coef > 0 or algorithm.kl_in_reward=false",
                          keys=("algorithm.kl_in_reward", "algorithm.kl_coef"))]


def critic(critic: CriticConfig, algorithm: AlgorithmConfig, data: DataConfig, rollout: RolloutConfig, train: TrainConfig,
           trainer: TrainerConfig) -> list[ConfigProblem]:
    """A critic the run cannot use, or critic settings without a critic."""
    section, estimator = critic, algorithm.adv_estimator
    if estimator == "gae" and section.enable is False:
        return [ConfigProblem("critic.enable", False, "algorithm.adv_estimator=gae needs the critic's values",
                              "set critic.enable=true (or null), or choose another algorithm.adv_estimator",
                              keys=("critic.enable", "algorithm.adv_estimator"))]
    if not section.enabled(estimator):
        return _without_critic(section, algorithm)
    out = []
    if trainer.sequence_parallel_size > 1:
        out.append(ConfigProblem("critic.enable", True, "the critic does not run under sequence parallelism yet",
                                 "set trainer.sequence_parallel_size=1 for PPO with a critic",
                                 keys=("critic.enable", "trainer.sequence_parallel_size")))
    budget = section.max_tokens_per_microbatch
    budgets = budgets_of_sections(data, rollout, train, trainer)
    if budget is not None and budget >= 1 and not budgets.context_bounded:  # the actor's update-budget relation, for the critic's
        longest = budgets.max_sequence_tokens
        if budget < longest:
            out.append(ConfigProblem("critic.max_tokens_per_microbatch", budget, f"is smaller than the longest possible sequence "
                                     f"data.max_prompt_tokens + rollout.max_response_tokens = {longest:,}",
                                     f"raise critic.max_tokens_per_microbatch to >= {longest:,} or leave it null "
                                     "(train.max_tokens_per_microbatch)"))
    if section.warmup_steps >= train.total_steps:
        out.append(ConfigProblem("critic.warmup_steps", section.warmup_steps, f"leaves no step of train.total_steps="
                                 f"{train.total_steps} for the actor", "lower critic.warmup_steps or raise train.total_steps"))
    return out


def _without_critic(section: CriticConfig, algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """Critic settings changed from their defaults (the ``critic`` section), and GAE's knobs (of
    ``algorithm``), in a run without a critic."""
    estimator, default = algorithm.adv_estimator, CriticConfig()
    changed = [f.name for f in dataclasses.fields(section) if f.name != "enable" and getattr(section, f.name) != getattr(default, f.name)]
    keys = ["model.path" if name == "model" else name for name in changed]
    out = [ConfigProblem(f"critic.{key}", section.model.path if key == "model.path" else getattr(section, key),
                         "has no effect: this run has no critic",
                         f"set algorithm.adv_estimator=gae (or critic.enable=true), or remove critic.{key}") for key in keys]
    readers = {"gamma": "gae, reinforce_plus_plus", "lam": "gae"}  # the other built-in estimators read neither
    for name, ignoring in (("gamma", ("grpo", "rloo", "reinforce_plus_plus_baseline")),
                           ("lam", ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"))):
        if estimator in ignoring and getattr(algorithm, name) != 1.0:
            out.append(ConfigProblem(f"algorithm.{name}", getattr(algorithm, name), f"has no effect with "
                                     f"algorithm.adv_estimator={estimator} (read by {readers[name]})",
                                     f"set algorithm.adv_estimator to one that reads it or remove algorithm.{name}"))
    return out


def gspo_problems(rollout: RolloutConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """Settings under which GSPO's per-sequence mean log-ratio would not be local to one
    micro-batch on one rank (`packrl.algos.policy_losses.gspo`): sequence parallelism splits a
    sequence over ranks, and the rolling window trains one trajectory as several sequences.
    Registered as the config check of ``algorithm.policy_loss=gspo`` (`packrl.registry`)."""
    out = []
    size = trainer.sequence_parallel_size
    if size > 1:
        out.append(ConfigProblem("algorithm.policy_loss", "gspo", f"needs each sequence on one rank; trainer.sequence_parallel_size={size} "
                                 "splits sequences over ranks, so the sequence's mean log-ratio is not local",
                                 "set trainer.sequence_parallel_size=1 or algorithm.policy_loss=ppo_clip",
                                 keys=("algorithm.policy_loss", "trainer.sequence_parallel_size")))
    mt = rollout.multi_turn
    if mt.enabled and mt.context_policy == "rolling":
        out.append(ConfigProblem("algorithm.policy_loss", "gspo", "needs one sequence per response; rollout.multi_turn.context_policy="
                                 "rolling trains a trajectory as several step-wise samples, so its mean log-ratio is not local",
                                 "set rollout.multi_turn.context_policy=end (or error), or algorithm.policy_loss=ppo_clip",
                                 keys=("algorithm.policy_loss", "rollout.multi_turn.context_policy")))
    return out


def filters(algorithm: AlgorithmConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """Every filter ``algorithm.filters`` chooses runs under ``trainer.rollout_mode``
    (`packrl.capabilities.FilterInfo.modes`), and none is one set by a section of its own
    (`FilterInfo.settings_key`: it is in every chain already)."""
    out: list[ConfigProblem] = []
    for name in algorithm.filter_parts():
        if FILTERS.problem(name) is not None:
            continue  # an unknown name is the registry check's
        info, key = FILTERS.info(name), f"algorithm.filters.{name}"
        if info.settings_key is not None:
            out.append(ConfigProblem(key, algorithm.filters[name], f"is set by {info.settings_key}, not by algorithm.filters",
                                     f"remove {key} and set {info.settings_key}.<knob>"))
        elif (runs := _filter_modes(info)) is not None and trainer.rollout_mode not in runs:
            where = f"it runs under {', '.join(runs)}" if runs else f"it declares modes={info.modes!r}, none of them a registered mode"
            fix = f"set trainer.rollout_mode={runs[0]} or {key}=null" if runs else f"set {key}=null, or fix the filter's FilterInfo.modes"
            out.append(ConfigProblem(key, algorithm.filters[name], f"does not run under trainer.rollout_mode={trainer.rollout_mode} "
                                     f"({where})", fix, keys=(key, "trainer.rollout_mode")))
    return out


def thinking_budgets(rollout: RolloutConfig, trainer: TrainerConfig) -> list[ConfigProblem]:
    """Thinking budgets run on single-turn rollouts generated within a step (the budgets' sum is
    `packrl.config.budgets`'s relation)."""
    r = rollout
    if not r.thinking:
        return []
    out = []
    if r.multi_turn.enabled:
        out.append(ConfigProblem("rollout.think_budget_tokens", r.think_budget_tokens, "does not apply per turn of multi-turn "
                                 "rollouts yet", "set rollout.think_budget_tokens=null or rollout.multi_turn.tools=[]",
                                 keys=("rollout.think_budget_tokens", "rollout.multi_turn.tools")))
    if (info := _mode_info(trainer.rollout_mode)) is not None and info.carries_groups:
        out.append(ConfigProblem("rollout.think_budget_tokens", r.think_budget_tokens, f"does not apply to responses carried "
                                 f"across steps (trainer.rollout_mode={trainer.rollout_mode}): a thinking segment cut "
                                 "between steps could not be told from one that ran out", "set trainer.rollout_mode=sync or "
                                 "rollout.think_budget_tokens=null", keys=("rollout.think_budget_tokens", "trainer.rollout_mode")))
    return out


def task_sources(data: DataConfig) -> list[ConfigProblem]:
    """Each ``task:`` source of ``data.train_files`` and ``data.val_files`` names a registered task
    that makes prompts (`packrl.registry.TASKS`; the plugins are imported before the rules run)."""
    return (task_source_problems("data.train_files", data.train_files, "prompts")
            + task_source_problems("data.val_files", data.val_files, "prompts"))


def restarts(trainer: TrainerConfig) -> list[ConfigProblem]:
    """``trainer.max_restarts`` restarts lost Ray actors: rank actors (``trainer.num_workers > 1``)
    or the rollout workers of a mode that runs its own (`RolloutModeInfo.rollout_workers`)."""
    info = _mode_info(trainer.rollout_mode)
    if trainer.max_restarts <= 0 or trainer.num_workers > 1 or info is None or info.rollout_workers:
        return []
    return [ConfigProblem("trainer.max_restarts", trainer.max_restarts, f"restarts lost Ray actors, but trainer.num_workers=1 with "
                          f"trainer.rollout_mode={trainer.rollout_mode} trains in this process with none (a lost process there is "
                          "the run itself)", "set trainer.max_restarts=0, or trainer.num_workers > 1, or a rollout mode with rollout "
                          "workers of its own (trainer.rollout_mode=separate_async)",
                          keys=("trainer.max_restarts", "trainer.num_workers", "trainer.rollout_mode"))]


def _mode_info(name: str) -> RolloutModeInfo | None:
    """What rollout mode ``name`` declares (`mode_info`), or None when no mode of that name is
    registered (the registry's check reports it; ``trainer.plugins`` are imported before the rules run)."""
    return None if ROLLOUT_MODES.problem(name) is not None else mode_info(name)


def length_targets(data: DataConfig, rollout: RolloutConfig) -> list[ConfigProblem]:
    """A drawn target the response budget cannot hold: under a length curriculum, the budget of
    its smallest stage (a prompt of that stage would ask for a length its response cannot reach)."""
    target, rollout = data.length_target, rollout
    if target.max_tokens is None:
        return []
    raw = rollout.max_response_tokens_schedule
    stages = [] if not raw or schedule_problems(raw, rollout.max_response_tokens) else [(int(b), int(a)) for a, b in raw]
    budget, start = min(stages, default=(rollout.max_response_tokens, None))
    if target.max_tokens <= budget:
        return []
    if start is None:
        return [ConfigProblem("data.length_target.max_tokens", target.max_tokens, f"> rollout.max_response_tokens={budget:,}: a "
                              "prompt would ask for a length its response cannot reach", f"set data.length_target.max_tokens <= "
                              f"{budget:,} or raise rollout.max_response_tokens", keys=("data.length_target.max_tokens",
                                                                                        "rollout.max_response_tokens"))]
    return [ConfigProblem("data.length_target.max_tokens", target.max_tokens, f"> {budget:,}, the response budget of the length "
                          f"curriculum's stage from step {start} (rollout.max_response_tokens_schedule): a prompt of that stage "
                          "would ask for a length its response cannot reach", f"set data.length_target.max_tokens <= {budget:,} "
                          "or raise that stage's budget", keys=("data.length_target.max_tokens", "rollout.max_response_tokens_schedule"))]


def _filter_modes(info: FilterInfo) -> tuple[str, ...] | None:
    """The rollout modes a filter runs under (None: every one)."""
    modes = info.modes or (tuple(ROLLOUT_MODES.names()) if info.stage == "sampling" else None)
    if modes is None:
        return None
    known = tuple(m for m in modes if ROLLOUT_MODES.problem(m) is None)  # a declared mode nobody registered runs nothing
    return known if info.stage != "sampling" else tuple(m for m in known if ROLLOUT_MODES.info(m).runs_sampling_filters)


def filter_warnings(cfg: RunConfig) -> list[ConfigProblem]:
    """A warning (`WARNINGS`): what each chosen filter's warning check finds
    (`packrl.capabilities.FilterInfo.warnings`, given the sections its parameters name)."""
    out: list[ConfigProblem] = []
    for name in cfg.algorithm.filter_parts():
        if FILTERS.problem(name) is None and (target := FILTERS.info(name).warnings) is not None:
            out += call_with_sections(resolve_target(target, f"the filter {name}'s FilterInfo(warnings=)"), cfg)
    return out


RULES: tuple[Rule, ...] = (
    critic, shared_prompts, token_budgets, multi_turn_off, mini_batches, ranks_have_work, sequence_parallel_attention,
    parameter_offload, compiled_layers, group_size, sft_loss, kl_in_reward, filters, thinking_budgets, length_targets,
    restarts, task_sources,
)
"""Every cross-field rule, in the order their problems are reported."""

WARNINGS: tuple[Rule, ...] = (filter_warnings,)
"""Rules whose findings are warnings, not errors: settings that run but most likely lose what
another setting asks for (supported but wrong: a warning with the fix). `load_config` logs them,
preflight lists them among its notes."""


def config_warnings(cfg: RunConfig) -> list[ConfigProblem]:
    """What every rule of `WARNINGS` finds in ``cfg`` (a config that loaded)."""
    return [problem for rule in WARNINGS for problem in call_with_sections(rule, cfg)]


def config_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """Every section's own problems, then every rule's (`RULES`); a rule's problem is left out when
    a key it depends on already has a problem of its own (it would follow from that one)."""
    own = cfg.section_problems()
    invalid = {problem.key for problem in own}
    return own + [problem for rule in RULES for problem in call_with_sections(rule, cfg)
                  if not invalid.intersection(problem.involved_keys)]
