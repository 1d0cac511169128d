"""Score a rollout: decode each response, apply the registered reward, add the reward-shaping
parts of ``reward.shaping`` (`packrl.reward.shaping.shape_rewards`).

Shapes: ``N`` responses (``B`` prompts x ``G`` per prompt); response ``i`` is scored against the
ground truth and data source of prompt ``i // G``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from packrl.config.schema import RewardConfig
from packrl.reward.registry import get_reward, reward_info, scores_truncated
from packrl.reward.shaping import ShapingInputs, shape_rewards
from packrl.types import Response, RolloutBatch, ScoredBatch

logger = logging.getLogger(__name__)

def score_rollout(rollout: RolloutBatch, tokenizer: Any, cfg: RewardConfig, max_response_tokens: int, *, step: int = 0) -> ScoredBatch:
    """Task scores and shaped rewards of every response.

    Args:
        rollout: N responses and their prompts.
        tokenizer: the policy's tokenizer; responses are decoded with special tokens skipped.
        cfg: the ``reward`` section (``name``, extraction, ``format_score``, ``shaping``).
        max_response_tokens: the step's response budget (``rollout.max_response_tokens``, or the
            current stage's under a length curriculum): each response's budget, where its overlong
            ramp ends, unless its prompt carries its own (`packrl.types.RolloutBatch.response_budgets`).
        step: the training step (for shaping parts that change over training; 0 in validation).

    A response a budget cut (finish reason ``length`` or ``context``) scores 0 without calling
    the reward function unless the reward's rule or ``reward.score_truncated`` says otherwise
    (`packrl.reward.registry.scores_truncated`); a multi-turn response is scored
    on its policy turns only (`policy_texts`).

    Returns:
        `ScoredBatch` with ``scores`` (the reward function's value, Shape [N], float32),
        ``rewards`` (scores plus every shaping part, Shape [N], float32) and ``parts`` (each
        shaping part's values and its terms, `packrl.reward.shaping.shape_rewards`).

    Raises:
        ValueError: ``cfg.name`` or a shaping part is not registered, or a part returned bad values.
        RuntimeError: the reward function raised twice on one response (it is retried once);
            names the response index, data source, ground truth and the cause.
    """
    reward_fn = get_reward(cfg.name)
    texts = policy_texts(rollout.responses, tokenizer)
    score_cut = scores_truncated(cfg)
    prompts, group = rollout.prompts, rollout.group_size
    scores = []
    for i, (text, response) in enumerate(zip(texts, rollout.responses)):
        truth, source = prompts.ground_truths[i // group], prompts.data_sources[i // group]
        if response.truncated and not score_cut:
            scores.append(0.0)
        else:
            scores.append(_score_with_retry(reward_fn, text, truth, source, cfg, i))
    task = torch.tensor(scores, dtype=torch.float32)
    correct_score = reward_info(cfg.name).correct_score
    correct = None if correct_score is None else (task >= correct_score) & ~torch.tensor([r.truncated for r in rollout.responses])
    shaping, parts = shape_rewards(ShapingInputs(rollout=rollout, scores=task, texts=tuple(texts), tokenizer=tokenizer,
                                                 response_budgets=rollout.response_budgets(max_response_tokens), step=step,
                                                 correct=correct), cfg)
    return ScoredBatch(rollout=rollout, scores=task, rewards=task + shaping, parts=parts, correct=correct)


def policy_texts(responses: tuple[Response, ...], tokenizer: Any) -> list[str]:
    """The text a reward scores, per response: decoded with special tokens skipped; for a
    multi-turn response only the policy's turns, joined by newlines (tool answers are not the
    policy's and never count as its answer). One batched decode."""
    pieces = [r.policy_segments() for r in responses]
    flat = tokenizer.batch_decode([list(s) for segments in pieces for s in segments], skip_special_tokens=True)
    out, k = [], 0
    for segments in pieces:
        out.append("\n".join(flat[k:k + len(segments)]))
        k += len(segments)
    return out


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


def check_ground_truths(cfg: RewardConfig, dataset: Any, key: str) -> None:
    """Fail before the model loads when ``reward.name`` declares which ground truths it can read
    (`packrl.capabilities.RewardInfo.ground_truth_problem`) and a prompt of ``dataset`` has
    another. ``dataset``: a `packrl.data.dataset.PromptDataset`; ``key``: its config key.

    Raises:
        ValueError: names the first such row, how many there are, and the fix.
    """
    problem = reward_info(cfg.name).ground_truth_problem
    if problem is None:
        return
    bad = [(p.example.row, why) for p in dataset.prompts if (why := problem(p.example.ground_truth)) is not None]
    if bad:
        row, why = bad[0]
        raise ValueError(f"reward.name={cfg.name!r} cannot read the ground truth of {len(bad)} of {len(dataset.prompts)} rows of "
                         f"{key} (input row {row}, counted from 0 over the split's files: {why}); give it data made for it or "
                         "choose a reward that reads these rows (reward.name=gsm8k reads a final number)")


def _score_with_retry(reward_fn: Any, text: str, truth: str, source: str, cfg: RewardConfig, index: int) -> float:
    """One response's score; a raising reward function is retried once (a flaky verifier or
    sandbox), then the failure names the response and the cause."""
    for attempt in (1, 2):
        try:
            return float(reward_fn(text, truth, data_source=source, cfg=cfg))
        except Exception as err:  # noqa: BLE001 - user code; reported with its type
            if attempt == 2:
                raise RuntimeError(
                    f"reward {cfg.name!r} failed twice on response {index} (data_source={source!r}, ground truth "
                    f"{truth[:80]!r}): {type(err).__name__}: {err}"
                ) from err
            logger.warning("reward %r raised on response %d (%s: %s); retrying once", cfg.name, index, type(err).__name__, err)
    raise AssertionError("unreachable")
