"""What the length objectives share: response lengths, group views and the correctness check.

Shapes: ``N`` responses · ``B`` groups of ``G`` (contiguous).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from packrl.errors import ConfigProblem

if TYPE_CHECKING:
    import torch

    from packrl.config.schema import RewardConfig
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
