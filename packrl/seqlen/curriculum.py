"""A length curriculum: the response budget as a function of the training step.

The config's ``rollout.max_response_tokens_schedule`` lists stages ``[first_step,
max_response_tokens]`` (read and checked in `packrl.config.budgets`); a stage holds from its
first step until the step before the next stage's. The budget of a step depends on the step
number alone, so a run resumed at step k samples with step k's budget, as the uninterrupted run
did. ``rollout.max_response_tokens`` is the largest stage: every setting
sized once for the whole run (the model-context and micro-batch relations, vLLM's
``max_model_len``, the memory estimate, ``algorithm.loss_scale_factor``'s default, the length
buckets) is sized for it and therefore holds for every stage.

    schedule [[1, 256], [101, 512]]    step 1  100  101  5000
    budget (tokens)                         256  256  512  512

Short early budgets make early steps cheap (generation time grows with the longest response)
while the policy learns the format; the trade-off is that an answer needing more than the
current stage's budget is cut (finish reason ``length``) until its stage arrives.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

METRIC = "rollout/max_response_tokens"


def stage_errors(stages: tuple[tuple[int, int], ...]) -> list[str]:
    """Every rule ``stages`` breaks, in words (empty when it is a schedule): at least one stage,
    the first starting at step 1, first steps strictly increasing, budgets >= 1.

    | stages               | errors                                   |
    |----------------------|------------------------------------------|
    | ((1, 6), (3, 12))    | (none)                                   |
    | ((2, 6),)            | stage 1 starts at step 2; the first      |
    |                      | stage must start at step 1               |
    """
    if not stages:
        return ["a schedule needs at least one stage"]
    out = []
    if stages[0][0] != 1:
        out.append(f"stage 1 starts at step {stages[0][0]}; the first stage must start at step 1")
    for i in range(1, len(stages)):
        if stages[i][0] <= stages[i - 1][0]:
            out.append(f"stage {i + 1} starts at step {stages[i][0]}, not after stage {i}'s step {stages[i - 1][0]}")
    out += [f"stage {i + 1} has a budget of {budget} tokens, not >= 1" for i, (_, budget) in enumerate(stages) if budget < 1]
    return out


@dataclass(frozen=True, slots=True)
class ResponseBudgetSchedule:
    """The response budget of every step.

    Attributes:
        stages: ``((first_step, max_response_tokens), ...)``: first steps strictly increasing from
            1, budgets in tokens. One stage = a constant budget (no curriculum).

    Raises:
        ValueError: ``stages`` break those rules (`stage_errors` says which).
    """

    stages: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        errors = stage_errors(self.stages)
        if errors:
            raise ValueError(f"not a response budget schedule: {'; '.join(errors)}")

    @classmethod
    def constant(cls, max_response_tokens: int) -> ResponseBudgetSchedule:
        """One stage: ``max_response_tokens`` from step 1 on (no curriculum)."""
        return cls(((1, max_response_tokens),))

    @property
    def max_response_tokens(self) -> int:
        """The largest stage's budget, tokens (``rollout.max_response_tokens`` of a valid config)."""
        return max(budget for _, budget in self.stages)

    @property
    def min_response_tokens(self) -> int:
        """The smallest stage's budget, tokens."""
        return min(budget for _, budget in self.stages)

    def stage_index(self, step: int) -> int:
        """0-based index of the stage that holds ``step`` (1-based).

        Raises:
            ValueError: ``step`` < 1.
        """
        if step < 1:
            raise ValueError(f"step {step} is not a training step; steps count from 1")
        return bisect.bisect_right([start for start, _ in self.stages], step) - 1

    def at(self, step: int) -> int:
        """The response budget of ``step`` (1-based), in tokens.

        | stages                 | step 1 | step 2 | step 3 | step 9 |
        |------------------------|--------|--------|--------|--------|
        | ((1, 6), (3, 12))      | 6      | 6      | 12     | 12     |
        | ((1, 512),)            | 512    | 512    | 512    | 512    |

        Raises:
            ValueError: ``step`` < 1.
        """
        return self.stages[self.stage_index(step)][1]

    def metrics(self, step: int) -> dict[str, float]:
        """``{"rollout/max_response_tokens": budget}`` for ``step`` (docs/metrics.md)."""
        return {METRIC: float(self.at(step))}

    def steps(self, index: int) -> str:
        """The steps stage ``index`` (0-based) holds: ``steps 1-2``, or ``steps 3+`` for the last."""
        start = self.stages[index][0]
        return f"steps {start}-{self.stages[index + 1][0] - 1}" if index + 1 < len(self.stages) else f"steps {start}+"

    def label(self, index: int) -> str:
        """``stage 2 (steps 3+, 512 tokens)``: stage ``index`` (0-based), for messages."""
        return f"stage {index + 1} ({self.steps(index)}, {self.stages[index][1]:,} tokens)"

    def describe(self) -> str:
        """One line for the budget table: ``steps 1-2: 6; steps 3+: 12`` (tokens)."""
        return "; ".join(f"{self.steps(i)}: {budget:,}" for i, (_, budget) in enumerate(self.stages))
