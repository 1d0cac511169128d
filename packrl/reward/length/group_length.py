"""``group_length``: Kimi k1.5's length reward (Kimi Team 2025, arXiv 2501.12599, section 2.3.3).

Within a group, with ``len_i`` the tokens response i generated:

    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)     (0 for all when max_len = min_len)
    value_i  = w * lambda_i            for a correct response
    value_i  = w * min(0, lambda_i)    for a wrong one

so the shortest correct response gains ``w/2``, the longest loses ``w/2``, and a wrong response is
only ever pushed shorter. The paper notes that the penalty "may slow down training in the initial
phases" and runs standard policy optimisation first, turning the penalty on after that phase: the
part is 0 for the first ``warmup_steps`` steps. (The early accuracy collapse under length
penalties is GRPO-lambda's finding, arXiv 2505.18086, not Kimi's.) The accuracy gate shared by the
length parts (`packrl.reward.length.common.LengthGateOptions`: ``warmup_steps``,
``min_group_accuracy``, ``scale_by_pass_rate``) applies to the whole value. The weight is not
published; ``weight=1.0`` puts the term on the scale of a correct answer's score, so a long
correct answer (at worst ``1 - w/2``) still outscores every wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.reward.length.common import (
    LengthGateOptions,
    correct_of,
    correctness_problems,
    finite_positive,
    gate_config_problems,
    gated,
    grouped,
    policy_lengths,
)

if TYPE_CHECKING:
    from packrl.config.schema import RewardConfig, TrainConfig
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

PART = "group_length"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLengthOptions(LengthGateOptions):
    """``weight``, and the gate's ``warmup_steps`` (the paper's penalty-free phase),
    ``min_group_accuracy`` and ``scale_by_pass_rate`` (`LengthGateOptions`)."""

    weight: float = 1.0
    """``w``: the length term's weight (finite, > 0)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return finite_positive(prefix, "weight", self.weight, f"set {prefix}.weight=1.0") + self.gate_problems(prefix)


@REWARD_SHAPING.register(PART, options=GroupLengthOptions)
def group_length(inputs: ShapingInputs) -> ShapingOutput:
    """The Kimi length reward of every response (module docstring), gated; its term ``lambda``
    reported (and ``gated`` with a gate option set). Shape [N], float32, in [-w/2, w/2]."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    opts: GroupLengthOptions = inputs.options
    lengths = grouped(policy_lengths(inputs), inputs.rollout.group_size)  # [B, G]
    low, high = lengths.amin(dim=1, keepdim=True), lengths.amax(dim=1, keepdim=True)
    span = (high - low).clamp(min=1)
    lam = torch.where(high > low, 0.5 - (lengths - low) / span, torch.zeros_like(lengths)).reshape(-1)
    value = torch.where(correct_of(inputs, PART), lam, lam.clamp(max=0.0)) * opts.weight
    value, gate = gated(inputs, value, PART)
    return ShapingOutput(value, {"lambda": lam, **gate})


def config_problems(reward: RewardConfig, train: TrainConfig) -> list[ConfigProblem]:
    """A reward with a notion of correct; the gate's checks (a warm-up shorter than the run)."""
    return correctness_problems(reward, PART) + gate_config_problems(reward, train, PART)
