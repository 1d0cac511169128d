"""``group_length``: Kimi k1.5's length reward (Kimi Team 2025, arXiv 2501.12599, section 2.3.3).

Within a group, with ``len_i`` the tokens response i generated:

    lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len)     (0 for all when max_len = min_len)
    value_i  = w * lambda_i            for a correct response
    value_i  = w * min(0, lambda_i)    for a wrong one

so the shortest correct response gains ``w/2``, the longest loses ``w/2``, and a wrong response is
only ever pushed shorter. The paper runs standard policy optimisation first and turns the penalty
on after that phase: the part is 0 for the first ``warmup_steps`` steps. Its weight is not
published; ``weight=1.0`` puts the term on the scale of a correct answer's score, so a long correct
answer (at worst ``1 - w/2``) still outscores every wrong one.
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

PART = "group_length"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLengthOptions:
    weight: float = 1.0
    """``w``: the length term's weight (finite, > 0)."""

    warmup_steps: int = 0
    """Steps without the term first (the paper's penalty-free phase; >= 0)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = finite_positive(prefix, "weight", self.weight, f"set {prefix}.weight=1.0")
        if self.warmup_steps < 0:
            out.append(ConfigProblem(f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0", f"set {prefix}.warmup_steps=0"))
        return out


@REWARD_SHAPING.register(PART, options=GroupLengthOptions)
def group_length(inputs: ShapingInputs) -> ShapingOutput:
    """The Kimi length reward of every response (module docstring); its term ``lambda`` reported.
    Shape [N], float32, in [-w/2, w/2]."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    opts: GroupLengthOptions = inputs.options
    lengths = grouped(policy_lengths(inputs), inputs.rollout.group_size)  # [B, G]
    low, high = lengths.amin(dim=1, keepdim=True), lengths.amax(dim=1, keepdim=True)
    span = (high - low).clamp(min=1)
    lam = torch.where(high > low, 0.5 - (lengths - low) / span, torch.zeros_like(lengths)).reshape(-1)
    if inputs.step <= opts.warmup_steps:
        return ShapingOutput(torch.zeros_like(lam), {"lambda": lam})
    value = torch.where(correct_of(inputs, PART), lam, lam.clamp(max=0.0)) * opts.weight
    return ShapingOutput(value, {"lambda": lam})


def config_problems(inputs: ShapingCheckInputs) -> list[ConfigProblem]:
    """A reward with a notion of correct; a warm-up shorter than the run."""
    out = correctness_problems(inputs.reward, PART)
    warmup = (inputs.reward.shaping.get(PART) or {}).get("warmup_steps", 0)
    if isinstance(warmup, int) and warmup >= inputs.train.total_steps:
        out.append(ConfigProblem(f"reward.shaping.{PART}.warmup_steps", warmup, f"leaves no step of train.total_steps="
                                 f"{inputs.train.total_steps} with the length term",
                                 f"lower reward.shaping.{PART}.warmup_steps or raise train.total_steps",
                                 keys=(f"reward.shaping.{PART}.warmup_steps", "train.total_steps")))
    return out
