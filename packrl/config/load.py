"""Load a `RunConfig` from a YAML preset plus `key=value` dotlist overrides.

PyYAML's safe loader reads preset files (data only: no code, no interpolation); OmegaConf
parses the dotlist overrides with YAML typing. A preset file is a whole config: keys it leaves
out take the schema defaults (they do not inherit from another preset). A key written twice in
one mapping of a preset is refused, naming both values and lines (YAML 1.2 requires unique keys;
OmegaConf's loader refuses them too, where PyYAML keeps the last silently). A key given twice
among the overrides takes the last value, as OmegaConf's dotlist and Hydra do (a script that
ends with ``"$@"`` relies on it), with a warning naming the key and every value. This module
then checks every value against the dataclass schema.
Unknown keys, wrong types, bad choices, out-of-range values and broken relations between
budgets are all collected and raised as one `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import types
import typing
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from packrl.config.relations import config_problems, config_warnings
from packrl.config.schema import NOT_OFFERED, RunConfig
from packrl.errors import ConfigError, ConfigProblem
from packrl.registry import CONFIG_REGISTRIES, Registry, import_plugins

DEFAULT_PRESET = "demo"

logger = logging.getLogger("packrl.config")


def preset_names() -> list[str]:
    """Names of the presets shipped with packrl (``packrl/config/presets/*.yaml``)."""
    root = resources.files("packrl.config") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _read_preset(preset: str) -> dict[str, Any]:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError([ConfigProblem("preset", preset, "YAML file not found", "pass an existing .yaml path or a preset name")])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError([ConfigProblem("preset", preset, f"cannot read the file: {err}", "pass a UTF-8 YAML file")]) from err
    elif preset in preset_names():
        text = (resources.files("packrl.config") / "presets" / f"{preset}.yaml").read_text()
    else:
        names = ", ".join(preset_names())
        if "." in preset and preset.split(".", 1)[0] in {f.name for f in dataclasses.fields(RunConfig)}:
            raise ConfigError([ConfigProblem("override", preset, "is a config key without a value (read as a preset name)",
                                             f"write {preset}=<value>, e.g. train.total_steps=10")])
        raise ConfigError([ConfigProblem("preset", preset, f"no such preset (known: {names})", "pass a preset name or a .yaml path")])
    try:
        data = yaml.safe_load(text)
        repeated = _repeated_yaml_keys(yaml.compose(text, Loader=yaml.SafeLoader), text)
    except yaml.YAMLError as err:
        raise ConfigError([ConfigProblem("preset", preset, f"unreadable YAML: {err}", "fix the YAML syntax")]) from err
    if repeated:
        raise ConfigError([ConfigProblem(key, second, f"is written twice in the same mapping of preset {preset}: {first} "
                                         f"(line {line1}) and {second} (line {line2}); YAML keys must be unique, and which "
                                         "value is meant is unknown", f"delete one of the two lines of {key}")
                           for key, first, line1, second, line2 in repeated])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("preset", preset, "top level is not a mapping",
                                         "write sections such as `data:` at the top level")])
    return data


def _repeated_yaml_keys(node: yaml.Node | None, text: str, prefix: str = "") -> list[tuple[str, str, int, str, int]]:
    """``(dotted key, first value, its line, next value, its line)`` for each key written twice
    in one mapping of a composed YAML document (values as written in ``text``; lines from 1)."""
    if isinstance(node, yaml.SequenceNode):
        return [r for item in node.value for r in _repeated_yaml_keys(item, text, prefix)]
    if not isinstance(node, yaml.MappingNode):
        return []
    seen: dict[str, yaml.Node] = {}
    out = []
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}" if isinstance(key_node, yaml.ScalarNode) else f"{prefix}?"
        if key in seen:
            out.append((key, _as_written(seen[key], text), seen[key].start_mark.line + 1,
                        _as_written(value_node, text), value_node.start_mark.line + 1))
        seen[key] = value_node
        out += _repeated_yaml_keys(value_node, text, f"{key}.")
    return out


def _as_written(node: yaml.Node, text: str) -> str:
    written = " ".join(text[node.start_mark.index:node.end_mark.index].split())
    return written if len(written) <= 60 else written[:57] + "..."


def _literal_if_needed(item: str) -> str:
    """``key=value`` with ``value`` quoted when YAML would not read it as written: a ``#`` would
    start a comment (``Give the answer after ####``) and some characters (``@``, `` ` ``, ``%``,
    ``*``, unbalanced brackets) are YAML syntax errors. Such values are taken as plain text."""
    key, value = item.split("=", 1)
    try:
        yaml.safe_load(value)
        plain = "#" not in value
    except yaml.YAMLError:
        plain = False
    if plain:
        return item
    if value.startswith("[") and value.endswith("]"):  # a list of plain strings, e.g. rollout.stop=[####]
        return f"{key}={json.dumps([v.strip() for v in value[1:-1].split(',') if v.strip()])}"
    return f"{key}={json.dumps(value)}"


def _parse_overrides(overrides: list[str]) -> dict[str, Any]:
    problems = []
    for item in overrides:
        if item.startswith("-") or "=" not in item or not item.split("=", 1)[0].strip():
            fix = "write overrides as dotted.key=value, e.g. data.max_prompt_tokens=1024"
            if item in preset_names() or item.endswith((".yaml", ".yml")):
                fix = f"put the preset first: packrl <command> {item} key=value ..."
            problems.append(ConfigProblem("override", item, "is not a key=value override", fix))
    if problems:
        raise ConfigError(problems)
    _warn_repeated_overrides(overrides)
    try:
        # a dotlist always builds a DictConfig with string keys, so its container is a dict[str, Any]
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([_literal_if_needed(o) for o in overrides]), resolve=False)
        return cast(dict[str, Any], parsed)
    except OmegaConfBaseException as err:
        raise ConfigError([ConfigProblem("overrides", overrides, f"could not parse: {err}",
                                         "write overrides as dotted.key=value")]) from err


def _warn_repeated_overrides(overrides: list[str]) -> None:
    """Warn for each key given more than once among the overrides: the last value is used."""
    values: dict[str, list[str]] = {}
    for item in overrides:
        key, value = item.split("=", 1)
        values.setdefault(key.strip(), []).append(value)
    for key, given in values.items():
        if len(given) > 1:
            logger.warning("%s is overridden %d times on the command line (%s); the last, %s=%s, is used", key, len(given),
                           ", then ".join(f"{key}={v}" for v in given), key, given[-1])


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += _all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def nearest_key(key: str, keys: list[str]) -> str | None:
    """The valid key a mistyped ``key`` most likely meant: one that ends in the same name (in the
    same section first, e.g. ``rollout.max_turns`` -> ``rollout.multi_turn.max_turns``; then the
    least nested; then the first declared, so the RL sections come before the ``sft`` section that
    repeats some of their names: ``train.max_prompt_tokens`` -> ``data.max_prompt_tokens``), else
    the closest spelling of the whole dotted key; None when nothing is close."""
    leaf, section = key.rsplit(".", 1)[-1], key.split(".", 1)[0]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        order = {k: i for i, k in enumerate(keys)}
        return min(same_leaf, key=lambda k: (k.split(".", 1)[0] != section, k.count("."), order[k]))
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return close[0] if close else None


def _convert(hint: Any, value: Any) -> Any:
    """Return ``value`` as type ``hint`` or raise TypeError with what was expected."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise TypeError(f"must be one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value)
            except TypeError as err:
                errors.append(str(err))
        raise TypeError(" or ".join(errors) + (" or null" if type(None) in args else ""))
    if origin is list:
        (item,) = typing.get_args(hint)
        values = value if isinstance(value, list) else [value]  # a single value is a 1-item list
        return [_convert(item, v) for v in values]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            raise TypeError("must be a mapping of names to values (write section.key.name=value)")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)
        raise TypeError("must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError("must be a number")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError("must be a string")
    raise TypeError(f"unsupported config type {hint}")  # schema bug, not user input


def _build(cls: type, data: Any, prefix: str, problems: list[ConfigProblem], bad: set[str], keys: list[str] | None = None) -> Any:
    """Build dataclass ``cls`` from ``data``; bad values fall back to defaults and are recorded.
    An unknown key is matched against ``keys`` (dotted, every key of a `RunConfig` by default)."""
    if not isinstance(data, dict):
        problems.append(ConfigProblem(prefix.rstrip("."), data, "must be a mapping of keys", f"write {prefix}<key>=value"))
        bad.update(k for k in _all_keys(cls, prefix))
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names and isinstance(data[key], dict) and data[key]:  # a misspelled section: name each key in it
            for leaf, value in _flatten(data[key], f"{prefix}{key}."):
                close = nearest_key(leaf, _all_keys(RunConfig) if keys is None else keys)
                moved = _moved(leaf) if keys is None else None
                problems.append(ConfigProblem(leaf, value, "unknown key", moved or (f"did you mean {close}?" if close else
                                              f"valid sections here: {', '.join(sorted(names))}")))
        elif key not in names:
            full = f"{prefix}{key}"
            if keys is None:
                close = nearest_key(full, _all_keys(RunConfig))
            else:  # a part's options: a close spelling of the field itself, else the list
                near = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
                close = f"{prefix}{near[0]}" if near else None
            fix = _option_home(full) if keys is None else None
            fix = fix or (f"did you mean {close}?" if close else f"valid keys here: {', '.join(sorted(names))}")
            problems.append(ConfigProblem(full, data[key], "unknown key", fix))
    kwargs = {}
    for name in names & data.keys():
        hint, value, full = hints[name], data[name], f"{prefix}{name}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{full}.", problems, bad, keys)
            continue
        try:
            kwargs[name] = _convert(hint, value)
        except TypeError as err:
            expected = str(err)
            fix = f"set {full} to {expected.removeprefix('must be ')}" if expected.startswith("must be ") else f"set {full}=<value>"
            if full in NOT_OFFERED and str(value) in NOT_OFFERED[full]:
                fix = NOT_OFFERED[full][str(value)]
            elif typing.get_origin(hint) is Literal:
                matches = difflib.get_close_matches(str(value), [str(c) for c in typing.get_args(hint)], n=1)
                fix = f"did you mean {full}={matches[0]}?" if matches else fix
            problems.append(ConfigProblem(full, value, str(err), fix))
            bad.add(full)
    return cls(**kwargs)


def _flatten(data: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        out += _flatten(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [(f"{prefix}{key}", value)]
    return out


def _moved(key: str) -> str | None:
    """The fix for ``key`` when it, or a section above it, is a key of an earlier release (`MOVED`), else None."""
    for old, new in MOVED.items():
        if key == old or key.startswith(f"{old}."):
            return f"{old} moved: write {new}"
    return None


def _option_home(key: str) -> str | None:
    """The fix for an unknown ``key`` of a section whose leaf is an option of a registered part
    there (``algorithm.clip_cov_ub`` -> ``algorithm.policy_loss_args.clip_cov_ub`` with
    ``algorithm.policy_loss=clip_cov``), or None. Imports the parts' modules: an error path only."""
    if (moved := _moved(key)) is not None:
        return moved
    section, leaf = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    for registry in CONFIG_REGISTRIES.values():
        if registry.args_key is None or registry.args_key.split(".", 1)[0] != section:
            continue
        for name in registry.names():
            cls = registry.options_class(name)
            if cls is not None and leaf in {f.name for f in dataclasses.fields(cls)}:
                if registry.args_key == registry.key:  # a mapping of parts to their options
                    return f"did you mean {registry.key}.{name}.{leaf}? (an option of the {registry.kind} {name})"
                return f"did you mean {registry.args_key}.{leaf}? (an option of {registry.key}={name})"
    return None


MOVED = {
    "reward.overlong_buffer_tokens": "reward.shaping.overlong.buffer_tokens=N (the overlong ramp is a reward-shaping part)",
    "reward.overlong_penalty_factor": "reward.shaping.overlong.penalty_factor=F (the overlong ramp is a reward-shaping part)",
    "reward.format_weight": "reward.shaping.tool_format.weight=W (the tool-call format reward is a reward-shaping part)",
    "algorithm.clip_ratio_c": "algorithm.policy_loss_args.clip_ratio_c=C (the dual clip is an option of the ppo_clip policy loss)",
    "algorithm.filter_groups": "algorithm.filters.dynamic_sampling={} with its metric and max_num_gen_batches (dynamic sampling "
                               "is a filter; enable=true is the filter's presence)",
    "algorithm.group_filter": "algorithm.filters.gfpo.keep=K with its metric (GFPO is a filter)",
    "algorithm.entropy_filter": "algorithm.filters.entropy.threshold=T or .quantile=Q (the entropy filter is a filter)",
}
"""Keys of earlier releases -> where their setting lives now (named in the unknown-key problem)."""


def build_options(cls: type, args: dict[str, Any], prefix: str) -> tuple[Any, list[ConfigProblem]]:
    """A registered part's options (a dataclass with defaults, `packrl.registry.Registry.register`)
    built from the config's mapping ``args`` (e.g. ``algorithm.policy_loss_args``), with the same
    type conversions and messages as every other key, then the options' own ``problems(prefix)``
    check when the class has one.

    Args:
        cls: the options dataclass. args: key -> value as the config holds them.
        prefix: the mapping's dotted key with a trailing dot, for messages.

    Returns:
        ``(options, problems)``: on problems the options hold defaults where a value was bad.
    """
    problems: list[ConfigProblem] = []
    bad: set[str] = set()
    options = _build(cls, args, prefix, problems, bad, keys=_all_keys(cls, prefix))
    check = getattr(options, "problems", None)
    if callable(check):
        problems += [p for p in check(prefix.rstrip(".")) if not bad.intersection(p.involved_keys)]
    return options, problems


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(preset: str | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                rules: Callable[[RunConfig], list[ConfigProblem]] = config_problems,
                warnings: Callable[[RunConfig], list[ConfigProblem]] | None = config_warnings) -> RunConfig:
    """Resolve a run config.

    Args:
        preset: a shipped preset name (see `preset_names`) or a path to a ``.yaml`` file;
            None means ``demo``.
        overrides: ``dotted.key=value`` strings applied after the preset, e.g.
            ``["data.max_prompt_tokens=1024", "algorithm.loss_agg_mode=seq-mean-token-mean"]``.
        rules: the recipe's checks after parsing: RL's (`packrl.config.relations.config_problems`:
            every section's own checks and every cross-field rule) by default; `packrl sft` passes
            `packrl.config.sft_rules.sft_load_problems` (RL's cross-field rules do not apply to it).
        warnings: the recipe's warnings, each logged once the config loaded: RL's
            (`packrl.config.relations.config_warnings`) by default; None for none (`packrl sft`).

    Returns:
        The frozen, validated `RunConfig`.

    Raises:
        ConfigError: (a ValueError) listing every problem: unknown keys with the nearest valid
            key, wrong types, invalid choices, values out of range and broken budget relations,
            each with its dotted key, the value seen and the fix.
    """
    cfg, problems, _ = check_config(preset, overrides, rules=rules)
    if problems:
        raise ConfigError(problems)
    for warning in warnings(cfg) if warnings is not None else []:
        logger.warning("%s", warning)
    return cfg


def check_config(
    preset: str | None = None, overrides: list[str] | tuple[str, ...] = (), *,
    rules: Callable[[RunConfig], list[ConfigProblem]] = config_problems,
) -> tuple[RunConfig, list[ConfigProblem], set[str]]:
    """Like `load_config` (``rules`` as there), but return the problems instead of raising them.

    Returns:
        ``(cfg, problems, bad_keys)``: the config with defaults in place of values that did not
        parse, every problem (deduplicated), and the dotted keys whose values did not parse (so
        a caller adding its own relation checks can drop those that depend on them).

    Raises:
        ConfigError: the preset itself cannot be read, or an override is not ``key=value``.
    """
    data = _merge(_read_preset(preset or DEFAULT_PRESET), _parse_overrides(list(overrides)))
    problems: list[ConfigProblem] = []
    bad: set[str] = set()
    cfg = _build(RunConfig, data, "", problems, bad)
    problems += _plugin_problems(cfg.trainer.plugins)  # first: a rule may ask what a plugin's part declares
    problems += [p for p in rules(cfg) if not bad.intersection(p.involved_keys)]
    problems += _registry_problems(cfg, bad)
    unique = {str(p): p for p in problems}  # a field check and a relation check may say the same
    return cfg, list(unique.values()), bad


def _plugin_problems(plugins: list[str]) -> list[ConfigProblem]:
    """Import ``trainer.plugins`` (their parts register); one problem per plugin that cannot be imported."""
    return [ConfigProblem("trainer.plugins", plugin, f"cannot be imported ({error})", "fix the plugin or remove it from trainer.plugins")
            for plugin, error in import_plugins(plugins)]


def _registry_problems(cfg: RunConfig, bad: set[str]) -> list[ConfigProblem]:
    """Check every key that names a registered part (`packrl.registry.CONFIG_REGISTRIES`; the
    plugins imported by `_plugin_problems`), naming the nearest registered name."""
    problems: list[ConfigProblem] = []
    for key, registry in CONFIG_REGISTRIES.items():
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if isinstance(value, dict):  # name -> the part's options (reward.shaping)
            problems += _mapping_problems(registry, value, cfg, bad)
            continue
        for name in (value if isinstance(value, list) else [value]):
            problem = None if key in bad else registry.problem(name)
            if problem is not None:
                problems.append(ConfigProblem(key, value, f"holds {name!r}, which {problem[0]}" if isinstance(value, list) else problem[0],
                                              problem[1]))
            elif key not in bad:
                problems += registry.config_problems(name, cfg) + _options_problems(registry, name, cfg)
    return problems


def _mapping_problems(registry: Registry, value: dict[str, Any], cfg: RunConfig, bad: set[str]) -> list[ConfigProblem]:
    """A mapping of registered names to each part's options: every name known, every mapping
    fitting its part's options, every part's check (a name set to null is off and not checked)."""
    problems: list[ConfigProblem] = []
    for name, args in value.items():
        key = f"{registry.key}.{name}"
        if args is None or key in bad or not isinstance(args, dict):
            continue  # off, or the section's own check names a value that is not a mapping
        problem = registry.problem(name)
        if problem is not None:
            problems.append(ConfigProblem(key, args, problem[0], problem[1]))
            continue
        cls = registry.options_class(name)
        if cls is None and args:
            problems.append(ConfigProblem(key, args, f"has no effect: {registry.kind} {name} reads no options",
                                          f"set {key}={{}}"))
        elif cls is not None:
            problems += build_options(cls, args, f"{key}.")[1]
        problems += registry.config_problems(name, cfg)
    return problems


def _options_problems(registry: Registry, name: str, cfg: RunConfig) -> list[ConfigProblem]:
    """The problems of the options a config gives part ``name`` under ``registry.args_key``
    (the part's module is imported only when the mapping is not empty)."""
    if registry.args_key is None:
        return []
    args: Any = cfg
    for part in registry.args_key.split("."):
        args = getattr(args, part)
    if not args:
        return []
    cls = registry.options_class(name)
    if cls is None:
        return [ConfigProblem(registry.args_key, args, f"has no effect: {registry.key}={name} reads no options",
                              f"remove {registry.args_key}, or pick a {registry.kind} that reads them")]
    return [_other_parts_option(registry, name, p) for p in build_options(cls, args, f"{registry.args_key}.")[1]]


def _other_parts_option(registry: Registry, name: str, problem: ConfigProblem) -> ConfigProblem:
    """``problem``, whose fix names the part that reads the key when it is an unknown key of part
    ``name``'s options and an option of another part (``algorithm.policy_loss_args.clip_ratio_c``
    with ``algorithm.policy_loss=clip_cov``: an option of ``ppo_clip``). Imports the parts'
    modules: an error path only."""
    leaf = problem.key.rsplit(".", 1)[-1]
    if problem.message != "unknown key":
        return problem
    for other in registry.names():
        cls = registry.options_class(other) if other != name else None
        if cls is not None and leaf in {f.name for f in dataclasses.fields(cls)}:
            return dataclasses.replace(problem, message=f"unknown key: {registry.key}={name} does not read it, {other} does",
                                       fix=f"set {registry.key}={other}, or remove {problem.key}",
                                       keys=(problem.key, registry.key))
    return problem


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what ``packrl config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))
