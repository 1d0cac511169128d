"""Token-budget micro-batching: a hard cap on real tokens per micro-batch, as few micro-batches
as the cap allows, optionally balanced by cost (`RankPlan.restore` puts results back in order).

Shapes: ``N`` sequences · ``L_i`` real tokens of sequence i · ``C`` the token cap · ``M`` micro-batches.

The count is searched upward from the lower bound ``max(ceil(sum L / C), #{L_i > C/2})`` and
never exceeds first-fit-decreasing's. Balancing minimises the largest micro-batch cost under the
cost model ``a*L + L^2`` (linear layers + attention; ``a = 6 * hidden_size`` makes the two
terms FLOP-proportional, the derivation behind verl's ``24576 = 6 * 4096``), so step time is not
set by one micro-batch full of long sequences.

Micro-batches may have further caps, each a `GroupedCap`: a load per sequence over items that
sequences share (a prompt's encoder inputs, counted once per micro-batch however many of its
responses the micro-batch holds), with a cap on each micro-batch's load. They are passed as a
list (``caps``), so a new cost is one more entry, not one more argument; every fit respects the
token cap and every grouped cap, and the exact search (token budget only) is then skipped. The
caps a run sets are listed where its plan is made (`packrl.config.grouped_caps.grouped_cap_limits`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import SupportsIndex, cast

DEFAULT_LINEAR_COEF = 6 * 576  # 6 * hidden_size of SmolLM2-135M; pass 6 * your model's hidden_size
_DFS_NODE_LIMIT = 20_000  # exact search fallback per candidate count; FFD is the final fallback
_DFS_MAX_ITEMS = 64  # larger batches skip the exact search (and its recursion depth)


def sequence_costs(lengths: Sequence[int], linear_coef: float = DEFAULT_LINEAR_COEF) -> list[float]:
    """Cost of each sequence under the model ``a*L + L^2`` (a = ``linear_coef``), in token^2 units."""
    return [linear_coef * n + n * n for n in lengths]


@dataclass(frozen=True)
class MicrobatchPlan:
    """Micro-batches as lists of input indices.

    Attributes:
        microbatches: M tuples of input indices; together a permutation of the planned indices.
            A micro-batch may be empty only when a fixed count larger than N was asked for.
        lengths: real tokens of every input sequence, indexed like the input.
        max_tokens: the hard cap C the plan respects.
    """

    microbatches: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    max_tokens: int

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def order(self) -> tuple[int, ...]:
        """Input indices in plan order (micro-batch after micro-batch)."""
        return tuple(i for mb in self.microbatches for i in mb)

    def num_tokens(self) -> list[int]:
        """Real tokens in each micro-batch."""
        return [sum(self.lengths[i] for i in mb) for mb in self.microbatches]

    def costs(self, linear_coef: float = DEFAULT_LINEAR_COEF) -> list[float]:
        return [sum(sequence_costs([self.lengths[i] for i in mb], linear_coef)) for mb in self.microbatches]


def as_count(value: object, what: str) -> int:
    """``value`` as a Python int (numpy and 0-d torch integers included), or ValueError naming ``what``."""
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} must be an integer, not a bool")
    try:
        # operator.index itself raises TypeError for anything without __index__, handled below.
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise ValueError(f"{what}={value!r} must be an integer") from None


def validate_lengths(lengths: Sequence[int], max_tokens: int, budget_key: str) -> tuple[list[int], int]:
    """``(lengths, max_tokens)`` as Python ints, or ValueError for an empty batch, a non-positive
    or non-integer length or cap, or a sequence over the cap (named by index and length)."""
    cap = as_count(max_tokens, budget_key)
    if cap < 1:
        raise ValueError(f"{budget_key}={max_tokens!r} must be a positive integer number of tokens")
    if len(lengths) == 0:
        raise ValueError("cannot plan micro-batches for an empty batch (0 sequences)")
    out = []
    for i, n in enumerate(lengths):
        try:
            length = as_count(n, f"length of sequence {i}")
        except ValueError:
            length = 0
        if length < 1:
            raise ValueError(f"sequence {i} has length {n!r}; lengths must be positive integers (tokens)")
        out.append(length)
    over = [(i, n) for i, n in enumerate(out) if n > cap]
    if over:
        i, n = max(over, key=lambda x: x[1])
        raise ValueError(
            f"sequence {i} has {n:,} tokens > {budget_key}={cap:,} ({len(over)} sequence(s) over budget); "
            f"raise {budget_key} to >= {n:,} or lower data.max_prompt_tokens / rollout.max_response_tokens"
        )
    return out, cap


@dataclass(frozen=True)
class CapLimit:
    """A grouped cap's limit and how messages name it, without the loads of a batch.

    Attributes:
        name: the load's name: the key a prompt's extra inputs report it under
            (`packrl.types.ExtraInputs.grouped_loads`) and of the ``seqlen/microbatch_<name>_max`` metric.
        cap: the most load one micro-batch may hold (per rank).
        budget_key: the config key that sets ``cap`` (named in errors).
        unit: what the load counts, for messages (e.g. ``encoder patches``).
        fix: besides raising ``budget_key``, how to lower one sequence's load (for messages; "" for none).
    """

    name: str
    cap: int
    budget_key: str
    unit: str
    fix: str = ""

    def over(self, loads: Sequence[int], keys: Sequence[int]) -> GroupedCap:
        """This limit over a batch: ``loads`` and sharing ``keys`` per sequence (`GroupedCap`)."""
        return GroupedCap(self, tuple(loads), tuple(keys))


@dataclass(frozen=True)
class GroupedCap:
    """A second budget of a micro-batch, over items its sequences may share.

    A micro-batch's load is the sum over its distinct keys: sequences with the same key hold the
    same items (a prompt group's responses share their prompt's encoder inputs, which a packed
    forward encodes once per micro-batch), so a key's load counts once however many of its
    sequences the micro-batch holds. The load must stay within ``limit.cap``.

    Attributes:
        limit: the cap and its names (`CapLimit`).
        loads: per sequence, the load of its items (0 for none).
        keys: per sequence, which items it holds (equal keys = the same items, equal loads).
    """

    limit: CapLimit
    loads: tuple[int, ...]
    keys: tuple[int, ...]

    def subset(self, indices: Sequence[int]) -> GroupedCap:
        return GroupedCap(self.limit, tuple(self.loads[i] for i in indices), tuple(self.keys[i] for i in indices))

    def load(self, items: Iterable[int]) -> int:
        """The load of ``items`` together: each distinct key's once."""
        return sum({self.keys[i]: self.loads[i] for i in items}.values())

    def check(self, num_sequences: int) -> None:
        """Raise ValueError for a cap < 1 or a sequence whose load alone exceeds it (named by index).

        Raises:
            ValueError: as above; the message names ``limit.budget_key``, the load and the fix.
        """
        assert len(self.loads) == len(self.keys) == num_sequences, "one load and one key per sequence"
        key, cap = self.limit.budget_key, self.limit.cap
        if as_count(cap, key) < 1:
            raise ValueError(f"{key}={cap!r} must be a positive integer number of {self.limit.unit}")
        over = [(n, i) for i, n in enumerate(self.loads) if n > cap]
        if over:
            n, i = max(over)
            fix = f" or {self.limit.fix}" if self.limit.fix else ""
            raise ValueError(f"sequence {i} has {n:,} {self.limit.unit} > {key}={cap:,}; raise {key} to >= {n:,}{fix}")


