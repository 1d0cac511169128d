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

A sequence with no loss token (GFPO's filtered responses, responses cut under
``algorithm.truncated=mask``, rejected by rollout correction or the entropy filter) adds exactly 0
to every loss term and update metric, each of which reads loss tokens only: the update leaves it
out of the micro-batches (`trained_sequences`), while the denominators, counted over the whole
mini-batch, stay what they were. GFPO with ``rollout.n=2k`` thus updates on the k kept
responses of each group alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packrl.seqlen.balance import RankPlan, balance_ranks
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.microbatch import CapLimit, GroupedCap, MicrobatchPlan, plan_microbatches, validate_lengths

UPDATE_BUDGET_KEY = "train.max_tokens_per_microbatch"


@dataclass(frozen=True)
class PromptSharing:
    """Which sequences share a prompt, for planning packs that write it once
    (`packrl.seqlen.packing.pack_shared`, ``train.share_prompts``).

    Attributes:
        prompt_tokens: P_i of each sequence, tokens.
        prompt_keys: per sequence, an id of its prompt ids (equal ids = the same prompt).
    """

    prompt_tokens: tuple[int, ...]
    prompt_keys: tuple[int, ...]

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]]) -> PromptSharing:
        """From each sequence's prompt ids."""
        keys: dict[tuple[int, ...], int] = {}
        return cls(tuple(len(p) for p in prompts), tuple(keys.setdefault(tuple(p), len(keys)) for p in prompts))

    def subset(self, indices: Sequence[int]) -> PromptSharing:
        return PromptSharing(tuple(self.prompt_tokens[i] for i in indices), tuple(self.prompt_keys[i] for i in indices))

    def items(self, lengths: Sequence[int], max_tokens: int, min_items: int = 1,
              caps: Sequence[GroupedCap] = ()) -> list[tuple[int, ...]]:
        """The planning units: runs of consecutive sequences with the same prompt, each cut so
        that its real tokens (the prompt once, then every response) stay within ``max_tokens``
        and its load within each of ``caps``; then, while there are fewer than ``min_items``
        (ranks), the largest multi-sequence unit is halved. A response of 0 tokens is a unit of
        its own (it is packed whole)."""
        out: list[list[int]] = []
        for i, n in enumerate(lengths):
            last = out[-1] if out else None
            shareable = last is not None and self.prompt_keys[last[0]] == self.prompt_keys[i] and n > self.prompt_tokens[i]
            # `last is not None` is implied by shareable; restated so the type checker narrows `last`
            if (shareable and last is not None and all(lengths[j] > self.prompt_tokens[j] for j in last)
                    and self.cost(last + [i], lengths) <= max_tokens and all(c.load(last + [i]) <= c.limit.cap for c in caps)):
                last.append(i)
            else:
                out.append([i])
        while len(out) < min_items and any(len(u) > 1 for u in out):
            k = max((k for k in range(len(out)) if len(out[k]) > 1), key=lambda k: self.cost(out[k], lengths))
            unit = out.pop(k)
            out[k:k] = [unit[: len(unit) // 2], unit[len(unit) // 2:]]
        return [tuple(u) for u in out]

    def cost(self, unit: Sequence[int], lengths: Sequence[int]) -> int:
        """Real tokens of ``unit`` packed with its prompt once."""
        if len(unit) == 1:
            return lengths[unit[0]]
        return self.prompt_tokens[unit[0]] + sum(lengths[i] - self.prompt_tokens[i] for i in unit)


def plan_ranks(lengths: Sequence[int], num_ranks: int, max_tokens: int, *, balance: bool, budget_key: str,
               packed: bool = True, sharing: PromptSharing | None = None, caps: Sequence[GroupedCap] = ()) -> RankPlan:
    """Micro-batches of at most ``max_tokens`` real tokens for each of ``num_ranks`` ranks.

    One rank plans with `plan_microbatches` (the fewest micro-batches); several with
    `balance_ranks` (Karmarkar-Karp over ranks, equal micro-batch counts). Indices are indices of
    ``lengths``; `RankPlan.restore` puts per-rank results back in that order. ``packed=False``
    gives every sequence a micro-batch of its own (a model whose packs are not exact). With
    ``sharing`` the units planned are `PromptSharing.items` (a group's sequences, its prompt
    counted once), kept whole and consecutive in their micro-batch. With ``caps`` every
    micro-batch also stays within each grouped cap (`GroupedCap`); under sharing a unit carries
    its sequences' load (`_over_units`). Whether a model may share prompts at all is decided
    where the plan is made (`PassPlanner.share_prompts`), not here.

    Raises:
        ValueError: as `plan_microbatches` / `balance_ranks` (a sequence over a cap is named).
    """
    if sharing is None or not packed:
        return _plan_units(lengths, num_ranks, max_tokens, balance=balance, budget_key=budget_key, packed=packed, caps=caps)
    validate_lengths(lengths, max_tokens, budget_key)  # a sequence over a cap is named by its own index
    for grouped in caps:
        grouped.check(len(lengths))
    items = sharing.items(lengths, max_tokens, min_items=num_ranks, caps=caps)
    local = _plan_units([sharing.cost(u, lengths) for u in items], num_ranks, max_tokens, balance=balance, budget_key=budget_key,
                        caps=[_over_units(c, items) for c in caps])
    return RankPlan(tuple(MicrobatchPlan(tuple(tuple(i for k in mb for i in items[k]) for mb in rank.microbatches), tuple(lengths),
                                         max_tokens) for rank in local.ranks), local.linear_coef)


def _over_units(cap: GroupedCap, units: Sequence[Sequence[int]]) -> GroupedCap:
    """``cap`` over planning units: a unit's load is its sequences' together. A unit whose
    sequences hold one key keeps it (a group cut into two units still counts its items once per
    micro-batch); a unit of several keys gets a key of its own, so a micro-batch's load is never
    counted below its real load (at most above it, when two such units share a key)."""
    keys = [cap.keys[u[0]] if len({cap.keys[i] for i in u}) == 1 else -1 - k for k, u in enumerate(units)]
    return GroupedCap(cap.limit, tuple(cap.load(u) for u in units), tuple(keys))


def _plan_units(lengths: Sequence[int], num_ranks: int, max_tokens: int, *, balance: bool, budget_key: str,
                packed: bool = True, caps: Sequence[GroupedCap] = ()) -> RankPlan:
    if num_ranks == 1:
        return RankPlan((plan_microbatches(lengths, max_tokens, balance=balance, budget_key=budget_key, packed=packed, caps=caps),))
    return balance_ranks(lengths, num_ranks, max_tokens, balance_microbatches=balance, budget_key=budget_key, packed=packed,
                         caps=caps)


@dataclass(frozen=True)
class MinibatchPlan:
    """One optimizer step's work.

    Attributes:
        sequences: the mini-batch's sequence indices (whole groups, ascending), the sequences
            its micro-batches leave out included (what a loss that chooses tokens over the
            mini-batch reads, `packrl.algos.policy_losses.prepare_update`).
        ranks: each rank's micro-batches, as indices of the step's batch: the sequences
            `trained_sequences` keeps.
        denominators: loss tokens and sequences of the whole mini-batch.
    """

    sequences: tuple[int, ...]
    ranks: RankPlan
    denominators: LossDenominators

    def left_out(self) -> tuple[int, ...]:
        """The mini-batch's sequences in no micro-batch of any rank (no loss token), ascending."""
        planned = {i for rank in self.ranks.ranks for mb in rank.microbatches for i in mb}
        return tuple(i for i in self.sequences if i not in planned)

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

    def left_out(self) -> tuple[int, ...]:
        """The sequences no micro-batch holds (`MinibatchPlan.left_out`), of every mini-batch, ascending."""
        return tuple(i for mb in self.minibatches for i in mb.left_out())


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
    sharing: PromptSharing | None = None,
    caps: Sequence[GroupedCap] = (),
    keep_masked: bool = False,
) -> UpdatePlan:
    """Plan a step's update: per mini-batch, the micro-batches of the sequences with a loss token
    (`trained_sequences`) on each rank, and the denominators of all its sequences.

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
        sharing: plan packs that write a group's prompt once (`plan_ranks`).
        caps: further budgets per micro-batch, each a load and sharing key per sequence (`GroupedCap`).
        keep_masked: plan every sequence, those without a loss token too (they add 0: the same
            loss and gradient at a higher cost; what the invariance tests compare with).

    Raises:
        ValueError: a sequence over ``max_tokens`` or a grouped cap (named by its index in the
            batch, whether or not it is trained), or a mini-batch with fewer sequences than ranks.
    """
    lengths, _ = validate_lengths(lengths, max_tokens, UPDATE_BUDGET_KEY)
    for grouped in caps:
        grouped.check(len(lengths))  # a sequence over a grouped cap is named by its index in the batch
    assert len(loss_tokens) == len(lengths) == len(groups), "one count and one group per sequence"
    assert list(groups) == sorted(groups), "the sequences of a group are contiguous"
    units = range(len(lengths)) if units is None else units
    firsts = [i for i in range(len(groups)) if i == 0 or groups[i] != groups[i - 1]] + [len(groups)]  # where each group starts
    minibatches = []
    for start in range(0, len(firsts) - 1, mini_batch_prompts):
        indices = tuple(range(firsts[start], firsts[min(start + mini_batch_prompts, len(firsts) - 1)]))
        planned = indices if keep_masked else trained_sequences(indices, loss_tokens, lengths, num_ranks)
        local = plan_ranks([lengths[i] for i in planned], num_ranks, max_tokens, balance=balance, budget_key=UPDATE_BUDGET_KEY,
                           packed=packed, sharing=None if sharing is None else sharing.subset(planned),
                           caps=[c.subset(planned) for c in caps])
        ranks = RankPlan(tuple(MicrobatchPlan(tuple(tuple(planned[j] for j in mb) for mb in rank.microbatches), tuple(lengths),
                                              max_tokens) for rank in local.ranks), local.linear_coef)
        per_unit: dict[int, int] = {}
        for i in indices:
            per_unit[units[i]] = per_unit.get(units[i], 0) + loss_tokens[i]
        denominators = LossDenominators(sum(per_unit.values()), sum(1 for c in per_unit.values() if c > 0), loss_scale_factor)
        minibatches.append(MinibatchPlan(indices, ranks, denominators))
    return UpdatePlan(tuple(minibatches), num_epochs)


def trained_sequences(indices: Sequence[int], loss_tokens: Sequence[int], lengths: Sequence[int], num_ranks: int) -> tuple[int, ...]:
    """The sequences of a mini-batch (``indices``) its micro-batches hold: those with a loss token.

    Every loss term (`packrl.algos.loss_agg.aggregate_loss`, the KL and entropy terms, the
    critic's value loss) and every update metric (`LossDenominators.token_share`, the per-response
    sums) reads loss tokens only, so a sequence without one adds exactly 0 (masked positions are
    never read, even NaN): leaving it out changes neither the loss nor the gradient. Where fewer
    than ``num_ranks`` remain, the shortest of the others (ties: the lower index) make up the
    count, so that every rank still holds a sequence (`balance_ranks` gives each one) and runs
    the same passes as the others; they too add 0. With fewer sequences than ranks in all, every
    one is kept (and `plan_ranks` refuses the mini-batch).

    ================  ===========  ==============  =====  =========
    indices           loss_tokens  lengths         ranks  result
    ================  ===========  ==============  =====  =========
    (0, 1, 2, 3)      3 0 5 0      9 4 9 6         1      (0, 2)
    (0, 1, 2, 3)      3 0 0 0      9 8 4 6         2      (0, 2)
    (0, 1, 2, 3)      0 0 0 0      9 8 4 6         1      (2,)
    ================  ===========  ==============  =====  =========

    Args:
        indices: the mini-batch's sequences (batch indices).
        loss_tokens / lengths: per sequence of the batch, loss tokens and prompt + response tokens.
        num_ranks: D data-parallel ranks.

    Returns:
        Batch indices, ascending.
    """
    with_loss = [i for i in indices if loss_tokens[i] > 0]
    spare = sorted((i for i in indices if loss_tokens[i] <= 0), key=lambda i: (lengths[i], i))
    return tuple(sorted(with_loss + spare[: max(0, num_ranks - len(with_loss))]))


def groups_of(num_sequences: int, group_size: int) -> list[int]:
    """The prompt of each of ``num_sequences`` whole responses, ``group_size`` per prompt."""
    assert num_sequences % group_size == 0, "whole groups"
    return [i // group_size for i in range(num_sequences)]


@dataclass(frozen=True)
class PassPlanner:
    """How the controller plans every pass of a step, in one value: the log-prob and value passes
    (`plan_ranks`) and the actor's and the critic's updates (`plan_update`). Built once from the
    run's `packrl.config.plan.BatchPlan` and what the workers found at set-up (whether packs are
    exact, whether prompts are shared); the worker group, the tests and the benchmarks plan with it.

    Attributes:
        num_ranks: data-parallel ranks (each takes a share of every batch).
        sequence_parallel_size: ranks that split one pack; every micro-batch budget below is per
            rank, so a pack holds this many times as many tokens.
        logprob_tokens: real tokens per no-grad micro-batch per rank (log-prob and value passes).
        update_tokens: real tokens per actor update micro-batch per rank.
        critic_tokens: real tokens per critic update micro-batch per rank.
        balance: balance micro-batches by cost (``train.balance_microbatches``).
        packed: a micro-batch may hold several sequences (False: one each, packs not exact).
        share_prompts: packs write a group's prompt once (`PromptSharing`).
        mini_batch_prompts / num_epochs / loss_scale_factor: as `plan_update` takes them.
        caps: the grouped caps per micro-batch per rank, every pass (`CapLimit`; the config's,
            `packrl.config.grouped_caps.grouped_cap_limits`); empty: the token budgets alone.
    """

    num_ranks: int
    sequence_parallel_size: int
    logprob_tokens: int
    update_tokens: int
    critic_tokens: int
    balance: bool
    packed: bool
    share_prompts: bool
    mini_batch_prompts: int
    num_epochs: int
    loss_scale_factor: int
    caps: tuple[CapLimit, ...] = ()

    LOGPROB_KEY = "train.max_tokens_per_logprob_microbatch"

    def sharing(self, prompts: Sequence[Sequence[int]]) -> PromptSharing | None:
        """Which sequences share a prompt (``prompts``: each sequence's prompt ids), when packs write it once."""
        return PromptSharing.of(prompts) if self.share_prompts else None

    def grouped_caps(self, loads: Mapping[str, Sequence[int]], keys: Sequence[int]) -> list[GroupedCap]:
        """This plan's caps over a batch: per cap, its sequences' ``loads[cap.name]`` and sharing
        ``keys`` (`GroupedCap`); a cap whose load the batch does not report is left out (a batch
        without those inputs), and a load without a cap is not budgeted."""
        return [c.over(loads[c.name], keys) for c in self.caps if c.name in loads]

    def scoring(self, lengths: Sequence[int], prompts: Sequence[Sequence[int]], caps: Sequence[GroupedCap] = ()) -> RankPlan:
        """The log-prob or value pass over sequences of ``lengths`` tokens: each rank's micro-batches
        (also within each of ``caps``, from `grouped_caps`).

        Raises:
            ValueError: a sequence over the log-prob budget or a grouped cap (named by index).
        """
        return plan_ranks(lengths, self.num_ranks, self.logprob_tokens * self.sequence_parallel_size, balance=self.balance,
                          budget_key=self.LOGPROB_KEY, packed=self.packed, sharing=self.sharing(prompts), caps=caps)

    def update(self, lengths: Sequence[int], loss_tokens: Sequence[int], prompts: Sequence[Sequence[int]], *, groups: Sequence[int],
               units: Sequence[int] | None = None, critic: bool = False, caps: Sequence[GroupedCap] = (),
               keep_masked: bool = False) -> UpdatePlan:
        """The actor's update (or with ``critic`` the critic's, whose value loss reads the same
        loss masks): `plan_update` under its budget, sequences without a loss token left out
        unless ``keep_masked``.

        Raises:
            ValueError: a sequence over the micro-batch budget (named by index).
        """
        tokens = self.critic_tokens if critic else self.update_tokens
        return plan_update(lengths, loss_tokens, groups=groups, mini_batch_prompts=self.mini_batch_prompts, num_epochs=self.num_epochs,
                           num_ranks=self.num_ranks, max_tokens=tokens * self.sequence_parallel_size, balance=self.balance,
                           loss_scale_factor=self.loss_scale_factor, packed=self.packed, units=units, sharing=self.sharing(prompts),
                           caps=caps, keep_masked=keep_masked)
