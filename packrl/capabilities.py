"""What registered parts declare about themselves with their registration
(``REGISTRY.register(name, info=...)``), in a module of the bottom layer (no torch, no config): the
config rules, preflight, set-up, the stages and the workers read one typed declaration and never a
part's name. Each registry of `packrl.registry` holds one of these classes (`Registry.info`
returns it, the class's defaults for a part that declared nothing):

- a rollout engine's `EngineCapabilities` (``rollout.engine``; the engine contract itself is
  `packrl.rollout.engine`, which re-exports it);
- a rollout mode's `RolloutModeInfo` (``trainer.rollout_mode``);
- a policy loss's `LossInfo` (``algorithm.policy_loss``);
- a reward function's `RewardInfo` (``reward.name``, registered through
  `packrl.reward.register_reward`);
- `NoInfo` for the kinds whose parts declare nothing.

The built-in parts' declarations are here too, so reading them imports none of the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


def _check_target(owner: str, field: str, value: object) -> None:
    """Refuse a declared hook that is not a ``"module:function"`` string or None.

    Raises:
        ValueError: naming ``owner``, the field and the value.
    """
    if value is not None and not (isinstance(value, str) and ":" in value):
        raise ValueError(f"{owner}({field}={value!r}): a 'module:function' string, or None")


def _check_order(owner: str, order: object) -> None:
    if not isinstance(order, int) or isinstance(order, bool):
        raise ValueError(f"{owner}(order={order!r}): an int (lower first)")


@dataclass(frozen=True)
class NoInfo:
    """What a part of a kind that declares nothing holds (advantage estimators, tools, reward-shaping
    parts, modalities): its registry refuses any ``info=``."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What a registered engine can do beyond the `RolloutEngine` contract; declared with its
    registration (``ROLLOUT_ENGINES.register("name", info=EngineCapabilities(...))``)."""

    modalities: tuple[str, ...] = ()
    """The modalities whose extra inputs `generate` takes (``extra_inputs=``,
    `packrl.rollout.engine.ExtraInputsEngine`), by `packrl.models.modality.Modality.name`:
    ``("image",)`` serves a vision-language policy."""

    stop_on_condition: bool = False
    """It has `packrl.rollout.engine.InterruptibleEngine.generate_until`: a partial-rollout step can
    stop generating once its batch is complete instead of generating in chunks."""

    shares_policy_weights: bool = False
    """It generates on the policy's own parameters where the context allows
    (`packrl.rollout.engine.EngineContext.may_share_policy`: one process, parameters in the
    compute dtype), holding no copy of the weights (preflight's memory estimate counts none)."""

    packs_cpu_weights: bool = False
    """Generating on the CPU in a 2-byte compute dtype, it holds packed copies of its Linear and LM
    head weights (`packrl.rollout.packed_linear`; preflight's memory estimate counts them)."""

    preflight_notes: str | None = None
    """``"module:function"`` that preflight (`packrl.inspect.preflight`) calls for notes on the
    settings the engine derives from the run, e.g. its KV cache: ``function(options: EngineOptions,
    *, max_context_tokens: int, kv_bytes_per_token: int, dtype: str, cuda: bool) -> list[str]``
    (``dtype``: the compute dtype's name, ``fp32`` or ``bf16``; imported only when preflight
    runs). None: no notes."""

    def __post_init__(self) -> None:
        """Raises ValueError where a field holds a value of another kind (``stop_on_condition="no"``
        would read as true), naming the field and what it takes."""
        if not (isinstance(self.modalities, tuple) and all(isinstance(m, str) for m in self.modalities)):
            raise ValueError(f"EngineCapabilities(modalities={self.modalities!r}): a tuple of modality names, e.g. ('image',)")
        for name in ("stop_on_condition", "shares_policy_weights", "packs_cpu_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineCapabilities({name}={getattr(self, name)!r}): True or False")
        _check_target("EngineCapabilities", "preflight_notes", self.preflight_notes)


@dataclass(frozen=True)
class RolloutModeInfo:
    """What a rollout mode declares with its registration (``ROLLOUT_MODES.register(name, info=...)``).

    Attributes:
        carries_groups: responses are generated across steps (partial rollouts): their tokens
            carry the version that sampled them, the old-log-prob pass runs to weight them, and a
            checkpoint holds the groups in flight.
        rollout_workers: it generates on ``trainer.num_rollout_workers`` processes of its own
            (Ray actors), not on the training workers.
        runs_sampling_filters: its stage runs the sampling filters (`FilterInfo` stage
            ``sampling``) after each generation round; a config choosing one under a mode that
            does not is refused at load.
    """

    carries_groups: bool = False
    rollout_workers: bool = False
    runs_sampling_filters: bool = False


@dataclass(frozen=True)
class LossInfo:
    """What a policy loss declares with its registration (``POLICY_LOSSES.register(name,
    info=LossInfo(...))``), read by the plan and the worker group without importing the loss.

    Attributes:
        reads_old_logprobs: the loss (or its ``prepare``) reads the old log-probs even when the
            update is on-policy, so the old-log-prob pass runs for it
            (`packrl.config.plan.BatchPlan.needs_old_logprobs`).
        prepare: ``"module:function"`` of a `packrl.algos.policy_losses.PrepareFn` the worker group
            runs once per update on the controller (`packrl.algos.policy_losses.prepare_update`):
            ``function(batch, minibatches, cfg, seed) -> (batch with extras, metrics)``, for a loss
            that chooses tokens over a whole mini-batch (Clip-Cov, KL-Cov); imported only when the
            update runs. A plugin file names its own module as ``f"{__name__}:function"``. None: none.

    Raises:
        ValueError: ``reads_old_logprobs`` is not a bool, or ``prepare`` is not a ``"module:function"`` string.
    """

    reads_old_logprobs: bool = False
    prepare: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reads_old_logprobs, bool):
            raise ValueError(f"LossInfo(reads_old_logprobs={self.reads_old_logprobs!r}): True or False")
        _check_target("LossInfo", "prepare", self.prepare)


