"""Validation: one response per prompt at ``rollout.val_temperature`` (0 = greedy) over the val set."""

from __future__ import annotations

from typing import Any

from packrl.config.schema import RewardConfig, RolloutConfig
from packrl.diagnostics.length_metrics import length_metrics
from packrl.distributed.group import WorkerGroup
from packrl.reward.score import score_rollout
from packrl.rollout.engine import SamplingParams
from packrl.trainer.stages.rounds import concat_scored


def validate(workers: WorkerGroup, dataset: Any, rollout_cfg: RolloutConfig, reward_cfg: RewardConfig) -> dict[str, float]:
    """``val/accuracy`` (fraction of responses scoring >= 1, i.e. correct), ``val/score/mean``,
    ``val/response_length/mean`` (tokens) and ``val/response_length/clip_ratio``; with
    multi-turn rollouts also ``val/multi_turn/tool_use_rate`` (fraction of responses that called a
    tool); and the length metrics over the whole set (`packrl.diagnostics.length_metrics`, ``val/length/*``).
    ``rollout_cfg`` and ``reward_cfg``: the run's ``rollout`` and ``reward`` sections."""
    params = SamplingParams.from_config(rollout_cfg, validation=True)
    scores: list[float] = []
    lengths: list[int] = []
    truncated = 0
    tool_users: list[bool] = []
    batches = []
    for prompts in dataset.iter_batches(rollout_cfg.max_num_seqs):
        rollout = workers.generate(prompts, params)
        scored = score_rollout(rollout, workers.tokenizer, reward_cfg, rollout_cfg.max_response_tokens)
        batches.append(scored)
        scores += scored.scores.tolist()
        lengths += [len(r.response_ids) for r in rollout.responses]
        truncated += sum(r.truncated for r in rollout.responses)
        tool_users += [r.trajectory.num_tool_calls > 0 for r in rollout.responses if r.trajectory is not None]
    count = max(1, len(scores))
    return {
        "val/accuracy": sum(s >= 1.0 for s in scores) / count,
        "val/score/mean": sum(scores) / count,
        "val/response_length/mean": sum(lengths) / count,
        "val/response_length/clip_ratio": truncated / count,
    } | ({"val/multi_turn/tool_use_rate": sum(tool_users) / len(tool_users)} if tool_users else {}) | (
        length_metrics(concat_scored(batches), prefix="val/length", forced_tokens_key="val/length/forced_tokens",
                       warn_all_wrong=False) if batches else {})
