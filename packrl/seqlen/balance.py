"""Data-parallel balancing: split a batch over D ranks so the costliest rank is as cheap as
possible, with the same number of micro-batches on every rank, and restore order afterwards.

Shapes: ``N`` sequences · ``D`` ranks · ``M`` micro-batches per rank.

Partitioning is the multi-way Karmarkar-Karp largest differencing method (Karmarkar & Karp
1982; Korf 2009 for the k-way form) on costs ``a*L + L^2``, followed by a local search that
exchanges up to two items each way between the costliest rank and another. Ranks then plan
their micro-batches under the token cap; every rank gets the largest rank's count, so
collectives stay in step (a rank that runs out of sequences gets empty micro-batches, which
the trainer runs as zero-loss steps).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from packrl.seqlen.microbatch import (
    DEFAULT_LINEAR_COEF,
    GroupedCap,
    MicrobatchPlan,
    as_count,
    plan_microbatches,
    sequence_costs,
    validate_lengths,
)

T = TypeVar("T")

_PAIR_CANDIDATES = 24  # distinct costs per part that `refine_partition` pairs up (276 pairs)


def karmarkar_karp(costs: Sequence[float], num_parts: int) -> list[list[int]]:
    """Partition item indices into ``num_parts`` sets with near-equal cost sums.

    Each item starts as a k-tuple of subsets (itself and k-1 empty ones). Repeatedly the two
    tuples with the largest spread (max - min) are merged, pairing the heaviest subset of one
    with the lightest of the other. O(N k log k + N log N).

    Args:
        costs: N non-negative costs.
        num_parts: k >= 1.

    Returns:
        k lists of indices (some empty when N < k), heaviest first.

    Raises:
        ValueError: ``num_parts`` < 1 or an empty ``costs``.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    if len(costs) == 0:
        raise ValueError("cannot partition an empty batch (0 sequences)")
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(costs):
        sums = [float(c)] + [0.0] * (num_parts - 1)
        heap.append((-float(c), i, sums, [[i]] + [[] for _ in range(num_parts - 1)]))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie, sa, pa = heapq.heappop(heap)
        _, _, sb, pb = heapq.heappop(heap)
        # sa and sb are sorted heaviest first: pair a's heaviest with b's lightest.
        merged = sorted(
            ((sa[j] + sb[num_parts - 1 - j], j) for j in range(num_parts)), reverse=True
        )
        sums, parts = [], []
        for total, j in merged:
            part = pa[j]
            part.extend(pb[num_parts - 1 - j])
            sums.append(total)
            parts.append(part)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), tie, sums, parts))
    return heap[0][3]


def refine_partition(parts: list[list[int]], costs: Sequence[float], max_rounds: int = 64) -> list[list[int]]:
    """Lower the heaviest part in place by exchanging up to two items each way with another part.

    Each round takes the heaviest part and tries the others, lightest first, for the exchange of
    zero, one or two items each way whose net cost lands closest to half the gap between the
    two, strictly inside it, so the heaviest part drops and the other stays below the old
    maximum. Single items come from every distinct cost of a part, pairs from
    `_PAIR_CANDIDATES` distinct costs spread over its range. Stops when no exchange helps or
    after ``max_rounds`` exchanges. Returns ``parts``.
    """
    loads = [sum(costs[i] for i in p) for p in parts]
    cache: dict[int, tuple[list[float], list[tuple[int, ...]]]] = {}

    def groups(p: int) -> tuple[list[float], list[tuple[int, ...]]]:
        if p not in cache:
            cache[p] = _exchange_groups(parts[p], costs)
        return cache[p]

    for _ in range(max_rounds):
        hi = max(range(len(parts)), key=loads.__getitem__)
        for lo in sorted(range(len(parts)), key=loads.__getitem__):
            gap = loads[hi] - loads[lo]
            if gap <= 0:
                return parts
            exchange = _best_exchange(groups(hi), groups(lo), gap)
            if exchange is not None:
                break
        else:
            return parts
        out_items, in_items = exchange
        for i in out_items:
            parts[hi].remove(i)
            parts[lo].append(i)
        for j in in_items:
            parts[lo].remove(j)
            parts[hi].append(j)
        moved = sum(costs[i] for i in out_items) - sum(costs[j] for j in in_items)
        loads[hi] -= moved
        loads[lo] += moved
        cache.pop(hi)
        cache.pop(lo)
    return parts


def _exchange_groups(part: list[int], costs: Sequence[float]) -> tuple[list[float], list[tuple[int, ...]]]:
    """Groups of zero, one or two items of ``part`` that an exchange may move: (sorted sums, items)."""
    by_cost = {costs[i]: i for i in part}  # items of equal cost are interchangeable
    distinct = [by_cost[c] for c in sorted(by_cost)]
    count = min(_PAIR_CANDIDATES, len(distinct))
    picks = [distinct[round(k * (len(distinct) - 1) / max(1, count - 1))] for k in range(count)]
    groups: list[tuple[float, tuple[int, ...]]] = [(0.0, ())] + [(costs[i], (i,)) for i in distinct]
    groups += [(costs[i] + costs[j], (i, j)) for a, i in enumerate(picks) for j in picks[a + 1 :]]
    groups.sort()
    return [g[0] for g in groups], [g[1] for g in groups]


