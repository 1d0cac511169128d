"""DAPO soft overlong punishment (Yu et al., arXiv 2503.14476, Eq. 13): the ``overlong``
reward-shaping part (``reward.shaping.overlong.buffer_tokens``, ``penalty_factor``;
`packrl.reward.shaping`).

With ``L_max = max_response_tokens`` and ``L_cache = buffer_tokens``, a response of ``L``
tokens gets, scaled by ``penalty_factor``:

    0                                   L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
    -1                                  L > L_max

A linear ramp over the last ``L_cache`` tokens of the budget tells the policy "shorter" before
the hard cut, instead of a cliff. ``buffer_tokens = 0`` turns it off.

    L (max 100, buffer 20, factor 1.0)   80    90     100    120
    penalty                              0.0   -0.5   -1.0   -1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packrl.config.curriculum import overlong_buffer_problems
from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING

if TYPE_CHECKING:
    from packrl.config.schema import RewardConfig, RolloutConfig
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

KEY = "reward.shaping.overlong"


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlongOptions:
    """The ``overlong`` part's knobs (DAPO's ``overlong_buffer.len`` and ``penalty_factor``)."""

    buffer_tokens: int = 0
    """``L_cache``: the last this-many tokens before the response budget ramp the penalty from 0
    to -`penalty_factor` (DAPO: 4,096 of a 20,480-token budget); under a length curriculum, before
    the current stage's budget (it must fit the smallest stage). >= 1: the part is on when listed."""

    penalty_factor: float = 1.0
    """The largest penalty, reached at the budget (finite, >= 0)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = []
        if self.buffer_tokens < 1:
            out.append(ConfigProblem(f"{prefix}.buffer_tokens", self.buffer_tokens, "must be >= 1 (the part adds nothing with an "
                                     "empty ramp)", f"set {prefix}.buffer_tokens to the ramp's length in tokens, or {prefix}=null (off)"))
        if not 0 <= self.penalty_factor < math.inf:
            out.append(ConfigProblem(f"{prefix}.penalty_factor", self.penalty_factor, "must be a finite number >= 0 (it is subtracted)",
                                     f"set {prefix}.penalty_factor=1.0"))
        return out


@REWARD_SHAPING.register("overlong", options=OverlongOptions)
def overlong(inputs: ShapingInputs) -> ShapingOutput:
    """The `soft_overlong_penalty` of every response at its own response budget
    (`ShapingInputs.response_budgets`). Shape [N], float32, <= 0."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    opts: OverlongOptions = inputs.options
    return ShapingOutput(torch.tensor([soft_overlong_penalty(len(r.response_ids), budget, opts.buffer_tokens, opts.penalty_factor)
                                       for r, budget in zip(inputs.rollout.responses, inputs.response_budgets)], dtype=torch.float32))


def config_problems(reward: RewardConfig, rollout: RolloutConfig) -> list[ConfigProblem]:
    """The ramp fits the response budget and every stage of a length curriculum (registered as the
    part's config check, with the ``reward`` and ``rollout`` sections)."""
    args = reward.shaping_parts().get("overlong", {})
    buffer, budget = args.get("buffer_tokens", 0), rollout.max_response_tokens
    if not isinstance(buffer, int) or buffer < 1:
        return []  # the options' own check names it
    out = []
    if buffer > budget:
        out.append(ConfigProblem(f"{KEY}.buffer_tokens", buffer, f"> rollout.max_response_tokens={budget}",
                                 f"set {KEY}.buffer_tokens below the response budget",
                                 keys=(f"{KEY}.buffer_tokens", "rollout.max_response_tokens")))
    return out + overlong_buffer_problems(rollout.max_response_tokens_schedule, budget, buffer)


def soft_overlong_penalty(response_tokens: int, max_response_tokens: int, buffer_tokens: int, penalty_factor: float) -> float:
    """The overlong penalty of one response (<= 0), added to its reward.

    Args:
        response_tokens: tokens in the response (an EOS that ended it included).
        max_response_tokens: the budget the response was sampled with (``rollout.max_response_tokens``,
            or the current stage's under ``rollout.max_response_tokens_schedule``).
        buffer_tokens: ``reward.shaping.overlong.buffer_tokens``; 0 = off.
        penalty_factor: ``reward.shaping.overlong.penalty_factor``, the penalty at and beyond the budget.

    Returns:
        A float in ``[-penalty_factor, 0]``.

    Raises:
        ValueError: ``buffer_tokens`` outside ``[0, max_response_tokens]``.
    """
    if not 0 <= buffer_tokens <= max_response_tokens:
        raise ValueError(
            f"{KEY}.buffer_tokens={buffer_tokens} must be in [0, rollout.max_response_tokens={max_response_tokens}]; "
            f"set {KEY}.buffer_tokens below the response budget"
        )
    if buffer_tokens == 0:
        return 0.0
    start = max_response_tokens - buffer_tokens
    if response_tokens <= start:
        return 0.0
    if response_tokens > max_response_tokens:
        return -float(penalty_factor)
    return (start - response_tokens) / buffer_tokens * float(penalty_factor)