class _Bins:
    """Micro-batches being filled: their items and real tokens, checked against every grouped cap."""

    def __init__(self, lengths: Sequence[int], cap: int, caps: Sequence[GroupedCap], num_bins: int = 0) -> None:
        self.lengths, self.cap, self.caps = lengths, cap, caps
        self.items: list[list[int]] = [[] for _ in range(num_bins)]
        self.loads = [0] * num_bins

    def fits(self, b: int, i: int) -> bool:
        return self.fits_exchange(b, i, None)

    def fits_exchange(self, b: int, i: int, out: int | None) -> bool:
        """Whether bin ``b`` stays within every cap with ``i`` added (and ``out`` taken away)."""
        tokens = self.loads[b] + self.lengths[i] - (0 if out is None else self.lengths[out])
        if tokens > self.cap:
            return False
        if not self.caps:
            return True
        items = [j for j in self.items[b] if j != out] + [i]
        return all(c.load(items) <= c.limit.cap for c in self.caps)

    @classmethod
    def of(cls, items: list[list[int]], lengths: Sequence[int], cap: int, caps: Sequence[GroupedCap]) -> _Bins:
        """Bins over ``items`` itself (changed in place by `add` / `remove`)."""
        bins = cls(lengths, cap, caps)
        bins.items, bins.loads = items, [sum(lengths[i] for i in part) for part in items]
        return bins

    def open(self) -> int:
        self.items.append([])
        self.loads.append(0)
        return len(self.items) - 1

    def add(self, b: int, i: int) -> None:
        self.items[b].append(i)
        self.loads[b] += self.lengths[i]

    def remove(self, b: int, i: int) -> None:
        self.items[b].remove(i)
        self.loads[b] -= self.lengths[i]


