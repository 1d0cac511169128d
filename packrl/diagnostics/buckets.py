"""Length buckets: metrics split by response length or by token position in the response.

The buckets are 4 equal-width ranges of ``rollout.max_response_tokens`` = M, with integer edges
``k * M // 4``; the last includes the cap: M = 64 gives 0-16, 16-32, 32-48, 48-65. A value
lands in ``[lo, hi)``. Keys name the bounds: ``bucket/score/16-32``. Under a length curriculum
M is the largest stage (``rollout.max_response_tokens``), so the keys do not change between stages.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

NUM_BUCKETS = 4


def length_buckets(max_response_tokens: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the 4 buckets of the response budget (tokens), last ``hi`` = M + 1.

    | M  | buckets                           |
    |----|-----------------------------------|
    | 64 | 0-16, 16-32, 32-48, 48-65         |
    | 10 | 0-2, 2-5, 5-7, 7-11               |
    """
    edges = [k * max_response_tokens // NUM_BUCKETS for k in range(NUM_BUCKETS)] + [max_response_tokens + 1]
    return list(zip(edges[:-1], edges[1:]))


def bucket_of(value: int, buckets: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket holding ``value`` (values past the last bucket go to it)."""
    return min(bisect.bisect_right([lo for lo, _ in buckets], value) - 1, len(buckets) - 1)


def bucket_means(metric: str, values: Sequence[float | None], lengths: Sequence[int], max_response_tokens: int) -> dict[str, float]:
    """``bucket/<metric>/<lo>-<hi>``: the mean of ``values`` over the responses whose length
    (``lengths``, tokens) falls in each bucket. ``None`` values (a response with no loss tokens)
    are left out; buckets with no values do not appear."""
    buckets = length_buckets(max_response_tokens)
    groups: list[list[float]] = [[] for _ in buckets]
    for value, length in zip(values, lengths, strict=True):
        if value is not None:
            groups[bucket_of(length, buckets)].append(float(value))
    return {f"bucket/{metric}/{lo}-{hi}": sum(g) / len(g) for (lo, hi), g in zip(buckets, groups) if g}


def per_response_means(sums: torch.Tensor, counts: torch.Tensor) -> list[float | None]:
    """``sums / counts`` per response, None where ``counts`` is 0. Both Shape [N], float."""
    return [None if c == 0 else s / c for s, c in zip(sums.tolist(), counts.tolist())]