@dataclass(frozen=True)
class RewardInfo:
    """What a reward function declares with its registration (`packrl.reward.register_reward`).

    Attributes:
        scores_truncated: its rule for responses a token budget cut (finish reason ``length`` or
            ``context``): False scores them 0 without calling it, since an answer cut short must
            not be credited as if it had ended on its own; True scores them like any other (a
            reward that does not read an answer). ``reward.score_truncated`` overrides it per run.
        correct_score: the score at and above which a response is correct (1.0 for ``gsm8k`` and
            ``math_verify``, whose wrong answers score ``reward.format_score`` < 1); None = the
            reward has no notion of correct (a dense score), which the length objectives that
            reward correct responses need (`packrl.reward.length`).
        ground_truth_problem: why a row's ground truth is not one this reward can read (a
            message), or None when it can; checked on every row of the data when the prompts are
            built, before the model loads (`packrl.reward.score.check_ground_truths`). None = any
            ground truth.
    """

    scores_truncated: bool = False
    correct_score: float | None = None
    ground_truth_problem: Callable[[str], str | None] | None = None


TaskMakes = Literal["prompts", "traces"]
"""What a task makes: prompt rows (``data.train_files``, ``data.val_files``) or SFT traces (``sft.train_files``)."""


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """What a registered task declares (``@TASKS.register(name, info=TaskInfo(...))``), read by the
    config checks and the loaders without running it; a task registered without one makes prompts
    and reads its own options.

    Attributes:
        makes: ``prompts``: the rows of a ``data.train_files`` / ``data.val_files`` source, read as
            a file's rows are (GSM8K's or verl's schema, `packrl.data.examples`); ``traces``: the
            chat traces of an ``sft.train_files`` source (rows of ``messages``, `packrl.data.traces`).
        options_key: the dotted key of the options it reads: a built-in's section of ``data``
            (``data.arithmetic``), or ``data.task_args.<task>`` (another task's options: traces drawn
            from that task's questions). None: its own, ``data.task_args.<name>``, checked at load
            against the options dataclass it registered with (``register(name, options=...)``).

    Raises:
        ValueError: ``options_key`` is not a key of the ``data`` section.
    """

    makes: TaskMakes = "prompts"
    options_key: str | None = None

    def __post_init__(self) -> None:
        if self.options_key is not None and not self.options_key.startswith("data."):
            raise ValueError(f"TaskInfo(options_key={self.options_key!r}): a task's options are a key of the data section; "
                             "give data.<section> or data.task_args.<task>, or None for its own (data.task_args.<name>)")