def _first_fit(order: list[int], lengths: Sequence[int], cap: int, max_bins: int | None,
               caps: Sequence[GroupedCap] = ()) -> list[list[int]] | None:
    bins = _Bins(lengths, cap, caps)
    for i in order:
        b = next((b for b in range(len(bins.items)) if bins.fits(b, i)), None)
        if b is None:
            if max_bins is not None and len(bins.items) == max_bins:
                return None
            b = bins.open()
        bins.add(b, i)
    return bins.items


def _least_cost_fit(order: list[int], lengths: Sequence[int], costs: Sequence[float], cap: int, k: int,
                    caps: Sequence[GroupedCap] = ()) -> list[list[int]] | None:
    """LPT under the caps: each item, largest cost first, goes to the cheapest bin it fits in."""
    bins = _Bins(lengths, cap, caps, k)
    bin_costs = [0.0] * k
    for i in order:
        fits = [b for b in range(k) if bins.fits(b, i)]
        if not fits:
            return None
        b = min(fits, key=lambda b: (bin_costs[b], bins.loads[b]))
        bins.add(b, i)
        bin_costs[b] += costs[i]
    return bins.items


def _exact_fit(order: list[int], lengths: Sequence[int], cap: int, k: int) -> list[list[int]] | None:
    """Depth-first search for any packing into k bins, bounded by `_DFS_NODE_LIMIT` nodes and
    used only for batches of at most `_DFS_MAX_ITEMS` sequences."""
    if len(order) > _DFS_MAX_ITEMS:
        return None
    loads = [0] * k
    assign = [0] * len(order)
    nodes = 0

    def place(pos: int) -> bool:
        nonlocal nodes
        if pos == len(order):
            return True
        n = lengths[order[pos]]
        tried: set[int] = set()
        for b in range(k):
            if loads[b] + n > cap or loads[b] in tried:
                continue
            tried.add(loads[b])  # bins with equal load are interchangeable
            nodes += 1
            if nodes > _DFS_NODE_LIMIT:
                return False
            loads[b] += n
            assign[pos] = b
            if place(pos + 1):
                return True
            loads[b] -= n
        return False

    if not place(0):
        return None
    bins: list[list[int]] = [[] for _ in range(k)]
    for pos, b in enumerate(assign):
        bins[b].append(order[pos])
    return bins


def _improve(items: list[list[int]], lengths: Sequence[int], costs: Sequence[float], cap: int, max_rounds: int = 200,
             caps: Sequence[GroupedCap] = ()) -> None:
    """Local search in place: move or swap items out of the costliest bin while that lowers its cost
    below the old maximum and keeps every bin within the caps."""
    bins = _Bins.of(items, lengths, cap, caps)
    bcost = [sum(costs[i] for i in b) for b in items]
    for _ in range(max_rounds):
        top = max(range(len(items)), key=bcost.__getitem__)
        peak = bcost[top]
        # (new peak, (other bin, item leaving top, item leaving other bin or None for a plain move))
        best: tuple[float, tuple[int, int, int | None]] | None = None
        for o in range(len(items)):
            if o == top:
                continue
            for x in items[top]:
                new = max(peak - costs[x], bcost[o] + costs[x])
                if new < peak and (best is None or new < best[0]) and bins.fits(o, x):
                    best = (new, (o, x, None))
                for y in items[o]:
                    dc = costs[x] - costs[y]
                    if dc <= 0:
                        continue
                    new = max(peak - dc, bcost[o] + dc)
                    if (new < peak and (best is None or new < best[0]) and bins.fits_exchange(o, x, y)
                            and bins.fits_exchange(top, y, x)):
                        best = (new, (o, x, y))
        if best is None:
            return
        other, moved, swapped = best[1]
        for item, src, dst in ((moved, top, other), (swapped, other, top)):
            if item is None:
                continue
            bins.remove(src, item)
            bins.add(dst, item)
            bcost[src] -= costs[item]
            bcost[dst] += costs[item]


