"""The state of one translation: the verl overrides given, verl's defaults, and what has been made of them.

`Context` is what the table loop and every relational conversion read from and write to: the
packrl overrides (`Mapping` each, with its verl sources), the verl keys named as ignored, and the
problems found. `PRESET` is the packrl preset the overrides apply to; an override left at
verl's default is written only where the preset holds another value (`preset_value`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from packrl.compat.verl.convert import Refused, as_float, as_int
from packrl.compat.verl.keys import DEFAULTS
from packrl.compat.verl.overrides import IgnoredKey, Mapping, VerlOverride, format_value
from packrl.errors import ConfigProblem

PRESET = "gsm8k"
"""The packrl preset the overrides apply to (GSM8K files, the ``gsm8k`` reward)."""
MISSING = object()
"""`preset_value` for a key the preset lacks, and `Context.refuse` for "the key's own value"."""


@lru_cache(maxsize=1)
def _preset_config() -> Any:
    from packrl.config.load import load_config

    return load_config(PRESET)


def preset_value(key: str) -> Any:
    """The value of dotted packrl ``key`` in the `PRESET` config, or `MISSING`."""
    value: Any = _preset_config()
    for part in key.split("."):
        value = value.get(part, MISSING) if isinstance(value, dict) else getattr(value, part, MISSING)
        if value is MISSING:
            return MISSING
    return value


def same(a: Any, b: Any) -> bool:
    """Whether two config values are equal, numbers to 1e-12 relative (1e-6 == 0.000001)."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


@dataclass
class Context:
    """The given overrides with verl's defaults, and what the translation has made of them."""

    given: dict[str, VerlOverride]
    mappings: dict[str, Mapping] = field(default_factory=dict)
    ignored: list[IgnoredKey] = field(default_factory=list)
    problems: list[ConfigProblem] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)
    num_train_rows: int | None = None
    total_steps: int | None = None
    """The run's steps, once `_total_steps` has them (None = unknown)."""
    sequence_parallel: int = 1
    """The Ulysses size, once `_parallel` has it."""
    longest: int = 1024
    """Prompt + response budget in tokens, once `_lengths` has them."""

    def has(self, key: str) -> bool:
        """Whether the script gives verl key ``key``."""
        return key in self.given

    def get(self, key: str, default: Any = None) -> Any:
        """The given value of ``key``, else verl's default (`DEFAULTS`), else ``default``."""
        if key in self.given:
            return self.given[key].value
        return DEFAULTS.get(key, default)

    def int(self, key: str, default: Any = None) -> int:
        """The value of ``key`` as a whole number; another value is refused (and 1 stands in)."""
        return self._number(key, default, as_int, 1)

    def float(self, key: str, default: Any = None) -> float:
        """The value of ``key`` as a number; another value is refused (and 0.0 stands in)."""
        return self._number(key, default, as_float, 0.0)

    def _number(self, key: str, default: Any, convert: Callable[[Any], Any], stand_in: Any) -> Any:
        value = self.get(key, default)
        try:
            return convert(value)
        except Refused as refused:
            self.refuse(key, refused.message, refused.fix.format(key=key), value=value)
            return stand_in

    def set(self, key: str, value: Any, *sources: str, conversion: str = "") -> None:
        """Emit packrl ``key=value`` from verl ``sources``; one left at its verl default is only
        emitted when the preset holds another value."""
        given = [s for s in sources if s in self.given]
        self.handled.update(given)
        if not given and same(preset_value(key), value):
            return
        texts = tuple(self.given[s].text for s in given) + tuple(
            f"{s}={format_value(DEFAULTS[s])} (verl default)" for s in sources if s not in self.given and s in DEFAULTS)
        self.mappings[key] = Mapping(key, value, texts or ("(verl behaviour)",), conversion)

    def ignore(self, key: str, reason: str) -> None:
        """Name given verl ``key`` as ignored with ``reason``, unless something already used it."""
        if key in self.given and key not in self.handled:
            self.handled.add(key)
            self.ignored.append(IgnoredKey(key, self.given[key].value, reason))

    def refuse(self, key: str, message: str, fix: str, value: Any = MISSING) -> None:
        """Record a problem with verl ``key`` (its value unless ``value`` is given)."""
        self.handled.add(key)
        self.problems.append(ConfigProblem(key, self.get(key) if value is MISSING else value, message, fix))

    def ignore_unless(self, condition: bool, keys: Sequence[str], reason: str) -> bool:
        """Name every given key of ``keys`` as ignored with ``reason`` when ``condition`` is false;
        returns ``condition``."""
        if not condition:
            for key in keys:
                self.ignore(key, reason)
        return condition