@dataclass(frozen=True)
class WrapperInfo:
    """What an engine wrapper declares with its registration (``ENGINE_WRAPPERS.register(name,
    info=WrapperInfo(...))``), read by set-up, preflight and the config checks without building it.

    Attributes:
        applies: ``"module:function"`` of ``function(rollout: RolloutConfig) -> bool``: whether a run
            with this ``rollout`` section wraps its engine (in a module light enough for config
            checks); None: never.
        order: its place among the wrappers that apply (lower wraps first, innermost; ties by name).
        keeps: the `EngineCapabilities` fields the wrapped engine keeps (the others fall back to
            their defaults: a wrapper that serves the engine call by call keeps none).
        preflight_notes: ``"module:function"`` of a check whose findings ``packrl preflight`` lists as
            notes (``list[str]``), given the config sections its parameters name; None: none.
        preflight_problems: likewise, of problems set-up would raise (``list[ConfigProblem]``, e.g.
            found with the policy's tokenizer); not run while a key of those sections has a problem.

    Raises:
        ValueError: a field of ``keeps`` that `EngineCapabilities` does not have, or a target that is
            not a ``"module:function"`` string.
    """

    applies: str | None = None
    order: int = 100
    keeps: tuple[str, ...] = ()
    preflight_notes: str | None = None
    preflight_problems: str | None = None

    def __post_init__(self) -> None:
        _check_order("WrapperInfo", self.order)
        if not isinstance(self.keeps, tuple):
            raise ValueError(f"WrapperInfo(keeps={self.keeps!r}): a tuple of EngineCapabilities fields, e.g. ('modalities',)")
        known = set(EngineCapabilities.__dataclass_fields__)
        if unknown := [k for k in self.keeps if k not in known]:
            raise ValueError(f"WrapperInfo(keeps={self.keeps!r}): {unknown} are not EngineCapabilities fields ({', '.join(sorted(known))})")
        for name in ("applies", "preflight_notes", "preflight_problems"):
            _check_target("WrapperInfo", name, getattr(self, name))


FilterStage = Literal["sampling", "advantages", "loss"]
"""Where a filter acts (`packrl.algos.filters`): ``sampling`` drops whole groups from a generation
round and may ask the stage for more rounds; ``advantages`` keeps the same number of each group's
responses for the estimator; ``loss`` takes responses out of the loss after the advantages."""


@dataclass(frozen=True)
class FilterInfo:
    """What a filter declares with its registration (``FILTERS.register(name, info=FilterInfo(...))``),
    read by the config checks, the plan and the chain without running it.

    Attributes:
        stage: where it acts (`FilterStage`).
        order: its place among the filters of its stage (lower first; ties by name): the chain is
            sampling filters, then advantage filters, then loss filters, each stage in this order.
        modes: the ``trainer.rollout_mode`` values it runs under; None = every mode (a sampling
            filter: every mode whose stage runs them, `RolloutModeInfo.runs_sampling_filters`). A
            config that chooses it under another mode is refused at load.
        reads_old_entropy: it reads the old-log-prob pass's entropy, so that pass runs for it
            (`packrl.config.plan.BatchPlan.needs_old_logprobs`).
        settings_key: its settings are another section of ``algorithm`` (``algorithm.rollout_correction``):
            it is in every run's chain and acts as that section says (a no-op when off); None: it is
            chosen by name under ``algorithm.filters`` with its own options.
        warnings: ``"module:function"`` of a config check whose findings are warnings (a setting
            that runs but likely defeats another), given the sections its parameters name; None: none.

    Raises:
        ValueError: an unknown stage, or ``warnings`` not a ``"module:function"`` string.
    """

    stage: FilterStage = "loss"
    order: int = 100
    modes: tuple[str, ...] | None = None
    reads_old_entropy: bool = False
    settings_key: str | None = None
    warnings: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in ("sampling", "advantages", "loss"):
            raise ValueError(f"FilterInfo(stage={self.stage!r}): one of sampling, advantages, loss")
        _check_order("FilterInfo", self.order)
        if self.modes is not None and not (isinstance(self.modes, tuple) and self.modes and all(isinstance(m, str) for m in self.modes)):
            raise ValueError(f"FilterInfo(modes={self.modes!r}): a tuple of trainer.rollout_mode names, e.g. ('sync',), "
                             "or None (every mode)")
        if not isinstance(self.reads_old_entropy, bool):
            raise ValueError(f"FilterInfo(reads_old_entropy={self.reads_old_entropy!r}): True or False")
        if self.settings_key is not None and not self.settings_key.startswith("algorithm."):
            raise ValueError(f"FilterInfo(settings_key={self.settings_key!r}): a key of the algorithm section, or None")
        _check_target("FilterInfo", "warnings", self.warnings)