def _fit_k(order: list[int], lengths: Sequence[int], costs: Sequence[float], cap: int, k: int, balance: bool,
           caps: Sequence[GroupedCap] = ()) -> list[list[int]] | None:
    bins = _least_cost_fit(order, lengths, costs, cap, k, caps) if balance else None
    if bins is None:
        bins = _first_fit(order, lengths, cap, max_bins=k, caps=caps)
    if bins is None and not caps:  # the exact search knows one budget
        bins = _exact_fit(order, lengths, cap, k)
    if bins is None:
        return None
    bins += [[] for _ in range(k - len(bins))]
    if balance:
        _improve(bins, lengths, costs, cap, caps=caps)
    return bins


def plan_microbatches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    balance: bool = True,
    linear_coef: float = DEFAULT_LINEAR_COEF,
    num_microbatches: int | None = None,
    budget_key: str = "train.max_tokens_per_microbatch",
    packed: bool = True,
    caps: Sequence[GroupedCap] = (),
) -> MicrobatchPlan:
    """Split sequences into micro-batches of at most ``max_tokens`` real tokens each (and, for
    each of ``caps``, at most its cap of that load each).

    Args:
        lengths: real tokens of each sequence (prompt + response), N >= 1 positive ints.
        max_tokens: the hard cap C in tokens.
        balance: minimise the largest micro-batch cost ``a*L + L^2`` for the chosen count.
        linear_coef: ``a`` of the cost model, ``6 * hidden_size`` for a transformer.
        num_microbatches: plan exactly this many (data-parallel ranks must match); it must be
            >= the fewest feasible. Micro-batches beyond N are empty.
        budget_key: the config key named in errors.
        packed: False puts every sequence in a micro-batch of its own (models whose packs are
            not exact, `packrl.models.isolation`); the cap still applies to each.
        caps: further budgets, each a load and a sharing key per sequence and a cap per
            micro-batch (`GroupedCap`); empty = the token budget alone.

    Returns:
        A `MicrobatchPlan` with the fewest micro-batches found (never more than
        first-fit-decreasing needs), largest first.

    Raises:
        ValueError: an empty batch, a non-positive length, a cap < 1, a sequence longer than
            the token cap or whose load exceeds a grouped cap (naming its index, its size and
            the budget's key), or an infeasible ``num_microbatches``.
    """
    lengths, max_tokens = validate_lengths(lengths, max_tokens, budget_key)
    for grouped in caps:
        grouped.check(len(lengths))
    costs = sequence_costs(lengths, linear_coef)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not packed:
        count = len(lengths) if num_microbatches is None else num_microbatches
        if count < len(lengths):
            raise ValueError(f"cannot split {len(lengths)} sequences into {count} micro-batches of one sequence each "
                             "(packing is off for this model)")
        singles = tuple((i,) for i in order) + ((),) * (count - len(lengths))
        return MicrobatchPlan(singles, tuple(lengths), max_tokens)
    ffd = _first_fit(order, lengths, max_tokens, max_bins=None, caps=caps)
    assert ffd is not None
    if num_microbatches is not None:
        bins = _fit_k(order, lengths, costs, max_tokens, num_microbatches, balance, caps) if num_microbatches >= 1 else None
        if bins is None:
            others = "".join(f" and <= {c.limit.cap:,} {c.limit.unit} ({c.limit.budget_key})" for c in caps)
            raise ValueError(
                f"cannot split {len(lengths)} sequences ({sum(lengths):,} tokens) into {num_microbatches} micro-batches "
                f"of <= {max_tokens:,} tokens ({budget_key}){others}; at least {len(ffd)} may be needed"
            )
    else:
        lower = max(math.ceil(sum(lengths) / max_tokens), sum(1 for n in lengths if 2 * n > max_tokens),
                    *(math.ceil(c.load(range(len(lengths))) / c.limit.cap) for c in caps))
        bins = None
        for k in range(lower, len(ffd)):
            bins = _fit_k(order, lengths, costs, max_tokens, k, balance, caps)
            if bins is not None:
                break
        if bins is None:
            bins = ffd
            if balance:
                _improve(bins, lengths, costs, max_tokens, caps=caps)
    bins.sort(key=lambda b: -sum(lengths[i] for i in b))  # largest first: an OOM shows at once
    return MicrobatchPlan(tuple(tuple(sorted(b)) for b in bins), tuple(lengths), max_tokens)
