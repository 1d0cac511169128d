"""The ``sync`` rollout mode: every step generates its batch whole, in one generation round or, with
sampling filters (`packrl.algos.filters`, stage ``sampling``: dynamic sampling), in rounds.

- `one_round` draws ``data.batch_size`` prompts, generates and scores them (no metrics);
- `filtered_rounds` repeats rounds, keeps the groups every sampling filter keeps and stops when
  ``data.batch_size`` are kept or after the rounds the filters allow (`FilterOutput.max_rounds`).

Every round draws from the run's `PromptSampler`, so the checkpointed sampler position already
covers extra rounds and a resumed run draws what the uninterrupted run drew. Dropped groups are
not data rows lost (their rows stay in the dataset and come back next epoch); they are counted in
``train/*`` metrics.

Shapes: ``B`` prompts · ``G`` responses per prompt · ``N = B*G``; response i answers prompt ``i // G``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from packrl.algos.filters import ChosenFilter, filter_chain, kept_groups
from packrl.config.schema import RewardConfig
from packrl.data.dataset import PromptSampler
from packrl.diagnostics.timers import Span, stage_timer
from packrl.distributed.group import WorkerGroup
from packrl.registry import ROLLOUT_MODES
from packrl.reward.score import score_rollout
from packrl.rollout.engine import SamplingParams
from packrl.trainer.stages.base import Sampled, SamplingStage, StageContext, no_carried_state
from packrl.types import PromptBatch, ScoredBatch

logger = logging.getLogger(__name__)

Round = Callable[[SamplingParams, dict[str, float], list[Span], int], Sampled]


@dataclass(frozen=True)
class Rounds:
    """A stage of whole generation rounds (`one_round`, `dynamic_sampling`): nothing is carried
    between steps, so it has no state."""

    rounds: Round

    def __call__(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int = 0) -> Sampled:
        return self.rounds(sampling, timing, spans, step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore; a checkpoint of an async run that carries groups or drawn prompts
        is refused (this mode would never train them, `no_carried_state`)."""
        no_carried_state(state, "sync")

    def close(self) -> None:
        """Nothing to release."""


@ROLLOUT_MODES.register("sync")
def sync_stage(context: StageContext) -> SamplingStage:
    """The ``sync`` mode: `filtered_rounds` with sampling filters, else `one_round`."""
    cfg, sampler, workers = context.cfg, context.sampler, context.workers
    chain = filter_chain(cfg.algorithm, "sampling")
    if not chain:
        return Rounds(partial(one_round, reward=cfg.reward, sampler=sampler, workers=workers))
    return Rounds(partial(filtered_rounds, reward=cfg.reward, chain=chain, batch_size=cfg.data.batch_size, sampler=sampler,
                          workers=workers))


def one_round(sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int, *,
              reward: RewardConfig, sampler: PromptSampler, workers: WorkerGroup) -> Sampled:
    """``data.batch_size`` prompts from ``sampler`` (its batch size), generated and scored under
    ``reward`` (the ``reward`` section): every response's budget is the step's
    (``sampling.max_response_tokens``), where the overlong ramp ends. No metrics."""
    prompts = sampler.next_batch()
    with stage_timer(timing, "gen", spans):
        rollout = workers.generate(prompts, sampling)
    with stage_timer(timing, "reward", spans):
        scored = score_rollout(rollout, workers.tokenizer, reward, sampling.max_response_tokens, step=step)
    return rollout, scored, {}


@dataclass(frozen=True)
class FillCounts:
    """What the sampling filters did in one step, in prompts (groups) unless named otherwise.

    ``num_gen_prompts = sum(dropped) + kept`` and ``kept = update + surplus + too_few_for_ranks``.
    """

    num_gen_batches: int
    num_gen_prompts: int
    dropped: dict[str, int]
    num_kept: int
    num_surplus: int
    num_too_few_for_ranks: int
    num_update: int
    gen_score_mean: float

    def metrics(self) -> dict[str, float]:
        """The ``train/*`` metrics (docs/metrics.md): ``train/num_dropped_prompts/<filter>`` per sampling filter."""
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/num_gen_prompts": float(self.num_gen_prompts),
            "train/num_kept_prompts": float(self.num_kept),
            **{f"train/num_dropped_prompts/{name}": float(n) for name, n in self.dropped.items()},
            "train/num_dropped_prompts/surplus": float(self.num_surplus),
            "train/num_dropped_prompts/too_few_for_ranks": float(self.num_too_few_for_ranks),
            "train/update_batch_prompts": float(self.num_update),
            "train/gen_score/mean": self.gen_score_mean,
        }


