"""The length curriculum's key, ``rollout.max_response_tokens_schedule``: what makes its value a
schedule (`schedule_problems`) and the reward setting every stage must hold
(`overlong_buffer_problems`, the ``overlong`` shaping part's). The schedule itself is `packrl.seqlen.curriculum`."""

from __future__ import annotations

from typing import Any

from packrl.errors import ConfigProblem
from packrl.seqlen.curriculum import ResponseBudgetSchedule

SCHEDULE_KEY = "rollout.max_response_tokens_schedule"


def schedule_problems(raw: Any, max_response_tokens: int, key: str = SCHEDULE_KEY) -> list[ConfigProblem]:
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
        if not (isinstance(stage, (list, tuple)) and len(stage) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in stage)):
            out.append(ConfigProblem(key, raw, f"stage {i + 1} is {stage!r}, not a [first_step, max_response_tokens] pair of integers",
                                     fix))
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
    """A problem for each stage shorter than ``reward.shaping.overlong.buffer_tokens``.

    The DAPO overlong ramp covers the last ``overlong_buffer_tokens`` of the current stage's
    budget (`packrl.reward.overlong`), so it must fit inside every stage. None when ``raw`` is
    None or malformed (`schedule_problems` reports that).
    """
    if raw is None or overlong_buffer_tokens < 1 or schedule_problems(raw, max_response_tokens):
        return []
    schedule = ResponseBudgetSchedule(tuple((start, budget) for start, budget in raw))
    return [ConfigProblem(
        "reward.shaping.overlong.buffer_tokens", overlong_buffer_tokens,
        f"> the budget of {schedule.label(i)} of {SCHEDULE_KEY}; the overlong ramp covers the last "
        "buffer_tokens of each stage's budget, so it must fit the smallest",
        f"set reward.shaping.overlong.buffer_tokens <= {schedule.min_response_tokens:,} or raise that stage's budget "
        f"({SCHEDULE_KEY}[{i}][1])",
        keys=("reward.shaping.overlong.buffer_tokens", SCHEDULE_KEY),
    ) for i, (_, budget) in enumerate(raw) if overlong_buffer_tokens > budget]
