"""Score a rollout: decode each response, apply the registered reward, add the overlong penalty.

Shapes: ``N`` responses (``B`` prompts x ``G`` per prompt); response ``i`` is scored against the
ground truth and data source of prompt ``i // G``.
"""

from __future__ import annotations

from typing import Any

import torch

from packrl.config.schema import RewardConfig
from packrl.reward.overlong import soft_overlong_penalty
from packrl.reward.registry import get_reward
from packrl.types import RolloutBatch, ScoredBatch


def score_rollout(rollout: RolloutBatch, tokenizer: Any, cfg: RewardConfig, max_response_tokens: int) -> ScoredBatch:
    """Task scores and shaped rewards of every response.

    Args:
        rollout: N responses and their prompts.
        tokenizer: the policy's tokenizer; responses are decoded with special tokens skipped.
        cfg: the ``reward`` section (``name``, extraction, ``format_score``, overlong shaping).
        max_response_tokens: ``rollout.max_response_tokens``, where the overlong ramp ends.

    Returns:
        `ScoredBatch` with ``scores`` (the reward function's value, Shape [N], float32) and
        ``rewards`` (scores plus the overlong penalty, Shape [N], float32).

    Raises:
        ValueError: ``cfg.name`` is not registered, or the overlong buffer exceeds the budget.
        RuntimeError: the reward function raised; names the response index and data source.
    """
    reward_fn = get_reward(cfg.name)
    texts = tokenizer.batch_decode([list(r.response_ids) for r in rollout.responses], skip_special_tokens=True)
    prompts, group = rollout.prompts, rollout.group_size
    scores, rewards = [], []
    for i, (text, response) in enumerate(zip(texts, rollout.responses)):
        truth, source = prompts.ground_truths[i // group], prompts.data_sources[i // group]
        try:
            score = float(reward_fn(text, truth, data_source=source, cfg=cfg))
        except Exception as err:
            raise RuntimeError(
                f"reward {cfg.name!r} failed on response {i} (data_source={source!r}): {type(err).__name__}: {err}"
            ) from err
        penalty = soft_overlong_penalty(
            len(response.response_ids), max_response_tokens, cfg.overlong_buffer_tokens, cfg.overlong_penalty_factor
        )
        scores.append(score)
        rewards.append(score + penalty)
    return ScoredBatch(
        rollout=rollout,
        scores=torch.tensor(scores, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32),
    )


def check_reward(cfg: RewardConfig) -> None:
    """Fail before a run starts when ``reward.name`` is not registered or cannot run: the reward
    is called once on an empty response (which any reward must score, usually 0).

    Raises:
        ValueError: an unknown ``reward.name`` (listing the registered ones) or a reward that
            raises on a trivial input (e.g. a missing optional package).
    """
    fn = get_reward(cfg.name)
    try:
        fn("", "0", data_source="packrl/check", cfg=cfg)
    except Exception as err:
        raise ValueError(f"reward.name={cfg.name!r} cannot score a response: {type(err).__name__}: {err}") from err