HF_ENGINE = EngineCapabilities(modalities=("image",), stop_on_condition=True, shares_policy_weights=True, packs_cpu_weights=True)
"""What ``rollout.engine=hf`` declares (`packrl.rollout.hf_engine`), readable without importing it."""

VLLM_ENGINE = EngineCapabilities(preflight_notes="packrl.rollout.vllm_settings:preflight_notes")
"""What ``rollout.engine=vllm`` declares (`packrl.rollout.vllm_engine`), readable without importing it."""

SYNC = RolloutModeInfo(runs_sampling_filters=True)
"""What ``trainer.rollout_mode=sync`` declares (`packrl.trainer.stages.rounds`)."""

COLOCATE_ASYNC = RolloutModeInfo(carries_groups=True)
"""What ``trainer.rollout_mode=colocate_async`` declares (`packrl.trainer.stages.partial`)."""

SEPARATE_ASYNC = RolloutModeInfo(carries_groups=True, rollout_workers=True)
"""What ``trainer.rollout_mode=separate_async`` declares (`packrl.trainer.stages.separate`)."""

TOKEN_LOSS = LossInfo()
"""What ``ppo_clip``, ``gspo`` and ``sft`` declare (`packrl.algos.policy_losses`): a loss of one
micro-batch's tokens alone."""

COV_LOSS = LossInfo(reads_old_logprobs=True, prepare="packrl.algos.cov_losses:select_cov_tokens")
"""What ``clip_cov`` and ``kl_cov`` declare (`packrl.algos.cov_losses`): the tokens they treat apart
are chosen on the controller from the old log-probs, over each whole mini-batch."""


ARITHMETIC_TASK = TaskInfo(options_key="data.arithmetic")
"""``task:arithmetic`` (`packrl.data.tasks`)."""
CHAR_COUNT_TASK = TaskInfo(options_key="data.char_count")
"""``task:char_count`` (`packrl.data.char_count`)."""
SHAPES_TASK = TaskInfo(options_key="data.shapes")
"""``task:shapes`` (`packrl.data.shapes`)."""
TOOL_TRACES_TASK = TaskInfo(makes="traces", options_key="data.arithmetic")
"""``task:tool_traces``: calculator traces of ``task:arithmetic`` questions (`packrl.data.tool_traces`)."""
CHAR_COUNT_TRACES_TASK = TaskInfo(makes="traces", options_key="data.char_count")
"""``task:char_count_traces``: worked answers to ``task:char_count`` questions (`packrl.data.char_count_traces`)."""

MULTI_TURN_WRAPPER = WrapperInfo(applies="packrl.config.multi_turn:wraps_engine", order=10,
                                 preflight_notes="packrl.rollout.multi_turn:preflight_notes")
"""``rollout.multi_turn.tools`` set: the tool loop (`packrl.rollout.multi_turn`), one engine call per turn."""
THINKING_WRAPPER = WrapperInfo(applies="packrl.config.length_control:thinking_wraps_engine", order=20,
                               preflight_problems="packrl.rollout.thinking:preflight_problems")
"""``rollout.think_budget_tokens`` set: the thinking budgets (`packrl.rollout.thinking`), one call per segment."""

DYNAMIC_SAMPLING_FILTER = FilterInfo(stage="sampling", warnings="packrl.algos.dynamic_sampling:config_warnings")
"""``algorithm.filters.dynamic_sampling`` (`packrl.algos.dynamic_sampling`): whole groups, where the
rollout mode runs sampling filters (`RolloutModeInfo.runs_sampling_filters`)."""
GFPO_FILTER = FilterInfo(stage="advantages")
"""``algorithm.filters.gfpo`` (`packrl.algos.group_filter`)."""
ROLLOUT_CORRECTION_FILTER = FilterInfo(stage="loss", order=10, settings_key="algorithm.rollout_correction")
"""Rollout-correction rejection and weights (`packrl.algos.rollout_correction`), set by ``algorithm.rollout_correction``."""
ENTROPY_FILTER = FilterInfo(stage="loss", order=20, reads_old_entropy=True)
"""``algorithm.filters.entropy`` (`packrl.algos.entropy_filter`), after rollout correction's rejection."""
