"""What the length objectives share: response lengths, group views, the correctness check and the
accuracy gate (`LengthGateOptions`, `gated`).

Shapes: ``N`` responses · ``B`` groups of ``G`` (contiguous).

The gate holds length pressure back until the policy answers correctly, per group and per step.
Under length penalties, accuracy can collapse abruptly as the responses shorten, often early in
training (GRPO-lambda, Dai, Liu, Si 2025, arXiv 2505.18086, which switches the length reward on
per group by its correctness ratio, and to the plain 0/1 reward below it); prime-rl's length
penalty scales by the group's pass rate, the mean of its 0/1 rewards (its
``default_advantage_fn``: ``coef * mean reward * length / seq_len``). Each of the four parts
multiplies its length term by

    factor = 0                   while step <= warmup_steps (warmup_steps > 0)
    factor = 0                   in a group whose accuracy (correct / G) < min_group_accuracy
    factor = accuracy            with scale_by_pass_rate (the group's pass rate)
    factor = 1                   otherwise

(the three compose: a group past the warm-up and over the threshold gets its pass rate when
scaled). GRPO-lambda chooses the groups by rank (the top lambda fraction of a batch by correctness
ratio); a fixed threshold is the simpler, batch-independent form of the same switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packrl.errors import ConfigProblem

if TYPE_CHECKING:
    import torch

    from packrl.config.schema import RewardConfig, TrainConfig
    from packrl.reward.shaping import ShapingInputs


def policy_lengths(inputs: ShapingInputs) -> torch.Tensor:
    """Tokens the policy generated in each response (`packrl.types.Response.generated_mask`).
    Shape [N], float32."""
    import torch

    return torch.tensor([float(r.generated_mask().sum()) for r in inputs.rollout.responses])


def correct_of(inputs: ShapingInputs, part: str) -> torch.Tensor:
    """`ShapingInputs.correct`, Shape [N] bool.

    Raises:
        ValueError: the reward has no notion of correct (refused at load for a config; this is
            the guard for direct calls).
    """
    if inputs.correct is None:
        raise ValueError(f"reward.shaping.{part} needs to know which responses are correct, and reward.name declares no "
                         "correct_score; register the reward with register_reward(name, correct_score=...)")
    return inputs.correct


def grouped(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``values`` as ``[B, G]``: row b holds group b's responses."""
    return values.reshape(-1, group_size)


def correctness_problems(reward: RewardConfig, part: str) -> list[ConfigProblem]:
    """A part that rewards correct responses needs a reward with a notion of correct, and a
    format score below it (a formatted wrong answer must not count as correct). ``reward``: the
    ``reward`` section."""
    from packrl.reward.registry import reward_info

    key = f"reward.shaping.{part}"
    try:
        info = reward_info(reward.name)
    except ValueError:
        return []  # the unknown reward name is its own problem
    if info.correct_score is None:
        return [ConfigProblem(key, reward.shaping.get(part), f"reads which responses are correct, and reward.name={reward.name} "
                              "declares no notion of correct (a dense score)",
                              f"use a reward registered with correct_score (gsm8k, math_verify; a plugin reward declares it: "
                              f"@register_reward(name, correct_score=1.0)), or set {key}=null",
                              keys=(key, "reward.name"))]
    if reward.format_score >= info.correct_score:
        return [ConfigProblem("reward.format_score", reward.format_score, f">= the correct score {info.correct_score:g} of "
                              f"reward.name={reward.name}: {key} would count formatted wrong answers as correct",
                              f"set reward.format_score below {info.correct_score:g}", keys=("reward.format_score", key))]
    return []


