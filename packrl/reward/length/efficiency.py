"""``efficiency``: Arora & Zanette's length-normalised reward ("Training Language Models to Reason
Efficiently", arXiv 2502.04463).

A correct response's reward becomes ``score * (1 - alpha * sigmoid(z))``, with ``z`` its length's
z-score among the group's correct responses (``(len - mean) / std``, population std; 0 when
fewer than two are correct or all have one length); wrong responses are unchanged. The part's
value is that change, ``-alpha * sigmoid(z) * score`` on correct responses, 0 on wrong ones, so
the shortest correct answers score highest, longer correct ones less, wrong ones least.
``alpha=0.1`` is the paper's script default. The accuracy gate shared by the length parts
(`packrl.reward.length.common.LengthGateOptions`) applies to the whole value.
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
    gate_config_problems,
    gated,
    grouped,
    policy_lengths,
)

if TYPE_CHECKING:
    from packrl.config.schema import RewardConfig, TrainConfig
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

PART = "efficiency"


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyOptions(LengthGateOptions):
    """``alpha``, and the gate (`LengthGateOptions`)."""

    alpha: float = 0.1
    """How much of a correct answer's score its length can cost (in (0, 1]: a correct answer
    keeps at least ``1 - alpha`` of its score)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if 0 < self.alpha <= 1:
            return self.gate_problems(prefix)
        return [ConfigProblem(f"{prefix}.alpha", self.alpha, "must be in (0, 1] (a correct answer keeps 1 - alpha of its score)",
                              f"set {prefix}.alpha=0.1"), *self.gate_problems(prefix)]


@REWARD_SHAPING.register(PART, options=EfficiencyOptions)
def efficiency(inputs: ShapingInputs) -> ShapingOutput:
    """``-alpha * sigmoid(z) * score`` on correct responses, 0 on wrong ones, gated; ``z``
    reported (and ``gated`` with a gate option set). Shape [N], float32."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    size = inputs.rollout.group_size
    correct = grouped(correct_of(inputs, PART), size)  # [B, G]
    lengths = grouped(policy_lengths(inputs), size)
    count = correct.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.where(correct, lengths, 0.0).sum(dim=1, keepdim=True) / count
    var = torch.where(correct, (lengths - mean) ** 2, 0.0).sum(dim=1, keepdim=True) / count
    std = var.sqrt()
    z = torch.where(correct & (std > 0), (lengths - mean) / std.clamp(min=1e-12), torch.zeros_like(lengths))
    value = torch.where(correct, -inputs.options.alpha * torch.sigmoid(z) * grouped(inputs.scores, size), torch.zeros_like(z))
    value, gate = gated(inputs, value.reshape(-1), PART)
    return ShapingOutput(value, {"z": z.reshape(-1), **gate})


def config_problems(reward: RewardConfig, train: TrainConfig) -> list[ConfigProblem]:
    """A reward with a notion of correct; the gate's checks."""
    return correctness_problems(reward, PART) + gate_config_problems(reward, train, PART)
