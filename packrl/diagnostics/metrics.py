"""Step metrics. Names follow verl where the meaning is the same (``response_length/mean``,
``critic/score/mean``, ``timing_s/gen``, ``perf/throughput``); see docs/metrics.md.

One difference of meaning: ``response_length/clip_ratio`` is the fraction of responses whose
finish reason is ``length`` or ``context`` (truncated), taken from the engine; verl counts
responses whose length equals the padded response width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from packrl.diagnostics.buckets import bucket_means, length_buckets
from packrl.types import FINISH_REASONS, RolloutBatch, TrainBatch


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    t = torch.tensor([float(v) for v in values]) if values else torch.zeros(1)
    return {f"{prefix}/mean": t.mean().item(), f"{prefix}/max": t.max().item(), f"{prefix}/min": t.min().item()}


def rollout_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """Length and finish-reason metrics of one rollout.

    Returns:
        ``response_length/mean|max|min|clip_ratio`` (tokens; clip_ratio = truncated fraction),
        ``prompt_length/mean|max|min`` (tokens, per prompt), and
        ``response/finish_reason/<reason>`` (fraction of responses, every reason present).
    """
    responses = rollout.responses
    out = _stats("response_length", [len(r.response_ids) for r in responses])
    out["response_length/clip_ratio"] = sum(r.truncated for r in responses) / max(1, len(responses))
    out |= _stats("prompt_length", [len(p) for p in rollout.prompts.prompt_ids])
    out |= extra_input_metrics(rollout)
    for reason in FINISH_REASONS:
        out[f"response/finish_reason/{reason}"] = sum(r.finish_reason == reason for r in responses) / max(1, len(responses))
    return out | multi_turn_metrics(rollout)


def extra_input_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """The metrics of a rollout's prompts' extra inputs, as their modality states them
    (`packrl.types.ExtraInputs.batch_metrics`: a vision-language rollout's
    ``prompt_length/vision_tokens/mean|max``, ``prompt_length/text_tokens/mean``,
    ``prompt_length/vision_patches/mean``, ``prompt_length/num_images/mean``); empty for text."""
    inputs = rollout.prompts.extra_inputs or ()
    lengths = [len(p) for p in rollout.prompts.prompt_ids]
    out: dict[str, float] = {}
    for kind in {type(x): None for x in inputs if x is not None}:
        out |= kind.batch_metrics(inputs, lengths)
    return out


TRAJECTORY_ENDINGS = ("answer", "max_turns", "turn_tokens", "response_tokens", "trajectory_tokens", "context", "abort")


def multi_turn_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """Turn and tool metrics of a multi-turn rollout (empty for single-turn responses).

    Returns:
        ``num_turns/mean|max|min`` (assistant turns per trajectory, verl's name);
        ``multi_turn/tool_calls``, ``multi_turn/malformed_calls``, ``multi_turn/tool_errors``
        (per trajectory, mean); ``multi_turn/tool_use_rate`` (fraction of trajectories with a
        call); ``multi_turn/tokens_per_turn/mean`` (policy tokens per assistant turn);
        ``multi_turn/tool_response_tokens/mean`` (tool-message tokens per trajectory, template
        included); ``multi_turn/ended/<why>`` (fraction of trajectories each budget or event ended,
        `packrl.types.Trajectory.ended_by`); ``multi_turn/dropped_turns`` (turns the rolling
        window dropped from the last turn's context, per trajectory, mean).
    """
    trajectories = [r.trajectory for r in rollout.responses if r.trajectory is not None]
    if not trajectories:
        return {}
    n = len(trajectories)
    out = _stats("num_turns", [t.num_turns for t in trajectories])
    out["multi_turn/tool_calls"] = sum(t.num_tool_calls for t in trajectories) / n
    out["multi_turn/malformed_calls"] = sum(t.num_malformed_calls for t in trajectories) / n
    out["multi_turn/tool_errors"] = sum(t.num_tool_errors for t in trajectories) / n
    out["multi_turn/tool_use_rate"] = sum(t.num_tool_calls > 0 for t in trajectories) / n
    out["multi_turn/tokens_per_turn/mean"] = (sum(t.tokens_of("assistant") for t in trajectories)
                                              / max(1, sum(t.num_turns for t in trajectories)))
    out["multi_turn/tool_response_tokens/mean"] = sum(t.tokens_of("tool") for t in trajectories) / n
    out["multi_turn/dropped_turns"] = sum(t.num_dropped_turns for t in trajectories) / n
    for why in TRAJECTORY_ENDINGS:
        out[f"multi_turn/ended/{why}"] = sum(t.ended_by == why for t in trajectories) / n
    return out


def score_metrics(batch: TrainBatch) -> dict[str, float]:
    """``critic/score/mean|max|min`` and ``critic/rewards/mean|max|min`` (per response), and
    ``critic/advantages/mean|max|min`` over every response token the policy generated (verl's
    meaning: advantages are per token; an outcome estimator's mean is then length-weighted); and
    ``reward/<part>/mean`` (mean per response) for each shaping part in the rewards and each of its
    terms (``reward/overlong/mean``, ``reward/tool_format/mean``, ``reward/tool_format/call/mean``:
    `packrl.reward.shaping`)."""
    scored = batch.scored
    generated = [a[r.generated_mask()] for a, r in zip(batch.advantages, batch.rollout.responses)]
    tokens = torch.cat(generated) if generated else torch.zeros(0)
    parts = {f"reward/{name}/mean": float(values.mean()) if len(values) else 0.0 for name, values in scored.parts.items()}
    return (
        _stats("critic/score", scored.scores.tolist())
        | _stats("critic/rewards", scored.rewards.tolist())
        | _stats("critic/advantages", tokens.tolist())
        | parts
    )


def perf_metrics(rollout: RolloutBatch, timing: dict[str, float]) -> dict[str, float]:
    """``timing_s/<stage>``, ``perf/total_num_tokens`` (prompt + response tokens of the step),
    ``perf/time_per_step`` (s) and ``perf/throughput`` (tokens/s per device; one device here)."""
    total_tokens = sum(rollout.sequence_lengths())
    step_s = timing.get("step", sum(timing.values()))
    out = {f"timing_s/{name}": value for name, value in timing.items()}
    out["perf/total_num_tokens"] = float(total_tokens)
    out["perf/time_per_step"] = step_s
    out["perf/throughput"] = total_tokens / step_s if step_s > 0 else 0.0
    return out


def bucket_metrics(batch: TrainBatch, max_response_tokens: int) -> dict[str, float]:
    """``bucket/score/<lo>-<hi>`` (task score) and ``bucket/advantage/<lo>-<hi>`` (mean over the
    response's loss tokens; responses without loss tokens left out), averaged over the responses
    of each response-length bucket (`packrl.diagnostics.buckets`). The update adds
    ``bucket/entropy|clipfrac|kl``."""
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    advantages = [float(a[m].mean()) if m.any() else None for a, m in zip(batch.advantages, batch.loss_masks)]
    return (bucket_means("score", batch.scored.scores.tolist(), lengths, max_response_tokens)
            | bucket_means("advantage", advantages, lengths, max_response_tokens))


def rollout_mismatch_metrics(rollout: RolloutBatch, logprobs: Sequence[torch.Tensor] | None, max_response_tokens: int) -> dict[str, float]:
    """Train/rollout probability mismatch over every token the policy generated (verl's
    ``training/rollout_probs_diff_*``; tool messages of a multi-turn response left out):
    d = |exp(logprobs) - exp(rollout_logprobs)|.

    Args:
        rollout: responses with the engine's ``rollout_logprobs`` (``rollout.return_logprobs``).
        logprobs: the trainer's log-probs of the same tokens, ``N`` tensors of Shape [R_i],
            float32, nats: the old-log-prob pass, which runs whenever the engine returns
            log-probs (no extra forward). None when that pass did not run.
        max_response_tokens: the response budget, for the position buckets.

    Returns:
        ``training/rollout_probs_diff_mean|max|std`` (probability, std unbiased) and
        ``training/rollout_probs_diff_mean/pos_<lo>-<hi>`` by token position in the response;
        empty when either side's log-probs are missing.
    """
    responses = rollout.responses
    if logprobs is None or any(r.rollout_logprobs is None for r in responses):
        return {}
    diffs, positions = [], []
    for r, lp in zip(responses, logprobs):
        generated = r.generated_mask()
        diffs.append((lp.float().exp() - torch.tensor(r.rollout_logprobs, dtype=torch.float32).exp()).abs()[generated])
        positions.append(torch.arange(len(generated))[generated])
    flat = torch.cat(diffs) if diffs else torch.zeros(0)
    if flat.numel() == 0:
        return {}
    out = {
        "training/rollout_probs_diff_mean": flat.mean().item(),
        "training/rollout_probs_diff_max": flat.max().item(),
        "training/rollout_probs_diff_std": flat.std().item() if flat.numel() > 1 else 0.0,
    }
    flat_positions = torch.cat(positions)
    for lo, hi in length_buckets(max_response_tokens):
        here = flat[(flat_positions >= lo) & (flat_positions < hi)]
        if here.numel():
            out[f"training/rollout_probs_diff_mean/pos_{lo}-{hi}"] = here.mean().item()
    return out
