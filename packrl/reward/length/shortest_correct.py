"""``shortest_correct``: ShorterBetter's sample optimal length (Yi, Wang, Li 2025, arXiv 2504.21370).

The group's target is its shortest correct response's length (the "sample optimal length", SOL),
or the group's mean length when none is correct. The paper's reward is

    reward = alpha * 1[correct] - beta * |len - SOL|

with ``alpha=2.0`` and ``beta=0.001`` in the authors' code (``alpha``, ``beta`` in
verl/workers/reward_manager/naive.py of JingyangYi/ShorterBetter). The task score already gives a
correct response its score, so the part adds ``(alpha - 1) * score`` to each correct response and
``-beta * |len - SOL|`` to every response: with a 0/1 task score the reward is the paper's.

Only ``beta / alpha`` matters under GRPO's std-normalised advantages: ``alpha=1`` (the task score
alone) at ``beta=0.001`` gives the advantages of the paper's ``alpha=2`` at ``beta=0.002``, twice
the paper's length pressure. Lengths 40, 25, 60, 15 with correct T, T, F, F at the defaults give
the paper's rewards 1.985, 2.0, -0.035, -0.010 (SOL = 25). The accuracy gate shared by the length
parts (`packrl.reward.length.common.LengthGateOptions`) applies to the length term alone, not to
the correctness bonus.
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

PART = "shortest_correct"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShortestCorrectOptions(LengthGateOptions):
    """``alpha``, ``beta``, and the gate (`LengthGateOptions`)."""

    alpha: float = 2.0
    """The paper's correctness weight: a correct response's reward is ``alpha`` times its task
    score (finite, > 0; 2.0 is the authors' code, 1.0 leaves the task score as it is)."""

    beta: float = 0.001
    """Reward lost per token of distance to the group's target (finite, > 0; the paper's)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return (finite_positive(prefix, "alpha", self.alpha, f"set {prefix}.alpha=2.0 (the paper's)")
                + finite_positive(prefix, "beta", self.beta, f"set {prefix}.beta=0.001") + self.gate_problems(prefix))


@REWARD_SHAPING.register(PART, options=ShortestCorrectOptions)
def shortest_correct(inputs: ShapingInputs) -> ShapingOutput:
    """``(alpha - 1) * score`` on correct responses plus the gated ``-beta * |len - target|`` on
    every response; reported: the group target as ``target``, the gated length term as
    ``length`` (and ``gated`` with a gate option set). Shape [N], float32."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    opts: ShortestCorrectOptions = inputs.options
    size = inputs.rollout.group_size
    correct = correct_of(inputs, PART)
    grouped_correct, lengths = grouped(correct, size), grouped(policy_lengths(inputs), size)  # [B, G]
    shortest = torch.where(grouped_correct, lengths, torch.full_like(lengths, float("inf"))).amin(dim=1, keepdim=True)
    target = torch.where(grouped_correct.any(dim=1, keepdim=True), shortest, lengths.mean(dim=1, keepdim=True)).expand_as(lengths)
    length, gate = gated(inputs, (-opts.beta * (lengths - target).abs()).reshape(-1), PART)
    bonus = torch.where(correct, (opts.alpha - 1.0) * inputs.scores.float(), torch.zeros_like(length))
    return ShapingOutput(bonus + length, {"target": target.reshape(-1), "length": length, **gate})


def config_problems(reward: RewardConfig, train: TrainConfig) -> list[ConfigProblem]:
    """A reward with a notion of correct; the gate's checks."""
    return correctness_problems(reward, PART) + gate_config_problems(reward, train, PART)
