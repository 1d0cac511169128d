"""Open registries: the parts a config names by string, and the one way to add a part.

Eight config keys take registered names: ``reward.name`` (`REWARDS`), ``algorithm.adv_estimator``
(`ADVANTAGE_ESTIMATORS`), ``algorithm.policy_loss`` (`POLICY_LOSSES`), ``rollout.engine``
(`ROLLOUT_ENGINES`), ``trainer.rollout_mode`` (`ROLLOUT_MODES`), each of
``rollout.multi_turn.tools`` (`TOOLS`), each key of ``reward.shaping`` (`REWARD_SHAPING`,
whose values are the parts' options) and each key of ``algorithm.filters`` (`FILTERS`, likewise);
a data source ``task:<name>`` names a task (`TASKS`, whose own options are the values of
``data.task_args``). A user adds a part with
one decorated function in a file of their own::

    from packrl.registry import POLICY_LOSSES

    @POLICY_LOSSES.register("my_loss")
    def my_loss(inputs): ...

A part with knobs of its own registers them with it, a dataclass of defaults
(``@POLICY_LOSSES.register("my_loss", options=MyLossOptions)``); the config sets them under the
registry's ``args_key`` (``algorithm.policy_loss_args.my_knob=0.5``), checked at load against the
dataclass, and the part receives the built value (``PolicyLossInputs.options``). What a part
declares about itself for the rest of the house to read without building it is the registry's
info class (`packrl.capabilities`: ``register("my_loss", info=LossInfo(reads_old_logprobs=True))``);
`Registry.info` returns it typed, the class's defaults for a part that declared nothing.

The user names the file in ``trainer.plugins`` (a ``.py`` path or an importable module), so every
process of the run (the controller and each data-parallel worker) imports it before the config's
names are checked; ``algorithm.policy_loss=my_loss`` then selects it. Code that calls
`packrl.trainer.loop.train` directly may also just import the file first.

The built-in parts are listed here by name with the module that registers them, and that module
is imported on first lookup: checking a config's names imports no torch (``packrl config`` stays
light), and a lookup never depends on what happened to be imported before. A built-in's
declaration is listed here too (``infos``, from `packrl.capabilities`), so reading it imports
nothing either. An unknown name fails at config load, naming the nearest registered one
(`Registry.problem`).

This module is the bottom layer: of packrl it imports only `packrl.capabilities` (the declarations'
classes, of the same layer) and, for messages, `packrl.errors`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from packrl.capabilities import (
    ARITHMETIC_TASK,
    CHAR_COUNT_TASK,
    CHAR_COUNT_TRACES_TASK,
    COLOCATE_ASYNC,
    COV_LOSS,
    DYNAMIC_SAMPLING_FILTER,
    ENTROPY_FILTER,
    GFPO_FILTER,
    HF_ENGINE,
    MULTI_TURN_WRAPPER,
    ROLLOUT_CORRECTION_FILTER,
    SEPARATE_ASYNC,
    SHAPES_TASK,
    SYNC,
    THINKING_WRAPPER,
    TOKEN_LOSS,
    TOOL_TRACES_TASK,
    VLLM_ENGINE,
    EngineCapabilities,
    FilterInfo,
    LossInfo,
    NoInfo,
    RewardInfo,
    RolloutModeInfo,
    TaskInfo,
    WrapperInfo,
)

T = TypeVar("T")
InfoT = TypeVar("InfoT")


WHOLE_CONFIG = "cfg"
"""The parameter name of a config check that receives the whole `RunConfig` (`call_with_sections`)."""


def call_with_sections(function: Callable[..., T], cfg: Any) -> T:
    """``function`` called with the sections of ``cfg`` (a `RunConfig`) its parameters name: a
    cross-field rule (`packrl.config.relations`, `packrl.config.sft_rules`) or a registered part's
    config check names the sections it reads, e.g. ``def mini_batches(train: TrainConfig, data:
    DataConfig)``, and gets those and nothing else, so what it depends on is in its signature. A
    check that reads the whole config names its parameter ``cfg`` (`WHOLE_CONFIG`); a parameter
    with a default that names neither keeps its default.

    Raises:
        ValueError: a parameter names neither a section nor ``cfg`` and has no default, or is
            ``*args`` / ``**kwargs`` (a mistake in the check's code; the message names the
            function, where it is defined, the parameter and the sections there are).
    """
    sections = {field.name for field in dataclasses.fields(cfg)}
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    for name, parameter in inspect.signature(function).parameters.items():
        value = cfg if name == WHOLE_CONFIG else getattr(cfg, name) if name in sections else None
        if value is None and (parameter.default is inspect.Parameter.empty or parameter.kind in (parameter.VAR_POSITIONAL,
                                                                                                parameter.VAR_KEYWORD)):
            where = getattr(function, "__module__", "?")  # for the message only
            raise ValueError(f"config check {getattr(function, '__qualname__', function)!r} ({where}) takes parameter {name!r}, "
                             f"which is not a section of the config; name sections ({', '.join(sorted(sections))}) or the "
                             f"whole config ({WHOLE_CONFIG}) as its parameters")
        if value is not None and parameter.kind is parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif value is not None:
            keywords[name] = value
    return function(*positional, **keywords)


def _problem_list(found: Any, source: str) -> list[Any]:
    """``found``, a config check's result, as a list of `packrl.errors.ConfigProblem`.

    Raises:
        ValueError: it is not a list or tuple of them (``source`` names the check).
    """
    from packrl.errors import ConfigProblem

    if not isinstance(found, list | tuple) or not all(isinstance(problem, ConfigProblem) for problem in found):
        raise ValueError(f"{source} returned {type(found).__name__} {str(found)[:80]!r}; a config check returns a list of "
                         "packrl.errors.ConfigProblem (empty when nothing is wrong)")
    return list(found)


class Registry(Mapping[str, Any], Generic[InfoT]):
    """Named parts of one kind, selected by the config key ``key``; what each part declares about
    itself is an ``InfoT`` (`packrl.capabilities`).

    Args:
        name: the registry's attribute name in this module (for messages), e.g. ``POLICY_LOSSES``.
        key: the dotted config key that names a part (for messages), e.g. ``algorithm.policy_loss``.
        kind: what a part is, for messages (``policy loss``).
        builtins: name -> module that registers it when imported.
        info: the class of what a part declares with its registration (``InfoT``, e.g.
            `packrl.capabilities.LossInfo`; every field with a default, which a part that declares
            nothing gets), `packrl.capabilities.NoInfo` for a kind whose parts declare nothing.
        checks: name -> ``"module:function"`` of a config check for that part (imported only
            when the config names it): ``function(...) -> list[ConfigProblem]`` taking the config
            sections its parameters name (`call_with_sections`).
        args_key: the dotted config key of a mapping that holds the chosen part's own options
            (``algorithm.policy_loss_args``), or None when parts of this kind take none.
        infos: name -> what a built-in declares about itself (`info`), listed here so that reading
            it does not import the part's own module; its module registers the same declaration.
    """

    def __init__(self, name: str, key: str, kind: str, builtins: dict[str, str], *, info: type[InfoT],
                 checks: dict[str, str] | None = None, args_key: str | None = None, infos: dict[str, InfoT] | None = None):
        self.name, self.key, self.kind, self.args_key, self.info_class = name, key, kind, args_key, info
        self._builtins = dict(builtins)
        self._checks: dict[str, Any] = dict(checks or {})
        self._parts: dict[str, Any] = {}
        self._options: dict[str, type] = {}
        self._builtin_info: dict[str, InfoT] = dict(infos or {})
        self._info: dict[str, InfoT] = dict(self._builtin_info)
        self._no_info: InfoT = info()

    def register(self, name: str, options: type | None = None, info: InfoT | None = None) -> Callable[[T], T]:
        """Decorator: register the decorated object as ``name``.

        Args:
            name: the name a config selects it by.
            options: for a registry with an ``args_key``: the part's own knobs, a dataclass whose
                every field has a default. The config's mapping under ``args_key`` is checked
                against it at load (unknown keys, types, and its ``problems(prefix)`` method when
                it has one, `packrl.config.load.build_options`) and the part receives the built value.
            info: what the part declares about itself for set-up, pre-run checks and the stages to
                read without building it, an instance of the registry's info class (a rollout
                engine's `packrl.capabilities.EngineCapabilities`, a policy loss's `LossInfo`);
                None declares nothing (the class's defaults).

        Raises:
            ValueError: ``name`` is empty, or already registered to another object; ``options`` is
                not a dataclass, or given to a registry without an ``args_key``; ``info`` is not an
                instance of the registry's info class (the one check of a declaration's type: every
                reader takes it as typed).
        """
        if options is not None and (self.args_key is None or not dataclasses.is_dataclass(options)):
            raise ValueError(f"options of {self.kind} {name!r} must be a dataclass, and only a registry with an args_key "
                             f"takes them ({self.name} args_key={self.args_key}); got {options!r}")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if info is not None and not isinstance(info, self.info_class):
            cls = self.info_class.__name__
            wanted = (f"the parts of {self.name} declare nothing: remove info=" if self.info_class is NoInfo else
                      f"declare {'an' if cls[0] in 'AEIOU' else 'a'} {cls} ({self.name}.register(name, info={cls}(...)))")
            where = f"{self.key}.{name}" if self.args_key == self.key else f"{self.key}={name!r}"
            raise ValueError(f"{where} registered info={info!r}; {wanted}")

        def decorate(part: T) -> T:
            if name in self._builtins and name not in self._parts:
                importlib.import_module(self._builtins[name])  # a built-in's name is taken even before its module loads
            held = self._parts.get(name)
            if held is not None and held is not part and _origin(held) != _origin(part):
                raise ValueError(f"{self.kind} {name!r} is already registered ({held!r}); pick another name for {part!r}")
            assert info is None or name not in self._builtin_info or info == self._builtin_info[name], \
                f"{self.name}: the built-in {name!r} registers info={info!r}, but its listing declares {self._builtin_info[name]!r}"
            self._parts[name] = part
            if options is not None:
                self._options[name] = options
            if info is not None:
                self._info[name] = info
            return part

        return decorate

    def options_class(self, name: str) -> type | None:
        """The options dataclass part ``name`` was registered with (its module imported first),
        or None when it takes none."""
        self[name]
        return self._options.get(name)

    def info(self, name: str) -> InfoT:
        """What part ``name`` declared about itself: its registration's ``info=``, or a built-in's
        listing in ``infos`` (read without importing its module); the info class's defaults when it
        declared nothing. A part not listed is imported first (a built-in's module may register one).

        Raises:
            ValueError: ``name`` is not registered (as `lookup`).
        """
        if name not in self._info:
            self.lookup(name)
        return self._info.get(name, self._no_info)

    def register_check(self, name: str) -> Callable[[T], T]:
        """Decorator: ``function(...) -> list[ConfigProblem]`` checks a config that names part
        ``name`` (its settings among the others), at config load; its parameters name the config
        sections it reads (``cfg``: the whole config; `call_with_sections`), as every rule does."""

        def decorate(check: T) -> T:
            held = self._checks.get(name)
            if held is not None and held is not check and (isinstance(held, str) or _origin(held) != _origin(check)):
                raise ValueError(f"{self.kind} {name!r} already has a config check ({held!r}); a second one would replace it: "
                                 f"register your part under a name of its own, or put both checks in one function")
            self._checks[name] = check
            return check

        return decorate

    def config_problems(self, name: str, cfg: Any) -> list:
        """The problems the check of part ``name`` finds in ``cfg`` (none without a check), given
        the sections its parameters name (`call_with_sections`)."""
        check = self._checks.get(name)
        if check is None:
            return []
        if isinstance(check, str):
            check = resolve_target(check)
        source = f"the config check of {self.key}={name} ({getattr(check, '__qualname__', check)!r})"  # for the message only
        return _problem_list(call_with_sections(check, cfg), source)

    def names(self) -> list[str]:
        """Every name a config may use: the built-in ones and those registered so far, sorted."""
        return sorted(set(self._builtins) | set(self._parts))

    def problem(self, name: str) -> tuple[str, str] | None:
        """None when ``name`` is known, else ``(what is wrong, the fix)``: the fix names the nearest
        registered name, every registered one, and how to register another."""
        if name in self._parts or name in self._builtins:
            return None
        names = self.names()
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.4)
        spelled = f"{self.key}.{close[0]}" if close and self.args_key == self.key else f"{self.key}={close[0] if close else ''}"
        nearest = f"did you mean {spelled}? " if close else ""
        return (f"is not a registered {self.kind}",
                f"{nearest}registered: {', '.join(names)}; or register one with "
                f"@packrl.registry.{self.name}.register in a file named in trainer.plugins")

    def lookup(self, name: str) -> Any:
        """The part registered as ``name``, importing its built-in module first when needed.

        Raises:
            ValueError: ``name`` is not registered; the message names ``key``, the nearest name
                and every registered one.
        """
        problem = self.problem(name)
        if problem is not None:
            raise ValueError(f"{self.key}={name!r} {problem[0]}; {problem[1]}")
        return self[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._parts and name in self._builtins:
            importlib.import_module(self._builtins[name])
            assert name in self._parts, f"{self._builtins[name]} does not register the built-in {self.kind} {name!r}"
        return self._parts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._parts or name in self._builtins

    def __repr__(self) -> str:
        return f"Registry({self.key}: {', '.join(self.names())})"


def resolve_target(target: str, owner: str = "") -> Any:
    """The function ``"module:function"`` names (its module imported): a check or hook a
    registration names without importing its module (`LossInfo.prepare`,
    `EngineCapabilities.preflight_notes`, `FilterInfo.warnings`, `WrapperInfo.applies`).

    Raises:
        ValueError: with ``owner`` (what declared it, for the message), the module or the function
            does not exist; ImportError or AttributeError without one (the caller names it).
    """
    module, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as err:
        if not owner:
            raise
        raise ValueError(f"{owner} names {target!r}, which cannot be imported ({err}); name a "
                         "'module:function' that exists (a plugin file names its own module as f\"{__name__}:function\")") from err



def _origin(part: Any) -> tuple[str, str]:
    """Where a part is defined: a module re-executed under another name (a plugin file imported
    twice) registers an equal part, not a clash."""
    return getattr(part, "__module__", "") or "", getattr(part, "__qualname__", "") or ""


REWARDS = Registry("REWARDS", "reward.name", "reward", {"gsm8k": "packrl.reward.gsm8k", "math_verify": "packrl.reward.math_verify",
                                                      "char_count": "packrl.reward.char_count"},
                   info=RewardInfo, checks={"math_verify": "packrl.reward.math_verify:config_problems"})
"""``fn(response_text, ground_truth, *, data_source, cfg: RewardConfig) -> float`` (`packrl.reward.registry.RewardFn`);
its info a `packrl.capabilities.RewardInfo`, registered with it by `packrl.reward.register_reward`."""

ADVANTAGE_ESTIMATORS = Registry("ADVANTAGE_ESTIMATORS", "algorithm.adv_estimator", "advantage estimator",
                                {"grpo": "packrl.algos.advantages", "rloo": "packrl.algos.advantages", "gae": "packrl.algos.gae",
                                 "reinforce_plus_plus": "packrl.algos.reinforce_pp",
                                 "reinforce_plus_plus_baseline": "packrl.algos.reinforce_pp"}, info=NoInfo)
"""``fn(inputs: AdvantageInputs) -> N tensors [R_i]`` (`packrl.algos.advantages.AdvantageFn`)."""

POLICY_LOSSES = Registry("POLICY_LOSSES", "algorithm.policy_loss", "policy loss",
                         {"ppo_clip": "packrl.algos.policy_losses", "gspo": "packrl.algos.policy_losses",
                          "sft": "packrl.algos.policy_losses", "clip_cov": "packrl.algos.cov_losses", "kl_cov": "packrl.algos.cov_losses"},
                         info=LossInfo, checks={"gspo": "packrl.config.relations:gspo_problems"}, args_key="algorithm.policy_loss_args",
                         infos={"ppo_clip": TOKEN_LOSS, "gspo": TOKEN_LOSS, "sft": TOKEN_LOSS, "clip_cov": COV_LOSS, "kl_cov": COV_LOSS})
"""``fn(inputs: PolicyLossInputs) -> PolicyLossOutput`` (`packrl.algos.policy_losses.PolicyLossFn`); its info a
`packrl.capabilities.LossInfo`."""

ROLLOUT_ENGINES = Registry("ROLLOUT_ENGINES", "rollout.engine", "rollout engine",
                           {"hf": "packrl.rollout.hf_engine", "vllm": "packrl.rollout.vllm_engine"},
                           info=EngineCapabilities, checks={"vllm": "packrl.rollout.vllm_settings:config_problems"},
                           infos={"hf": HF_ENGINE, "vllm": VLLM_ENGINE})
"""``factory(context: EngineContext) -> RolloutEngine`` (`packrl.rollout.engine.EngineFactory`); its info a
`packrl.capabilities.EngineCapabilities`."""

TOOLS = Registry("TOOLS", "rollout.multi_turn.tools", "tool", {"calculator": "packrl.rollout.tools"}, info=NoInfo)
"""``fn(arguments: dict) -> str`` (`packrl.rollout.tools.Tool`); raises `packrl.rollout.tools.ToolError` for a bad call."""

_LENGTH_PARTS = ("group_length", "efficiency", "shortest_correct", "target_length")
"""The length objectives (`packrl.reward.length`), one module each."""

REWARD_SHAPING = Registry("REWARD_SHAPING", "reward.shaping", "reward-shaping part",
                          {"overlong": "packrl.reward.overlong", "tool_format": "packrl.reward.tool_format",
                           **{part: f"packrl.reward.length.{part}" for part in _LENGTH_PARTS}},
                          info=NoInfo, checks={"overlong": "packrl.reward.overlong:config_problems",
                                               "tool_format": "packrl.reward.tool_format:config_problems",
                                               **{part: f"packrl.reward.length.{part}:config_problems" for part in _LENGTH_PARTS}},
                          args_key="reward.shaping")
"""``fn(inputs: ShapingInputs) -> ShapingOutput`` (`packrl.reward.shaping.ShapingFn`). Its config key holds a
mapping, part name -> that part's options (``args_key`` is the key itself); a part's check, as every
other, takes the sections its parameters name (``def check(reward: RewardConfig, rollout: RolloutConfig)``)
and reads its own settings as given, ``reward.shaping[<part>]``."""

ROLLOUT_MODES = Registry("ROLLOUT_MODES", "trainer.rollout_mode", "rollout mode",
                         {"sync": "packrl.trainer.stages.rounds", "colocate_async": "packrl.trainer.stages.partial",
                          "separate_async": "packrl.trainer.stages.separate"},
                         info=RolloutModeInfo, checks={"sync": "packrl.config.rollout_modes:sync_problems",
                                                       "colocate_async": "packrl.config.rollout_modes:colocate_async_problems",
                                                       "separate_async": "packrl.config.rollout_modes:separate_async_problems"},
                         infos={"sync": SYNC, "colocate_async": COLOCATE_ASYNC, "separate_async": SEPARATE_ASYNC})
"""``factory(context: StageContext) -> SamplingStage`` (`packrl.trainer.stages.StageFactory`); its info a
`packrl.capabilities.RolloutModeInfo`."""

TASKS = Registry("TASKS", "data.task_args", "task",
                 {"arithmetic": "packrl.data.tasks", "char_count": "packrl.data.char_count", "shapes": "packrl.data.shapes",
                  "tool_traces": "packrl.data.tool_traces", "char_count_traces": "packrl.data.char_count_traces"},
                 info=TaskInfo, args_key="data.task_args",
                 infos={"arithmetic": ARITHMETIC_TASK, "char_count": CHAR_COUNT_TASK, "shapes": SHAPES_TASK,
                        "tool_traces": TOOL_TRACES_TASK, "char_count_traces": CHAR_COUNT_TRACES_TASK})
"""``fn(request: TaskRequest) -> rows`` (`packrl.data.task_sources.TaskFn`): the rows of a source
``task:<name>`` (``data.train_files``, ``data.val_files``; ``sft.train_files`` for traces); its info
a `packrl.capabilities.TaskInfo` (what it makes, where its options are). A plugin task's options
are a mapping under ``data.task_args.<name>`` (``args_key`` is the key itself), checked at load."""

FILTERS = Registry("FILTERS", "algorithm.filters", "filter",
                   {"dynamic_sampling": "packrl.algos.dynamic_sampling", "gfpo": "packrl.algos.group_filter",
                    "rollout_correction": "packrl.algos.rollout_correction", "entropy": "packrl.algos.entropy_filter"},
                   info=FilterInfo, checks={"dynamic_sampling": "packrl.algos.dynamic_sampling:config_problems",
                                            "gfpo": "packrl.algos.group_filter:config_problems"},
                   args_key="algorithm.filters",
                   infos={"dynamic_sampling": DYNAMIC_SAMPLING_FILTER, "gfpo": GFPO_FILTER,
                          "rollout_correction": ROLLOUT_CORRECTION_FILTER, "entropy": ENTROPY_FILTER})
"""``fn(inputs: FilterInputs) -> FilterOutput`` (`packrl.algos.filters.FilterFn`): which responses go on
to the advantages and the loss; its info a `packrl.capabilities.FilterInfo` (its stage, its order, the
modes it runs in). Its config key holds a mapping, filter name -> its options (``args_key`` is the key
itself), as ``reward.shaping`` does; a filter with a ``settings_key`` is in every run's chain instead."""

ENGINE_WRAPPERS = Registry("ENGINE_WRAPPERS", "rollout", "engine wrapper",
                           {"multi_turn": "packrl.rollout.multi_turn", "thinking": "packrl.rollout.thinking"},
                           info=WrapperInfo, infos={"multi_turn": MULTI_TURN_WRAPPER, "thinking": THINKING_WRAPPER})
"""``fn(engine, context: WrapperContext) -> RolloutEngine`` (`packrl.rollout.engine.WrapperFn`): an engine
that serves the run's engine (multi-turn tool loops, thinking budgets); its info a
`packrl.capabilities.WrapperInfo` (when it applies, its order, the capabilities it keeps, its
preflight hooks). No config key names one: a wrapper applies where its ``applies`` says."""

CONFIG_REGISTRIES: dict[str, Registry[Any]] = {r.key: r for r in (REWARDS, ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES, TOOLS,
                                                             REWARD_SHAPING, ROLLOUT_MODES, TASKS, FILTERS)}
"""Config key -> the registry its value (each value of a list, each key of a mapping) is looked up in (checked by
`packrl.config.load`)."""


def import_plugins(plugins: list[str]) -> list[tuple[str, str]]:
    """Import each of ``trainer.plugins``: a ``.py`` file path or a module name. Importing registers
    the parts it defines. A file is imported once per process (keyed by its resolved path).

    Returns:
        ``(plugin, error)`` for each plugin that could not be imported (empty when all were).
    """
    failures = []
    for plugin in plugins:
        try:
            _import_plugin(plugin)
        except Exception as err:  # noqa: BLE001 - user code: any failure is reported with its type
            failures.append((plugin, f"{type(err).__name__}: {err}"))
    return failures


def _import_plugin(plugin: str) -> None:
    if not plugin.endswith(".py"):
        importlib.import_module(plugin)
        return
    path = Path(plugin).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    name = f"packrl_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