def filtered_rounds(sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int, *,
                    reward: RewardConfig, chain: Sequence[ChosenFilter], batch_size: int, sampler: PromptSampler,
                    workers: WorkerGroup) -> Sampled:
    """Rounds of `one_round` until ``batch_size`` (``data.batch_size``) groups that every sampling
    filter of ``chain`` keeps are kept, at most the rounds the filters allow (`kept_groups`: the
    largest `FilterOutput.max_rounds`; DAPO's dynamic sampling, arXiv 2503.14476).

    Kept groups keep their round's order; groups kept beyond ``data.batch_size`` are dropped
    (``surplus``), so a full step trains exactly ``data.batch_size`` prompts. At the cap the step
    trains the groups kept so far (a warning says how many), less a last mini-batch that would
    give some data-parallel rank no sequence (`fit_to_ranks`).

    Returns:
        The kept groups' rollout and scores, `FillCounts.metrics` and the filters' own metrics (of
        the last round).

    Raises:
        RuntimeError: no group is left to train after the last round; the message names the counts
            and the keys to change.
    """
    want, plan = batch_size, workers.plan
    kept: list[ScoredBatch] = []
    dropped = {f.name: 0 for f in chain}
    num_kept = num_rounds = num_generated = 0
    max_rounds = 1
    scores: list[torch.Tensor] = []
    filter_metrics: dict[str, float] = {}
    while num_rounds == 0 or (num_kept < want and num_rounds < max_rounds):
        _, scored, _ = one_round(sampling, timing, spans, step, reward=reward, sampler=sampler, workers=workers)
        keep, round_dropped, filter_metrics, max_rounds = kept_groups(chain, scored)
        dropped = {name: dropped[name] + n for name, n in round_dropped.items()}
        kept.append(select_groups(scored, keep))
        num_rounds, num_kept = num_rounds + 1, num_kept + len(keep)
        num_generated += len(scored.rollout.prompts)
        scores.append(scored.scores)
    num_update = fit_to_ranks(min(num_kept, want), plan.mini_batch_prompts, plan.group_size, plan.data_parallel_size)
    counts = FillCounts(num_rounds, num_generated, dropped, num_kept, max(0, num_kept - want),
                        min(num_kept, want) - num_update, num_update, float(torch.cat(scores).mean()))
    if num_update == 0:
        raise RuntimeError(_nothing_left(counts, want, plan.data_parallel_size))
    if num_update < want:
        logger.warning(
            "sampling filters: %d of data.batch_size=%d prompt groups kept after %d rounds (%d prompts generated; dropped %s); "
            "this step trains %d; raise the rounds the filters allow (%s) to fill the batch",
            num_kept, want, num_rounds, num_generated, counts.dropped, num_update, ", ".join(f"algorithm.filters.{n}" for n in dropped),
        )
    scored = select_groups(concat_scored(kept), range(num_update))
    return scored.rollout, scored, counts.metrics() | filter_metrics  # the filters' own metrics: of the last round


def _nothing_left(counts: FillCounts, batch_size: int, num_ranks: int) -> str:
    names = ", ".join(f"algorithm.filters.{name}" for name in counts.dropped)
    why = (f"{counts.num_kept} group(s) kept make a mini-batch of fewer sequences than the {num_ranks} "
           "data-parallel ranks (each needs one)" if counts.num_kept else
           f"the filters dropped all {counts.num_gen_prompts} prompt groups ({counts.dropped}; mean score {counts.gen_score_mean:.3g})")
    return (f"the sampling filters left no prompt group to train after {counts.num_gen_batches} rounds of "
            f"data.batch_size={batch_size} prompts: {why}; raise the rounds they allow ({names}), check that reward.name "
            f"tells responses apart on this data, or turn them off ({names}=null)")


def fit_to_ranks(num_prompts: int, mini_batch_prompts: int, group_size: int, num_ranks: int) -> int:
    """The prompts of ``num_prompts`` the update can take: all, unless the last (shorter)
    mini-batch would hold fewer sequences than data-parallel ranks (each rank needs one;
    `packrl.seqlen.update_plan.plan_update` refuses less), which is then left out.

    ======  ====  ==  =====  ======
    prompts mini  G   ranks  result
    ======  ====  ==  =====  ======
    5       2     4   8      4
    5       2     8   8      5
    ======  ====  ==  =====  ======
    """
    last = num_prompts % mini_batch_prompts
    return num_prompts - last if last and last * group_size < num_ranks else num_prompts


def select_groups(scored: ScoredBatch, groups: Sequence[int]) -> ScoredBatch:
    """The groups ``groups`` of ``scored`` (prompt indices, in the given order), with their prompts,
    responses, scores, rewards and reward parts."""
    rollout, size = scored.rollout, scored.rollout.group_size
    responses = [i * size + j for i in groups for j in range(size)]
    prompts = rollout.prompts.select(groups)
    sub = dataclasses.replace(rollout, prompts=prompts, responses=tuple(rollout.responses[i] for i in responses))
    return scored.indexed(sub, torch.tensor(responses, dtype=torch.long))


def concat_scored(parts: Sequence[ScoredBatch]) -> ScoredBatch:
    """``parts`` one after the other (same group size), groups in order."""
    first = parts[0]
    prompts = PromptBatch.concat([part.rollout.prompts for part in parts])
    responses = tuple(r for part in parts for r in part.rollout.responses)
    rollout = dataclasses.replace(first.rollout, prompts=prompts, responses=responses)
    corrects = [p.correct for p in parts if p.correct is not None]
    correct = torch.cat(corrects) if len(corrects) == len(parts) else None
    return dataclasses.replace(first, rollout=rollout, scores=torch.cat([p.scores for p in parts]),
                               rewards=torch.cat([p.rewards for p in parts]),
                               parts={name: torch.cat([p.parts[name] for p in parts]) for name in first.parts}, correct=correct)

