"""``shortest_correct``: ShorterBetter's sample optimal length (Yi, Wang, Li 2025, arXiv 2504.21370).

The group's target is its shortest correct response's length (the "sample optimal length"), or
the group's mean length when none is correct; every response pays ``beta`` per token of distance
to it: ``value = -beta * |len - target|``. The task score is the paper's correctness term
(its alpha); ``beta=0.001`` is its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.reward.length.common import correct_of, correctness_problems, finite_positive, grouped, policy_lengths

if TYPE_CHECKING:
    from packrl.config.shaping_checks import ShapingCheckInputs
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

PART = "shortest_correct"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShortestCorrectOptions:
    beta: float = 0.001
    """Reward lost per token of distance to the group's target (finite, > 0)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return finite_positive(prefix, "beta", self.beta, f"set {prefix}.beta=0.001")


@REWARD_SHAPING.register(PART, options=ShortestCorrectOptions)
def shortest_correct(inputs: ShapingInputs) -> ShapingOutput:
    """``-beta * |len - target|`` for every response; the group target reported as ``target``.
    Shape [N], float32, <= 0."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    size = inputs.rollout.group_size
    correct = grouped(correct_of(inputs, PART), size)
    lengths = grouped(policy_lengths(inputs), size)
    shortest = torch.where(correct, lengths, torch.full_like(lengths, float("inf"))).amin(dim=1, keepdim=True)
    target = torch.where(correct.any(dim=1, keepdim=True), shortest, lengths.mean(dim=1, keepdim=True)).expand_as(lengths)
    value = -inputs.options.beta * (lengths - target).abs()
    return ShapingOutput(value.reshape(-1), {"target": target.reshape(-1)})


def config_problems(inputs: ShapingCheckInputs) -> list[ConfigProblem]:
    return correctness_problems(inputs.reward, PART)
