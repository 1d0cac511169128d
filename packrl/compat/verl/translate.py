"""Translate a verl launch script's overrides into a packrl preset plus dotlist overrides.

``translate(["data.train_batch_size=1024", "actor_rollout_ref.rollout.n=5", ...])`` returns a
`Translation`: the packrl overrides (on top of the `PRESET` preset), what each came from with
every unit conversion, and the verl keys packrl does not use with the reason. Keys verl does not
have (naming the nearest verl key) and keys packrl cannot honour are raised together as one
`ConfigError` whose problems name the verl key, the value, why and the fix.

It runs in three passes over the given overrides (plus verl's defaults, `DEFAULTS`):

1. `apply_table`: every executable rule of `VERL_KEYS` (a 1:1 key, or a unit or name
   conversion of that one value) maps its key;
2. `relational.STEPS`: the conversions that need several verl keys (token budgets from
   micro-batch keys, steps from epochs and rows, the critic, KL, filter groups, ...);
3. `_generic`: every key left is named as ignored with its rule's reason, or refused.

Units (verl -> packrl), as in docs/verl.md:

=========================================================  =====================================
verl                                                       packrl
=========================================================  =====================================
``data.train_batch_size`` (prompts)                        ``data.batch_size`` (prompts)
``AR.actor.ppo_mini_batch_size`` (prompts)                 ``train.mini_batch_size`` (prompts)
``AR.actor.ppo_max_token_len_per_gpu`` (dynamic bsz)       ``train.max_tokens_per_microbatch``
  (tokens per GPU; a pack holds x ulysses size)              (tokens per rank; same x semantics)
``AR.actor.ppo_micro_batch_size_per_gpu`` (sequences)      m x (P + R) / ulysses tokens per rank
``AR.actor.ppo_micro_batch_size`` (sequences, all GPUs)    per GPU = m / (GPUs / ulysses), then as above
``trainer.n_gpus_per_node`` x ``trainer.nnodes``           ``trainer.num_workers``
``trainer.total_epochs``                                   epochs x floor(rows / batch) steps
=========================================================  =====================================

Keys a script does not set take verl's defaults (``ppo_trainer.yaml``) where they change what
is trained (advantage estimator ``gae``, ``rollout.n=1``, weight decay 0.01, ...); speed and
memory settings keep packrl's. The module is pure (no torch, no data files: the caller counts
the training rows): translating verl's 38-override GSM8K GRPO script takes a few milliseconds
once the preset is read, so ``packrl verl --dry-run`` answers before any model could load.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from packrl.compat.verl.context import PRESET, Context, same
from packrl.compat.verl.convert import Converted, NoEffect, Refused, files
from packrl.compat.verl.keys import ANY, DEFAULTS, VERL_KEYS, nearest_key, rule_of
from packrl.compat.verl.overrides import Translation, VerlOverride, format_value, parse_override
from packrl.compat.verl.relational import STEPS
from packrl.errors import ConfigError, ConfigProblem

logger = logging.getLogger(__name__)

__all__ = ["PRESET", "apply_table", "sources_of", "train_files_of", "translate"]


def translate(args: Sequence[str], *, num_train_rows: int | None = None) -> Translation:
    """Translate a verl script's overrides into packrl's.

    Args:
        args: the overrides as written after ``python3 -m verl.trainer.main_ppo``
            (``key=value``, ``+key=value``, ``++key=value``); a later one for a key wins.
        num_train_rows: rows of ``data.train_files`` (for ``trainer.total_epochs`` when
            ``trainer.total_training_steps`` is not set); None = unknown.

    Returns:
        The `Translation` on top of `PRESET`: the packrl overrides with their verl sources and
        conversions, and the verl keys given that packrl does not use, with the reason.

    Raises:
        ConfigError: every override that is not one, every key verl does not have (with the
            nearest verl key) and every value packrl cannot honour (with the reason and fix).
    """
    given: dict[str, VerlOverride] = {}
    problems = []
    for text in args:
        try:
            item = parse_override(text)
        except ValueError as err:
            problems.append(ConfigProblem("override", text, str(err), "write verl overrides as key=value, e.g. data.train_batch_size=256"))
            continue
        if rule_of(item.key) is None:
            near = nearest_key(item.key)
            fix = f"did you mean {near}?" if near else "see docs/verl.md for the verl keys packrl knows"
            if _is_packrl_key(item.key):
                fix = f"{item.key} is a packrl key: add it to the `packrl train` command that `packrl verl --dry-run` prints"
            problems.append(ConfigProblem(item.key, item.value, "is not a verl config key", fix))
            continue
        if item.key in given:
            logger.warning("%s is given twice or more in the verl command (%s=%s, then %s=%s); the last is used",
                           item.key, item.key, given[item.key].value, item.key, item.value)
        given[item.key] = item
    c = Context(given, num_train_rows=num_train_rows)
    apply_table(c)
    for step in STEPS:
        step(c)
    _generic(c)
    if problems or c.problems:
        raise ConfigError(list({str(p): p for p in problems + c.problems}.values()))  # a value read twice is named once
    return Translation(PRESET, tuple(c.mappings.values()), tuple(c.ignored))


def apply_table(c: Context) -> None:
    """Map every executable rule's verl key that is given or has a verl default (`DEFAULTS`):
    ``rule.convert(value)`` becomes ``rule.targets[0]``; a `Refused` value is a problem of ``c``,
    a `NoEffect` one is named as ignored with its reason (or left to `_generic`)."""
    for key, rule in VERL_KEYS.items():
        if rule.convert is None or not (c.has(key) or key in DEFAULTS):
            continue
        value = c.get(key)
        try:
            out = rule.convert(value)
        except Refused as refused:
            c.refuse(key, refused.message, refused.fix.format(key=key), value=value)
            continue
        if isinstance(out, NoEffect):
            if out.reason:
                c.ignore(key, out.reason)
            continue
        value, note = (out.value, out.note) if isinstance(out, Converted) else (out, "")
        c.set(rule.targets[0], value, key, conversion=note)


def _generic(c: Context) -> None:
    """Every key not yet handled: ignored with its rule's reason, refused when its value is not
    accepted; a mapped key nothing used had no effect in this configuration."""
    for key, item in c.given.items():
        if key in c.handled:
            continue
        rule = rule_of(key)
        assert rule is not None, f"{key} passed the known-key check"
        if rule.mapped:
            c.ignore(key, f"no effect in this configuration (it maps to {rule.packrl} when it acts)")
        elif rule.accept is ANY or any(same(item.value, v) for v in rule.accept):
            c.ignore(key, rule.reason)
        else:
            accepted = ", ".join(format_value(v) for v in rule.accept)
            c.refuse(key, f"{rule.reason} (accepted: {accepted})", rule.fix or f"remove {key}")


def _is_packrl_key(key: str) -> bool:
    """Whether ``key`` names a field of packrl's `RunConfig` or a key under one of its open mappings
    (``algorithm.filters.gfpo.keep``, ``reward.shaping.*``: a packrl override given to `packrl verl`)."""
    import dataclasses

    from packrl.config.schema import RunConfig

    node: Any = RunConfig
    for part in key.split("."):
        if isinstance(node, dict):
            return True  # an open mapping's keys are its parts' names and knobs
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        value = getattr(node(), part)
        node = type(value) if dataclasses.is_dataclass(value) else value if isinstance(value, dict) else None
    return True


def train_files_of(args: Sequence[str]) -> list[str]:
    """The ``data.train_files`` a verl script names, ``~`` expanded (verl's default when it names
    none), for counting rows before `translate`; overrides that do not parse are skipped here."""
    value: Any = DEFAULTS["data.train_files"]
    for text in args:
        try:
            item = parse_override(text)
        except ValueError:
            continue
        if item.key == "data.train_files":
            value = item.value
    return files(value)


def sources_of(translation: Translation, problem: ConfigProblem) -> str:
    """The verl overrides behind the packrl keys of ``problem``, comma-separated ("" when none),
    so a problem packrl finds in the translated config names what to change in the verl command."""
    by_key = {m.key: m for m in translation.mappings}
    found = [s for key in problem.involved_keys if key in by_key for s in by_key[key].sources]
    return ", ".join(dict.fromkeys(found))
