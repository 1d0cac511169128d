"""Config problems and the one error that lists them all (the bottom layer: every package may import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One thing wrong in a config.

    Attributes:
        key: dotted config key the problem is about, e.g. ``data.max_prompt_tokens``.
        value: the value seen.
        message: what is wrong, with the limit where there is one.
        fix: what to change, naming the dotted key(s).
        keys: every key the problem depends on (``key`` first); a relation between two keys
            lists both, so it is dropped when one of them did not parse.
        machine: the problem is this machine's, not the config's (a package the config needs is
            not installed here); a command that only translates or prints a config (``packrl
            verl --dry-run``) warns instead of failing.
    """

    key: str
    value: Any
    message: str
    fix: str
    keys: tuple[str, ...] = ()
    machine: bool = False

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.message}; fix: {self.fix}"

    @property
    def involved_keys(self) -> tuple[str, ...]:
        return self.keys or (self.key,)


class ConfigError(ValueError):
    """Every problem found in a config, raised once. ``problems`` keeps them for callers."""

    def __init__(self, problems: list[ConfigProblem]):
        assert problems, "ConfigError needs at least one problem"
        self.problems = list(problems)
        lines = [f"{len(self.problems)} config problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class KeyedValueError(ValueError):
    """A user mistake about one config key found outside the loader (in a model's files, say): a
    ValueError that carries the key it is about and the fix, so a caller that collects problems
    (preflight) turns it into a `ConfigProblem` by type, never by reading the message.

    Attributes:
        key: the dotted config key, e.g. ``model.lora.target_modules``.
        fix: what to change, naming the key.
    """

    def __init__(self, key: str, message: str, fix: str):
        self.key, self.fix = key, fix
        super().__init__(f"{message}; fix: {fix}")
        self.message = message

    def problem(self, value: Any) -> ConfigProblem:
        """This error as a `ConfigProblem` with the key's current ``value``."""
        return ConfigProblem(self.key, value, self.message, self.fix)


def check_positive(key: str, value: int | float) -> list[ConfigProblem]:
    """A problem when ``value`` < 1 (budgets, counts and sizes are positive)."""
    if value >= 1:
        return []
    return [ConfigProblem(key, value, "must be >= 1", f"set {key} to a positive number")]
