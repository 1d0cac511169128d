"""A length curriculum: the response budget as a function of the training step.

``rollout.max_response_tokens_schedule`` lists stages ``[first_step, max_response_tokens]``;
a stage holds from its first step until the step before the next stage's. The budget of a step
depends on the step number alone, so a run resumed at step k samples with step k's budget, as
the uninterrupted run did. ``rollout.max_response_tokens`` is the largest stage: every setting
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
from typing import TYPE_CHECKING, Any

from packrl.errors import ConfigProblem

if TYPE_CHECKING:
    from packrl.config.schema import RolloutConfig

KEY = "rollout.max_response_tokens_schedule"
METRIC = "rollout/max_response_tokens"


@dataclass(frozen=True, slots=True)
class ResponseBudgetSchedule:
    """The response budget of every step.

    Attributes:
        stages: ``((first_step, max_response_tokens), ...)``: first steps strictly increasing from
            1, budgets in tokens. One stage = a constant budget (no curriculum).

    Raises:
        ValueError: ``stages`` break those rules (`schedule_problems` explains which).
    """

    stages: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        problems = schedule_problems([list(s) for s in self.stages], max(b for _, b in self.stages) if self.stages else 1)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> ResponseBudgetSchedule:
        """The schedule of ``rollout.max_response_tokens_schedule``, or one stage of
        ``rollout.max_response_tokens`` when it is null.

        Raises:
            ValueError: the schedule is malformed (a loaded config has been checked already).
        """
        raw = rollout.max_response_tokens_schedule
        return cls(tuple((int(s), int(b)) for s, b in raw) if raw else ((1, rollout.max_response_tokens),))

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


def schedule_problems(raw: Any, max_response_tokens: int, key: str = KEY) -> list[ConfigProblem]:
    """Every way ``raw`` (the value of ``rollout.max_response_tokens_schedule``) is not a schedule.

    Rules: a non-empty list of ``[first_step, max_response_tokens]`` pairs of integers; the
    first stage starts at step 1; first steps strictly increase; budgets are >= 1; the largest
    budget equals ``rollout.max_response_tokens`` (the one budget every run-wide setting is sized
    for). None (off) has no problems.
    """
    if raw is None:
        return []
    fix = f"write {key}=[[1,256],[101,512]] (stage first step, response tokens), or null for no curriculum"
    if not isinstance(raw, (list, tuple)) or not raw:
        return [ConfigProblem(key, raw, "must be a non-empty list of [first_step, max_response_tokens] pairs", fix)]
    out = []
    for i, stage in enumerate(raw):
        if not (isinstance(stage, (list, tuple)) and len(stage) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in stage)):
            out.append(ConfigProblem(key, raw, f"stage {i + 1} is {stage!r}, not a [first_step, max_response_tokens] pair of integers", fix))
    if out:
        return out
    starts, budgets = [s for s, _ in raw], [b for _, b in raw]
    if starts[0] != 1:
        out.append(ConfigProblem(key, raw, f"stage 1 starts at step {starts[0]}; the first stage must start at step 1",
                                 f"set {key}[0][0]=1"))
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            out.append(ConfigProblem(key, raw, f"stage {i + 1} starts at step {starts[i]}, not after stage {i}'s step {starts[i - 1]}; "
                                     "first steps must strictly increase", f"order the stages of {key} by first step, each once"))
    for i, budget in enumerate(budgets):
        if budget < 1:
            out.append(ConfigProblem(key, raw, f"stage {i + 1} has max_response_tokens={budget}, must be >= 1",
                                     f"set {key}[{i}][1] to a positive number of tokens"))
    if budgets and max(budgets) != max_response_tokens and max(budgets) >= 1:
        out.append(ConfigProblem(
            key, raw, f"its largest stage budget {max(budgets):,} differs from rollout.max_response_tokens={max_response_tokens:,}, "
            "which must be the largest stage (the run's engine, memory and micro-batch budgets are sized for it)",
            f"set rollout.max_response_tokens={max(budgets)} (or make the largest stage {max_response_tokens})",
            keys=(key, "rollout.max_response_tokens")))
    return out


def overlong_buffer_problems(raw: Any, max_response_tokens: int, overlong_buffer_tokens: int) -> list[ConfigProblem]:
    """A problem for each stage shorter than ``reward.overlong_buffer_tokens``.

    The DAPO overlong ramp covers the last ``overlong_buffer_tokens`` of the current stage's
    budget (`packrl.reward.overlong`), so it must fit inside every stage. None when ``raw`` is
    None or malformed (`schedule_problems` reports that).
    """
    if raw is None or overlong_buffer_tokens < 1 or schedule_problems(raw, max_response_tokens):
        return []
    schedule = ResponseBudgetSchedule(tuple((start, budget) for start, budget in raw))
    return [ConfigProblem(
        "reward.overlong_buffer_tokens", overlong_buffer_tokens,
        f"> the budget of {schedule.label(i)} of {KEY}; the overlong ramp covers the last "
        "reward.overlong_buffer_tokens of each stage's budget, so it must fit the smallest",
        f"set reward.overlong_buffer_tokens <= {schedule.min_response_tokens:,} or raise that stage's budget ({KEY}[{i}][1])",
        keys=("reward.overlong_buffer_tokens", KEY),
    ) for i, (_, budget) in enumerate(raw) if overlong_buffer_tokens > budget]
