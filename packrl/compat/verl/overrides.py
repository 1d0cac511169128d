"""A verl script's overrides as parsed, and the `Translation` that `packrl.compat.verl.translate` returns.

`parse_override` reads one Hydra override as verl's launcher would (``key=value``, ``+key=value``
adds a key, ``++key=value`` adds or replaces one). A `Translation` holds the packrl overrides
(`Mapping`: key, value, the verl overrides it came from, the conversion) and the verl keys
packrl accepts without using (`IgnoredKey`), and writes them as a ``packrl train`` command and
a report. The module is data and pure functions; it imports no torch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True, slots=True)
class VerlOverride:
    """One Hydra override of a verl script, parsed.

    Attributes:
        key: the dotted key without ``+``/``++``, e.g. ``data.train_batch_size``.
        value: the value as Hydra types it (bool, int, float, None, list, str).
        text: the override as written, for messages.
    """

    key: str
    value: Any
    text: str


def parse_override(text: str) -> VerlOverride:
    """Read one Hydra override: ``key=value``, ``+key=value`` or ``++key=value``.

    Values are typed as Hydra types them (``True``/``true`` -> bool, ``null`` -> None, numbers,
    ``[a,b]`` -> list, quotes stripped):

    ==================================  ==============================================
    text                                (key, value)
    ==================================  ==============================================
    ``data.train_batch_size=1024``      (``data.train_batch_size``, 1024)
    ``+AR.rollout.engine_kwargs.x=True`` (``AR.rollout.engine_kwargs.x``, True)
    ``data.truncation='error'``         (``data.truncation``, ``"error"``)
    ==================================  ==============================================

    Raises:
        ValueError: ``text`` is not an override of this form (deletion ``~key`` included).
    """
    key, sep, raw = text.partition("=")
    bare = key.lstrip("+")
    if not sep or not bare or len(key) - len(bare) > 2 or key.startswith("~") or " " in bare:
        raise ValueError(f"{text!r} is not a Hydra override (key=value, +key=value or ++key=value)")
    return VerlOverride(key=bare, value=_hydra_value(raw), text=text)


def _hydra_value(raw: str) -> Any:
    """``raw`` typed as Hydra's override grammar does, close enough for config values."""
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text in ("null", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") and not value.isalpha() else value
        except ValueError:
            return value
    if isinstance(value, list):
        return [_hydra_value(str(v)) if isinstance(v, str) else v for v in value]
    return value if isinstance(value, (bool, int, float, list, dict)) or value is None else text


@dataclass(frozen=True, slots=True)
class Mapping:
    """One packrl override and where it came from.

    Attributes:
        key: the packrl key, e.g. ``train.max_tokens_per_microbatch``.
        value: its value.
        sources: the verl overrides it came from as written, or ``key=value (verl default)``.
        conversion: how the value was computed when the unit or meaning differs ("" = as is).
    """

    key: str
    value: Any
    sources: tuple[str, ...]
    conversion: str = ""

    @property
    def override(self) -> str:
        return f"{self.key}={format_value(self.value)}"


@dataclass(frozen=True, slots=True)
class IgnoredKey:
    """A verl key packrl accepts without using it, and why."""

    key: str
    value: Any
    reason: str


@dataclass(frozen=True, slots=True)
class Translation:
    """The packrl run a verl script describes.

    Attributes:
        preset: the packrl preset the overrides apply to.
        mappings: the packrl overrides in order, each with its sources and conversion.
        ignored: the verl keys given that packrl does not use, with the reason.
    """

    preset: str
    mappings: tuple[Mapping, ...]
    ignored: tuple[IgnoredKey, ...]

    @property
    def overrides(self) -> list[str]:
        """The packrl dotlist overrides, ``key=value`` each."""
        return [m.override for m in self.mappings]

    def command(self) -> str:
        """The equivalent ``packrl train`` command line, shell-quoted."""
        return " ".join(["packrl", "train", self.preset, *(shlex.quote(o) for o in self.overrides)])

    def report(self) -> str:
        """Every mapping with its sources and conversion, then every ignored key with its reason."""
        lines = ["verl -> packrl:"]
        for m in self.mappings:
            how = f"  [{m.conversion}]" if m.conversion else ""
            lines.append(f"  {m.override}  <-  {', '.join(m.sources)}{how}")
        if self.ignored:
            lines.append("ignored (verl keys packrl does not use):")
            lines += [f"  {i.key}={format_value(i.value)}: {i.reason}" for i in self.ignored]
        return "\n".join(lines)


def format_value(value: Any) -> str:
    """``value`` written as a dotlist value packrl's loader reads back to the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)
