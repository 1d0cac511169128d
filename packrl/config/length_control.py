"""Config sections of length control (docs/algorithms/length_control.md): the target length a
prompt asks for (``data.length_target``) and the checks of the thinking budgets
(``rollout.think_budget_tokens``, ``answer_budget_tokens``, ``end_of_thinking``). The length
objectives themselves are reward-shaping parts with options of their own (`packrl.reward.length`).
No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packrl.errors import ConfigProblem

LENGTH_PARTS = ("group_length", "efficiency", "shortest_correct", "target_length")
"""The length objectives among the reward-shaping parts (`packrl.reward.length`, one module each)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthTargetConfig:
    """Each prompt asks for a response length N (L1, arXiv 2503.04697): N comes from a data column
    or is drawn per row from ``[min_tokens, max_tokens]`` (seeded by ``train.seed`` and the row), and
    `template` with ``{target}`` = N is appended to the prompt's last user message, so it goes
    through the chat template and the prompt budget like any prompt text. The ``target_length``
    objective reads N (`packrl.types.PromptBatch.length_targets`). Off when neither is set."""

    column: str | None = None
    """A row field holding each row's target in tokens (a positive integer)."""

    min_tokens: int | None = None
    """Smallest target drawn per row (with `max_tokens`; L1 draws from 100-4,000)."""

    max_tokens: int | None = None
    """Largest target drawn per row; at most `rollout.max_response_tokens`."""

    template: str = " Think for {target} tokens."
    """Appended to the last user message, ``{target}`` replaced by N (L1-Exact's wording; L1-Max's
    is " Think for maximum {target} tokens.")."""

    mode_column: str | None = None
    """A row field holding each row's mode, ``exact`` or ``max``: a ``max`` row is asked with
    `max_template` and scored by the ``target_length`` objective's ``max`` formula, an ``exact``
    row with `template` and the ``exact`` one, whatever ``reward.shaping.target_length.mode`` says.
    L1-Max trains on both kinds (its data asks about half the rows for a maximum). Null = every
    row asks with `template` and is scored by that option."""

    max_template: str = " Think for maximum {target} tokens."
    """With `mode_column`: appended instead of `template` to a ``max`` row (L1-Max's wording)."""

    @property
    def enabled(self) -> bool:
        return self.column is not None or self.min_tokens is not None or self.max_tokens is not None

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        ranged = self.min_tokens is not None or self.max_tokens is not None
        if self.column is not None and ranged:
            out.append(ConfigProblem(f"{prefix}.column", self.column, f"is set together with {prefix}.min_tokens/max_tokens",
                                     f"set one: {prefix}.column=null or {prefix}.min_tokens=null and {prefix}.max_tokens=null",
                                     keys=(f"{prefix}.column", f"{prefix}.min_tokens", f"{prefix}.max_tokens")))
        elif ranged and (self.min_tokens is None or self.max_tokens is None):
            given, missing = ("min_tokens", "max_tokens") if self.max_tokens is None else ("max_tokens", "min_tokens")
            out.append(ConfigProblem(f"{prefix}.{given}", getattr(self, given), f"is set but {prefix}.{missing} is not: both "
                                     "bound the drawn targets", f"set {prefix}.min_tokens and {prefix}.max_tokens (e.g. 16 and 96)",
                                     keys=(f"{prefix}.min_tokens", f"{prefix}.max_tokens")))
        elif ranged and self.min_tokens is not None and self.max_tokens is not None:
            if self.min_tokens < 1 or self.max_tokens < self.min_tokens:
                out.append(ConfigProblem(f"{prefix}.min_tokens", self.min_tokens, f"must be in [1, {prefix}.max_tokens={self.max_tokens}]",
                                         f"set 1 <= {prefix}.min_tokens <= {prefix}.max_tokens",
                                         keys=(f"{prefix}.min_tokens", f"{prefix}.max_tokens")))
        if self.enabled and "{target}" not in self.template:
            out.append(ConfigProblem(f"{prefix}.template", self.template, "does not hold {target}: the prompt would not say its length",
                                     f"set {prefix}.template=' Think for {{target}} tokens.'"))
        return out + self._mode_problems(prefix)

    def _mode_problems(self, prefix: str) -> list[ConfigProblem]:
        if self.mode_column is None:
            return []
        if not self.enabled:
            return [ConfigProblem(f"{prefix}.mode_column", self.mode_column, f"has no effect: {prefix} sets no target",
                                  f"set {prefix}.column or {prefix}.min_tokens and max_tokens, or {prefix}.mode_column=null",
                                  keys=(f"{prefix}.mode_column", f"{prefix}.column", f"{prefix}.min_tokens"))]
        if "{target}" not in self.max_template:
            return [ConfigProblem(f"{prefix}.max_template", self.max_template, "does not hold {target}: a max row's prompt would "
                                  "not say its length", f"set {prefix}.max_template=' Think for maximum {{target}} tokens.'")]
        return []


def thinking_problems(think: int | None, answer: int | None, end_of_thinking: str | None, prefix: str = "rollout") -> list[ConfigProblem]:
    """The thinking budgets' own checks (``rollout.think_budget_tokens``, ``answer_budget_tokens``,
    ``end_of_thinking``; Elastic Reasoning, arXiv 2505.05315, and s1's budget forcing, arXiv
    2501.19393, `packrl.rollout.thinking`): both budgets or neither, each >= 1, a non-blank
    end-of-thinking text. Their relation to the response budget is `packrl.config.budgets`'s."""
    out: list[ConfigProblem] = []
    if think is None:
        for key, value in (("answer_budget_tokens", answer), ("end_of_thinking", end_of_thinking)):
            if value is not None:
                out.append(ConfigProblem(f"{prefix}.{key}", value, f"has no effect: {prefix}.think_budget_tokens is null",
                                         f"set {prefix}.think_budget_tokens or remove {prefix}.{key}",
                                         keys=(f"{prefix}.{key}", f"{prefix}.think_budget_tokens")))
        return out
    if think < 1:
        out.append(ConfigProblem(f"{prefix}.think_budget_tokens", think, "must be >= 1", f"set {prefix}.think_budget_tokens=64"))
    if answer is None or answer < 1:
        out.append(ConfigProblem(f"{prefix}.answer_budget_tokens", answer, "must be >= 1 with a thinking budget (it leaves the "
                                 "answer no room)", f"set {prefix}.answer_budget_tokens (e.g. 32)",
                                 keys=(f"{prefix}.answer_budget_tokens", f"{prefix}.think_budget_tokens")))
    if end_of_thinking is not None and not end_of_thinking.strip():
        out.append(ConfigProblem(f"{prefix}.end_of_thinking", end_of_thinking, "is blank",
                                 f"set {prefix}.end_of_thinking='</think>' or null (the chat template's)"))
    return out


def thinking_wraps_engine(rollout: Any) -> bool:
    """Thinking budgets wrap the engine (`packrl.capabilities.THINKING_WRAPPER`): ``rollout.think_budget_tokens``
    is set. ``rollout``: the `packrl.config.schema.RolloutConfig` section."""
    return bool(rollout.thinking)
