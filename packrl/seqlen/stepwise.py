"""Step-wise samples: a multi-turn rollout whose turns did not all see everything before them (the
rolling window, ``rollout.multi_turn.context_policy=rolling``) is trained one context at a time.

Shapes: ``N`` trajectories · ``R_i`` response tokens of trajectory i · ``S`` samples · ``C_s``
context tokens of sample s · ``L_s`` trained tokens of sample s.

A trajectory's turns that share a context start (`Trajectory.context_starts`) form one sample:
its prompt is the context the first of them was generated from, ``prompt + response[start:first
turn start]``, and its response the stretch from that turn to the end of the last one,
``response[first start:last end]`` (the tool answers between them stay in it, outside the loss as
before). Every policy token therefore lies in exactly one sample, scored in exactly the context the
engine generated it in, and a trajectory without dropped turns is one sample equal to itself.

Samples share their trajectory's reward, advantages, loss mask and log-probs (sliced from the
trajectory's ``[R_i]`` values); log-probs computed on samples are stitched back into ``[R_i]``
(`StepSamples.stitch`), so rewards, advantages, metrics and dumps stay per trajectory. For the
loss, a trajectory stays one sequence: the samples of one trajectory carry its loss-token count
(`packrl.types.TrainBatch.trajectory_loss_tokens`) and are counted once in the mini-batch
denominators, so every ``loss_agg_mode`` weighs a trajectory as it would unsplit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from packrl.types import PromptBatch, Response, RolloutBatch, TrainBatch


@dataclass(frozen=True)
class StepSamples:
    """The samples of a rollout with dropped turns.

    Attributes:
        rollout: the samples as a batch of ``S`` sequences, one per "prompt" (``group_size`` 1):
            prompt = the sample's context, ``[C_s]``; response = its trained stretch, ``[L_s]``.
        trajectory_of: the trajectory each sample belongs to, ``[S]`` (non-decreasing).
        offsets: where each sample's stretch starts in its trajectory's response, tokens.
        num_trajectories: N.
        group_size: G of the trajectories' rollout (``rollout.n``).
    """

    rollout: RolloutBatch
    trajectory_of: tuple[int, ...]
    offsets: tuple[int, ...]
    num_trajectories: int
    group_size: int

    @property
    def prompt_of(self) -> tuple[int, ...]:
        """The prompt (group) each sample belongs to, ``[S]``."""
        return tuple(t // self.group_size for t in self.trajectory_of)

    def stitch(self, values: Sequence[torch.Tensor], lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Per-sample values (``S`` tensors of Shape [L_s]) laid into per-trajectory tensors of
        Shape [R_i] (``lengths``); positions no sample trains (tool answers between dropped
        turns) hold 0. Dtype of the inputs."""
        assert len(values) == len(self.trajectory_of) and len(lengths) == self.num_trajectories, "one value per sample"
        dtype = values[0].dtype if values else torch.float32
        out = [torch.zeros(n, dtype=dtype) for n in lengths]
        for v, t, start in zip(values, self.trajectory_of, self.offsets):
            out[t][start:start + len(v)] = v
        return tuple(out)

    def last_of(self, per_sample: Sequence[float]) -> torch.Tensor:
        """Per trajectory, the value of its last sample (e.g. the value after its last token).
        Shape [N], float32."""
        out = torch.zeros(self.num_trajectories)
        for value, t in zip(per_sample, self.trajectory_of):
            out[t] = float(value)  # samples are in order: the last one of t writes last
        return out

    def fold(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Per-sample sums (Shape [S]) added up per trajectory: Shape [N], same dtype."""
        index = torch.tensor(self.trajectory_of, dtype=torch.long)
        return per_sample.new_zeros(self.num_trajectories).index_add_(0, index, per_sample)

    def train_batch(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` (per trajectory) as the samples' batch: rewards, scores, advantages, loss
        masks, log-probs, values, returns and extras sliced to each sample's stretch;
        ``trajectory_loss_tokens`` set."""
        def sliced(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(values[t][start:start + len(r.response_ids)]
                         for t, start, r in zip(self.trajectory_of, self.offsets, self.rollout.responses))

        def maybe_sliced(values: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
            return None if values is None else sliced(values)

        index = torch.tensor(self.trajectory_of, dtype=torch.long)
        scored = batch.scored.indexed(self.rollout, index)
        counts = [int(m.sum()) for m in batch.loss_masks]
        return TrainBatch(scored, sliced(batch.advantages), sliced(batch.loss_masks), maybe_sliced(batch.old_logprobs),
                          maybe_sliced(batch.ref_logprobs), trajectory_loss_tokens=tuple(counts[t] for t in self.trajectory_of),
                          values=maybe_sliced(batch.values), returns=maybe_sliced(batch.returns),
                          extras={name: sliced(values) for name, values in batch.extras.items()})


def _runs(response: Response) -> list[tuple[int, int, int]]:
    """``(context start, first turn start, last turn end)`` of each run of turns sharing a context."""
    trajectory = response.trajectory
    assert trajectory is not None and trajectory.context_starts, "only trajectories with dropped turns are split"
    runs: list[list[int]] = []
    for start, (begin, end) in zip(trajectory.context_starts, trajectory.turn_spans()):
        if runs and runs[-1][0] == start:
            runs[-1][2] = end
        else:
            runs.append([start, begin, end])
    return [(a, b, c) for a, b, c in runs]


def step_samples(rollout: RolloutBatch) -> StepSamples | None:
    """The step-wise samples of ``rollout``, or None when every trajectory is one sample (no turn
    was dropped from any context): then the rollout is trained as it is."""
    if not any(r.trajectory is not None and r.trajectory.context_starts for r in rollout.responses):
        return None
    contexts, responses, trajectory_of, offsets = [], [], [], []
    for i, r in enumerate(rollout.responses):
        prompt = rollout.prompt_ids_of(i)
        runs = _runs(r) if r.trajectory is not None and r.trajectory.context_starts else [(0, 0, len(r.response_ids))]
        for start, begin, end in runs:
            contexts.append(prompt + r.response_ids[start:begin])
            responses.append(_stretch(r, begin, end))
            trajectory_of.append(i)
            offsets.append(begin)
    prompts = rollout.prompts
    by_sample = [t // rollout.group_size for t in trajectory_of]
    sample_prompts = PromptBatch(tuple(contexts), *(tuple(getattr(prompts, name)[b] for b in by_sample)
                                                     for name in ("ground_truths", "data_sources", "rows", "prompt_truncated")))
    return StepSamples(RolloutBatch(sample_prompts, 1, tuple(responses)), tuple(trajectory_of), tuple(offsets),
                       len(rollout), rollout.group_size)


def _stretch(response: Response, begin: int, end: int) -> Response:
    """``response[begin:end]`` as a response of its own (the trajectory's finish reason; no trajectory)."""
    logprobs = response.rollout_logprobs
    mask = response.response_mask
    return replace(response, response_ids=response.response_ids[begin:end],
                   rollout_logprobs=None if logprobs is None else logprobs[begin:end],
                   response_mask=None if mask is None else mask[begin:end], trajectory=None)
