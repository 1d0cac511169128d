"""`KeyRule`: what packrl does with one verl key, and the three ways to write one (`table_rule`,
`relational_rule`, `ignored_rule`); `packrl.compat.verl.keys` is the table of them. The section
prefixes of verl's config (``actor_rollout_ref.actor`` ...) are named here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packrl.compat.verl.convert import Converter

AR = "actor_rollout_ref"
ACTOR, ROLLOUT, REF = f"{AR}.actor", f"{AR}.rollout", f"{AR}.ref"
ANY: tuple[Any, ...] = ()
"""`KeyRule.accept` for "every value is accepted"."""


@dataclass(frozen=True, slots=True)
class KeyRule:
    """What packrl does with one verl key.

    Attributes:
        packrl: every packrl key the verl key reaches, comma-separated ("" = none); ``key=value``
            names the value a relational function sets.
        reason: why packrl does not use it (keys without ``packrl``), or what differs.
        accept: the values accepted without effect; `ANY` = all; others are refused.
        fix: what to do instead when a value is refused, naming the dotted key.
        convert: executable rules: the verl value -> the first ``packrl`` key's value.
        by: relational rules: the function(s) of `packrl.compat.verl.relational` that set packrl
            keys from this verl key together with others, comma-separated.
    """

    packrl: str = ""
    reason: str = ""
    accept: tuple[Any, ...] = ANY
    fix: str = ""
    convert: Converter | None = None
    by: str = ""

    @property
    def mapped(self) -> bool:
        """Whether the key reaches a packrl key."""
        return bool(self.packrl)

    @property
    def targets(self) -> tuple[str, ...]:
        """The packrl keys ``packrl`` names, without their ``=value``."""
        return tuple(t.strip().split("=")[0] for t in self.packrl.split(",") if t.strip())

    @property
    def executable(self) -> bool:
        """Whether the table maps the key itself (to ``targets[0]``, by ``convert``)."""
        return self.convert is not None

    @property
    def functions(self) -> tuple[str, ...]:
        """The relational functions that set packrl keys from the key (empty for a purely executable rule)."""
        return tuple(f.strip() for f in self.by.split(",") if f.strip())


def table_rule(packrl: str, convert: Converter, note: str = "") -> KeyRule:
    """An executable rule: ``convert`` maps the value to packrl key ``packrl``."""
    return KeyRule(packrl=packrl, reason=note, convert=convert)


def relational_rule(packrl: str, by: str, note: str = "") -> KeyRule:
    """A relational rule: function(s) ``by`` set the ``packrl`` keys from several verl keys."""
    return KeyRule(packrl=packrl, reason=note, by=by)


def ignored_rule(reason: str, accept: tuple[Any, ...] = ANY, fix: str = "") -> KeyRule:
    """A key packrl does not use: ``accept`` values are named as ignored with ``reason``, any other is
    refused with ``reason`` and ``fix``."""
    return KeyRule(reason=reason, accept=accept, fix=fix)