def _best_exchange(
    out: tuple[list[float], list[tuple[int, ...]]], into: tuple[list[float], list[tuple[int, ...]]], gap: float
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The pair of groups (leaving the heavy part, leaving the light part) whose net cost is in
    (0, ``gap``) and nearest ``gap / 2``; None if there is none."""
    in_sums, in_items = into
    best_err, best = gap / 2, None
    for out_sum, out_items in zip(*out):
        target = out_sum - gap / 2
        pos = bisect.bisect_left(in_sums, target)
        for k in (pos - 1, pos):
            if 0 <= k < len(in_sums) and abs(in_sums[k] - target) < best_err:
                best_err, best = abs(in_sums[k] - target), (out_items, in_items[k])
        if best_err < 1e-9 * gap:
            break
    return best


@dataclass(frozen=True)
class RankPlan:
    """Per-rank micro-batch plans over one batch. Indices are global input indices.

    Attributes:
        ranks: D plans, all with the same ``num_microbatches``.
        linear_coef: ``a`` of the cost model used.
    """

    ranks: tuple[MicrobatchPlan, ...]
    linear_coef: float = DEFAULT_LINEAR_COEF

    @property
    def num_microbatches(self) -> int:
        return self.ranks[0].num_microbatches

    def rank_indices(self) -> list[list[int]]:
        return [list(p.order) for p in self.ranks]

    def rank_costs(self) -> list[float]:
        return [sum(p.costs(self.linear_coef)) for p in self.ranks]

    def imbalance(self) -> float:
        """Largest rank cost over the mean rank cost (1.0 = perfect; ``seqlen/rank_imbalance``)."""
        costs = self.rank_costs()
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def restore(self, per_rank_values: Sequence[Sequence[T]]) -> list[T]:
        """Per-rank values (each in that rank's plan order) back to input order.

        Raises:
            ValueError: the number of ranks or of values on a rank does not match the plan.
        """
        if len(per_rank_values) != len(self.ranks):
            raise ValueError(f"got values from {len(per_rank_values)} ranks, the plan has {len(self.ranks)}")
        out: dict[int, T] = {}
        for plan, values in zip(self.ranks, per_rank_values):
            if len(values) != len(plan.order):
                raise ValueError(f"a rank planned for {len(plan.order)} sequences returned {len(values)} values")
            out.update(zip(plan.order, values))
        return [out[i] for i in range(len(out))]


def balance_ranks(
    lengths: Sequence[int],
    num_ranks: int,
    max_tokens: int,
    *,
    linear_coef: float = DEFAULT_LINEAR_COEF,
    balance_microbatches: bool = True,
    budget_key: str = "train.max_tokens_per_microbatch",
    packed: bool = True,
    caps: Sequence[GroupedCap] = (),
) -> RankPlan:
    """Assign sequences to ``num_ranks`` data-parallel ranks and plan each rank's micro-batches.

    Args:
        lengths: real tokens per sequence, N >= ``num_ranks``.
        num_ranks: D >= 1.
        max_tokens: per-micro-batch token cap on every rank.
        linear_coef: ``a`` of the cost model ``a*L + L^2``.
        balance_microbatches: also balance micro-batches within each rank by cost.
        budget_key: the config key named in errors.
        packed: False gives every sequence a micro-batch of its own (`plan_microbatches`).
        caps: further budgets per micro-batch, each a load per sequence over shared items (`GroupedCap`).

    Returns:
        A `RankPlan`; every rank has the same number of micro-batches.

    Raises:
        ValueError: ``num_ranks`` < 1, fewer sequences than ranks, or any error of
            `plan_microbatches` (a sequence over the cap names its global index).
    """
    num_ranks = as_count(num_ranks, "num_ranks")
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks!r} must be a positive integer")
    lengths, max_tokens = validate_lengths(lengths, max_tokens, budget_key)
    if len(lengths) < num_ranks:
        raise ValueError(f"{len(lengths)} sequences cannot be spread over {num_ranks} ranks; give every rank at least one")
    for grouped in caps:
        grouped.check(len(lengths))  # a sequence over a grouped cap is named by its global index
    costs = sequence_costs(lengths, linear_coef)
    parts = refine_partition(karmarkar_karp(costs, num_ranks), costs)
    for empty in (p for p in parts if not p):  # rare: give an idle rank the cheapest spare item
        donor = max(parts, key=len)
        cheapest = min(donor, key=costs.__getitem__)
        donor.remove(cheapest)
        empty.append(cheapest)
    own = [plan_microbatches([lengths[i] for i in p], max_tokens, balance=False, budget_key=budget_key, packed=packed,
                             caps=[c.subset(p) for c in caps]) for p in parts]
    count = max(p.num_microbatches for p in own)
    plans = []
    for part, fewest in zip(parts, own):
        try:
            local = plan_microbatches(
                [lengths[i] for i in part], max_tokens, balance=balance_microbatches, linear_coef=linear_coef,
                num_microbatches=count, budget_key=budget_key, packed=packed, caps=[c.subset(part) for c in caps],
            )
        except ValueError:  # no balanced fit into `count`: the rank's own plan, topped up with empty micro-batches
            local = MicrobatchPlan(fewest.microbatches + ((),) * (count - fewest.num_microbatches), fewest.lengths, max_tokens)
        mbs = tuple(tuple(sorted(part[j] for j in mb)) for mb in local.microbatches)
        plans.append(MicrobatchPlan(mbs, tuple(lengths), max_tokens))
    return RankPlan(tuple(plans), linear_coef)
