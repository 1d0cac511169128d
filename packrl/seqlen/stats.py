"""Length statistics shared by the trainer's prompt accounting and `packrl audit`: nearest-rank
percentiles, so both report the same p99 for the same prompts."""

from __future__ import annotations

from collections.abc import Sequence

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


def length_percentiles(lengths: Sequence[int]) -> dict[str, int | None]:
    """Nearest-rank percentiles of ``lengths`` (tokens): ``{"p50", "p90", "p95", "p99", "max"}``.

    ``pQ`` is the ``ceil(Q/100 * n)``-th smallest length (1-based), i.e. the smallest length
    with at least Q% of the values at or under it; every result is one of the lengths. Values
    are None for an empty input.

    ================  =====  =====  =====
    lengths           p50    p90    p99
    ================  =====  =====  =====
    1, 2, ..., 10     5      9      10
    7                 7      7      7
    ================  =====  =====  =====
    """
    ordered = sorted(lengths)
    n = len(ordered)
    out: dict[str, int | None] = {f"p{q}": ordered[-(-q * n // 100) - 1] if n else None for q in PERCENTILES}
    out["max"] = ordered[-1] if n else None
    return out
