"""The update plan: for every mini-batch of a step, each rank's micro-batches and the mini-batch's
loss denominators. The controller builds it once per step, for one process and for data-parallel
ranks alike; every worker executes its rank's part of it.

Shapes: ``N`` sequences (``B`` prompts x ``G`` responses, groups contiguous) · ``D`` ranks ·
``M`` micro-batches per rank and mini-batch.

A mini-batch is ``mini_batch_prompts`` whole groups (a group: the sequences of one prompt, whole
responses or the step-wise samples of its trajectories, `packrl.seqlen.stepwise`). Its sequences
are split over the ranks by `packrl.seqlen.balance.balance_ranks` (every rank gets the same
number of micro-batches, so
collectives stay in step; one rank plans with `plan_microbatches` directly), and its denominators
count the loss tokens and sequences of the whole mini-batch, so every ``loss_agg_mode`` gives the
same loss and gradient however the mini-batch is split (invariant 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packrl.seqlen.balance import RankPlan, balance_ranks
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.microbatch import MicrobatchPlan, plan_microbatches, validate_lengths

UPDATE_BUDGET_KEY = "train.max_tokens_per_microbatch"


def plan_ranks(lengths: Sequence[int], num_ranks: int, max_tokens: int, *, balance: bool, budget_key: str,
               packed: bool = True) -> RankPlan:
    """Micro-batches of at most ``max_tokens`` real tokens for each of ``num_ranks`` ranks.

    One rank plans with `plan_microbatches` (the fewest micro-batches); several with
    `balance_ranks` (Karmarkar-Karp over ranks, equal micro-batch counts). Indices are indices of
    ``lengths``; `RankPlan.restore` puts per-rank results back in that order. ``packed=False``
    gives every sequence a micro-batch of its own (a model whose packs are not exact).

    Raises:
        ValueError: as `plan_microbatches` / `balance_ranks` (a sequence over the cap is named).
    """
    if num_ranks == 1:
        return RankPlan((plan_microbatches(lengths, max_tokens, balance=balance, budget_key=budget_key, packed=packed),))
    return balance_ranks(lengths, num_ranks, max_tokens, balance_microbatches=balance, budget_key=budget_key, packed=packed)


@dataclass(frozen=True)
class MinibatchPlan:
    """One optimizer step's work.

    Attributes:
        sequences: the mini-batch's sequence indices (whole groups, ascending).
        ranks: each rank's micro-batches, as indices of the step's batch.
        denominators: loss tokens and sequences of the whole mini-batch.
    """

    sequences: tuple[int, ...]
    ranks: RankPlan
    denominators: LossDenominators

    def microbatches(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """Rank ``rank``'s micro-batches (batch indices); some may be empty on a rank with few sequences."""
        return self.ranks.ranks[rank].microbatches


@dataclass(frozen=True)
class UpdatePlan:
    """Every mini-batch of one update, run ``num_epochs`` times in order (one optimizer step each).

    Attributes:
        minibatches: the mini-batches of one epoch.
        num_epochs: passes over them (``train.ppo_epochs``).
    """

    minibatches: tuple[MinibatchPlan, ...]
    num_epochs: int

    @property
    def num_ranks(self) -> int:
        return len(self.minibatches[0].ranks.ranks)

    def imbalance(self) -> float:
        """Costliest rank over the mean rank, averaged over mini-batches (``seqlen/rank_imbalance``)."""
        return sum(mb.ranks.imbalance() for mb in self.minibatches) / len(self.minibatches)


def plan_update(
    lengths: Sequence[int],
    loss_tokens: Sequence[int],
    *,
    groups: Sequence[int],
    mini_batch_prompts: int,
    num_epochs: int,
    num_ranks: int,
    max_tokens: int,
    balance: bool,
    loss_scale_factor: int,
    packed: bool = True,
    units: Sequence[int] | None = None,
) -> UpdatePlan:
    """Plan a step's update.

    Args:
        lengths: prompt + response tokens of each of the N sequences.
        loss_tokens: loss tokens (True in the loss mask) of each sequence.
        groups: the prompt each sequence answers, non-decreasing (``i // G`` for whole responses;
            `groups_of` builds it).
        mini_batch_prompts: prompts (groups) per mini-batch (the last one may hold fewer).
        num_epochs: ``train.ppo_epochs``.
        num_ranks: D data-parallel ranks.
        max_tokens: ``train.max_tokens_per_microbatch``.
        balance: ``train.balance_microbatches``.
        loss_scale_factor: C of ``seq-mean-token-sum-norm`` (tokens).
        packed: False gives every sequence a micro-batch of its own.
        units: the response (trajectory) each sequence is a part of, for the sequence count of
            the denominators (`packrl.seqlen.stepwise`); default: each sequence is its own.

    Raises:
        ValueError: a sequence over ``max_tokens`` (named by its index in the batch), or a
            mini-batch with fewer sequences than ranks.
    """
    lengths, _ = validate_lengths(lengths, max_tokens, UPDATE_BUDGET_KEY)
    assert len(loss_tokens) == len(lengths) == len(groups), "one count and one group per sequence"
    assert list(groups) == sorted(groups), "the sequences of a group are contiguous"
    units = range(len(lengths)) if units is None else units
    firsts = [i for i in range(len(groups)) if i == 0 or groups[i] != groups[i - 1]] + [len(groups)]  # where each group starts
    minibatches = []
    for start in range(0, len(firsts) - 1, mini_batch_prompts):
        indices = tuple(range(firsts[start], firsts[min(start + mini_batch_prompts, len(firsts) - 1)]))
        local = plan_ranks([lengths[i] for i in indices], num_ranks, max_tokens, balance=balance, budget_key=UPDATE_BUDGET_KEY,
                           packed=packed)
        ranks = RankPlan(tuple(MicrobatchPlan(tuple(tuple(indices[j] for j in mb) for mb in rank.microbatches), tuple(lengths),
                                              max_tokens) for rank in local.ranks), local.linear_coef)
        per_unit: dict[int, int] = {}
        for i in indices:
            per_unit[units[i]] = per_unit.get(units[i], 0) + loss_tokens[i]
        denominators = LossDenominators(sum(per_unit.values()), sum(1 for c in per_unit.values() if c > 0), loss_scale_factor)
        minibatches.append(MinibatchPlan(indices, ranks, denominators))
    return UpdatePlan(tuple(minibatches), num_epochs)


def groups_of(num_sequences: int, group_size: int) -> list[int]:
    """The prompt of each of ``num_sequences`` whole responses, ``group_size`` per prompt."""
    assert num_sequences % group_size == 0, "whole groups"
    return [i // group_size for i in range(num_sequences)]
