"""Rewards: the registry (`reward.name`), the GSM8K rule reward, math-verify, DAPO overlong
shaping, the `task:char_count` reward, and `score_rollout`, which turns a `RolloutBatch` into a `ScoredBatch`.

The reward modules are imported here so their functions are registered; `score_rollout`
(which needs torch) is imported on first use.
"""

from packrl._lazy import lazy_exports
from packrl.reward.char_count import char_count_reward
from packrl.reward.gsm8k import SOLUTION_CLIP_CHARS, answers_match, extract_answer, gsm8k_reward
from packrl.reward.math_verify import math_verify_reward
from packrl.reward.overlong import soft_overlong_penalty
from packrl.reward.registry import REWARDS, RewardFn, get_reward, register_reward

__all__ = [
    "REWARDS",
    "SOLUTION_CLIP_CHARS",
    "RewardFn",
    "answers_match",
    "char_count_reward",
    "extract_answer",
    "get_reward",
    "gsm8k_reward",
    "math_verify_reward",
    "register_reward",
    "score_rollout",
    "soft_overlong_penalty",
]


__getattr__ = lazy_exports("packrl.reward", {"score_rollout": "score"})
