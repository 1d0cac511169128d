"""``target_length``: L1 / LCPO (Aggarwal & Welleck 2025, "L1: Controlling How Long a Reasoning
Model Thinks With Reinforcement Learning", arXiv 2503.04697).

Each prompt asks for a length ``N`` (``data.length_target``: a data column, or drawn per row from a
range, written into the prompt by an instruction template; `packrl.types.PromptBatch.length_targets`):

- ``exact`` (L1-Exact): ``value = -alpha * |N - len|`` on every response;
- ``max`` (L1-Max, the paper's formula): a correct response's reward becomes ``score *
  clip(alpha * (N - len) + delta, 0, 1)``, so the value is ``score * (clip(...) - 1)`` on correct
  responses (0 on wrong ones). A correct answer exactly at its target keeps ``delta`` of its score
  (0.5), one ``(1 - delta) / alpha`` tokens under it keeps all of it (1,667 tokens at the
  defaults), one ``delta / alpha`` tokens over it keeps nothing and scores as a wrong one. L1's
  released code rewards ``(clip(alpha * (N - len), -1, 1) + 1) / 2 + correct`` instead
  (cmu-l3/l1 ``math_reward.py``): the paper's form is the one here.

The ``mode`` option applies to every row, unless ``data.length_target.mode_column`` gives each row
its own (`packrl.types.PromptBatch.length_modes`): L1-Max trains on a mix of exact and max rows.

``alpha=0.0003`` is the paper's (for targets of 100-4,000 tokens); small models with targets of
tens of tokens need a larger one (the `char_count` preset's arm uses more). ``|len - N| / N``
is reported as ``target_error`` and as the metric ``length/target_error/*``. The accuracy gate
shared by the length parts (`packrl.reward.length.common.LengthGateOptions`) applies to the whole
value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.reward.length.common import (
    LengthGateOptions,
    correct_of,
    correctness_problems,
    finite_positive,
    gate_config_problems,
    gated,
    policy_lengths,
)

if TYPE_CHECKING:
    import torch

    from packrl.config.schema import DataConfig, RewardConfig, TrainConfig
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

PART = "target_length"


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetLengthOptions(LengthGateOptions):
    """``mode``, ``alpha``, ``delta``, and the gate (`LengthGateOptions`)."""

    mode: Literal["exact", "max"] = "exact"
    """``exact``: hit the target; ``max``: stay within it (module docstring). Every row's, unless
    ``data.length_target.mode_column`` gives each row its own."""

    alpha: float = 0.0003
    """Reward per token of distance (``exact``) or the slope of the clip (``max``), finite > 0."""

    delta: float = 0.5
    """``max`` only: the share of its score a correct answer exactly at its target keeps (in
    [0, 1]); it keeps all of it ``(1 - delta) / alpha`` tokens under the target and none
    ``delta / alpha`` tokens over it."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = finite_positive(prefix, "alpha", self.alpha, f"set {prefix}.alpha=0.0003")
        if not 0 <= self.delta <= 1:
            out.append(ConfigProblem(f"{prefix}.delta", self.delta, "must be in [0, 1]", f"set {prefix}.delta=0.5"))
        return out + self.gate_problems(prefix)


def targets_of(inputs: ShapingInputs) -> torch.Tensor:
    """Each response's prompt's target, Shape [N], float32.

    Raises:
        ValueError: the prompts carry no targets (``data.length_target`` is off).
    """
    import torch

    targets = inputs.rollout.prompts.length_targets
    if targets is None:
        raise ValueError("reward.shaping.target_length needs each prompt's target length, and the prompts carry none; "
                         "set data.length_target (a column or a range)")
    size = inputs.rollout.group_size
    return torch.tensor([float(targets[i // size]) for i in range(len(inputs.rollout.responses))])


def max_rows(inputs: ShapingInputs) -> torch.Tensor:
    """True where a response is scored by the ``max`` formula: its prompt's mode
    (`packrl.types.PromptBatch.length_modes`), else the ``mode`` option. Shape [N], bool."""
    import torch

    modes, size = inputs.rollout.prompts.length_modes, inputs.rollout.group_size
    num = len(inputs.rollout.responses)
    if modes is None:
        return torch.full((num,), inputs.options.mode == "max")
    return torch.tensor([modes[i // size] == "max" for i in range(num)])


@REWARD_SHAPING.register(PART, options=TargetLengthOptions)
def target_length(inputs: ShapingInputs) -> ShapingOutput:
    """The L1 term of every response, gated; ``target_error`` = ``|len - N| / N`` reported (and
    ``gated`` with a gate option set). Shape [N], float32."""
    import torch

    from packrl.reward.shaping import ShapingOutput

    opts: TargetLengthOptions = inputs.options
    lengths, targets, is_max = policy_lengths(inputs), targets_of(inputs), max_rows(inputs)
    error = (lengths - targets).abs() / targets
    value = -opts.alpha * (lengths - targets).abs()  # exact
    if is_max.any():
        kept = (opts.alpha * (targets - lengths) + opts.delta).clamp(0.0, 1.0)
        capped = torch.where(correct_of(inputs, PART), inputs.scores * (kept - 1.0), torch.zeros_like(kept))
        value = torch.where(is_max, capped, value)
    value, gate = gated(inputs, value, PART)
    return ShapingOutput(value, {"target_error": error, **gate})


def config_problems(reward: RewardConfig, data: DataConfig, train: TrainConfig) -> list[ConfigProblem]:
    """Prompts that carry targets; ``max`` mode (or per-row modes) reads correctness; the gate's
    checks (the ``reward``, ``data`` and ``train`` sections)."""
    out = []
    if not data.length_target.enabled:
        out.append(ConfigProblem(f"reward.shaping.{PART}", reward.shaping.get(PART), "needs each prompt to ask for a length, "
                                 "and data.length_target sets none", "set data.length_target.min_tokens and max_tokens (or "
                                 "data.length_target.column) and its template", keys=(f"reward.shaping.{PART}", "data.length_target")))
    if (reward.shaping.get(PART) or {}).get("mode", "exact") == "max" or data.length_target.mode_column is not None:
        out += correctness_problems(reward, PART)
    return out + gate_config_problems(reward, train, PART)