def finite_positive(prefix: str, name: str, value: Any, fix: str) -> list[ConfigProblem]:
    """A problem unless ``value`` is a finite number > 0."""
    import math

    if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
        return []
    return [ConfigProblem(f"{prefix}.{name}", value, "must be a finite number > 0", fix)]


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthGateOptions:
    """The accuracy gate every length part's options carry (module docstring), set as
    ``reward.shaping.<part>.<knob>``. The defaults leave the term on everywhere."""

    scale_by_pass_rate: bool = False
    """Multiply each response's length term by its group's pass rate (correct / G; prime-rl):
    the pressure grows with the group's accuracy and is 0 in a group with no correct answer."""

    min_group_accuracy: float = 0.0
    """Apply the length term only in groups whose accuracy (correct / G) is >= this, in [0, 1]
    (GRPO-lambda's per-group switch); 0 = every group."""

    warmup_steps: int = 0
    """Steps without the length term first: it is 0 while the training step <= this (>= 0; Kimi
    k1.5's penalty-free first phase, Short-RL's wait for stable accuracy)."""

    @property
    def gate_reads_correct(self) -> bool:
        """The gate reads which responses are correct (a pass rate or a threshold is set)."""
        return self.scale_by_pass_rate or self.min_group_accuracy > 0

    @property
    def gate_on(self) -> bool:
        """Some part of the gate is set (its ``gated`` term is then reported)."""
        return self.gate_reads_correct or self.warmup_steps > 0

    def gate_problems(self, prefix: str) -> list[ConfigProblem]:
        """Range checks (the types are checked when the options are built): the threshold in
        [0, 1], the warm-up >= 0. ``prefix``: the part's dotted key."""
        out = []
        if not 0 <= self.min_group_accuracy <= 1:  # NaN fails too
            out.append(ConfigProblem(f"{prefix}.min_group_accuracy", self.min_group_accuracy, "must be in [0, 1] (a fraction "
                                     "of the group's responses that are correct)", f"set {prefix}.min_group_accuracy=0.5, or 0 "
                                     "for every group"))
        if self.warmup_steps < 0:
            out.append(ConfigProblem(f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0", f"set {prefix}.warmup_steps=0"))
        return out


def gated(inputs: ShapingInputs, term: torch.Tensor, part: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``term`` times the gate's factor (module docstring), and the ``gated`` term to report.

    Args:
        inputs: the part's inputs; ``inputs.options`` is a `LengthGateOptions`.
        term: the part's length term of each response. Shape [N], float32.
        part: the part's name, for the error when correctness is unknown.

    Returns:
        ``(values, terms)``: values Shape [N] float32; terms ``{"gated": 1.0 where the factor is
        0}`` (reported as ``reward/<part>/gated/mean``, the fraction of responses the gate zeroed),
        empty when no gate option is set.

    ==========================================  =============================
    group correct, options                      factor
    ==========================================  =============================
    T T F F, ``min_group_accuracy=0.5``         1 1 1 1
    T F F F, ``min_group_accuracy=0.5``         0 0 0 0
    T T T F, ``scale_by_pass_rate``             0.75 0.75 0.75 0.75
    any, step 3, ``warmup_steps=3``             0 0 0 0
    ==========================================  =============================
    """
    import torch

    opts: LengthGateOptions = inputs.options
    if not opts.gate_on:
        return term, {}
    factor = torch.ones_like(term)
    if opts.warmup_steps > 0 and inputs.step <= opts.warmup_steps:
        factor = torch.zeros_like(term)
    elif opts.gate_reads_correct:
        size = inputs.rollout.group_size
        correct = grouped(correct_of(inputs, part), size).float()  # [B, G]
        count = correct.sum(dim=1, keepdim=True).expand_as(correct)
        # counts, not fractions, against the threshold: 2 of 4 meets 0.5 exactly
        factor = torch.where(count >= opts.min_group_accuracy * size - 1e-6, 1.0, 0.0)
        if opts.scale_by_pass_rate:
            factor = factor * count / size
        factor = factor.reshape(-1)
    return term * factor, {"gated": (factor == 0).float()}


def gate_config_problems(reward: RewardConfig, train: TrainConfig, part: str) -> list[ConfigProblem]:
    """The gate's checks against the ``reward`` and ``train`` sections: a reward with a notion of
    correct when the gate reads correctness, and a warm-up shorter than the run. Reads the part's
    settings as given (``reward.shaping.<part>``); bad types are the options' own problems."""
    key = f"reward.shaping.{part}"
    args = reward.shaping.get(part) or {}
    threshold, scale = args.get("min_group_accuracy", 0.0), args.get("scale_by_pass_rate", False)
    out = []
    if scale is True or (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and threshold > 0):
        out += correctness_problems(reward, part)
    warmup = args.get("warmup_steps", 0)
    if isinstance(warmup, (int, float)) and not isinstance(warmup, bool) and warmup >= train.total_steps:
        out.append(ConfigProblem(f"{key}.warmup_steps", warmup, f"leaves no step of train.total_steps={train.total_steps} "
                                 "with the length term", f"lower {key}.warmup_steps or raise train.total_steps",
                                 keys=(f"{key}.warmup_steps", "train.total_steps")))
    return out
