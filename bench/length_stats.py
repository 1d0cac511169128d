"""Paired statistics of the length-control benchmark: two arms answered the same held-out rows, so
every comparison is per row.

A row is ``{"row", "count", "correct_strict", "correct_lenient", "tokens"}`` (``tokens``: the
tokens the policy generated). `compare` gives, for arm A against base B:

- accuracy: the paired difference ``acc(A) - acc(B)`` (points), McNemar's exact test on the
  discordant rows (two-sided binomial test of b against b + c at 1/2; McNemar 1947, the exact form
  as in statsmodels' ``mcnemar(exact=True)``), and percentile intervals from a paired bootstrap of
  the rows: the two-sided 95% interval and the lower end of the one-sided 95% interval (the 5th
  percentile), which decides non-inferiority at a margin (A is non-inferior when it lies above
  ``-margin``);
- length: the ratio of mean generated tokens ``mean(A) / mean(B)`` with its paired-bootstrap 95%
  interval, and the ratio of the 95th percentiles (a point estimate).

Sample size: a non-inferiority test of a paired proportion at one-sided alpha 0.05 and 80% power
needs about ``n = (z_a + z_b)^2 * pi_d / delta^2 = 6.18 * pi_d / delta^2`` rows (pi_d: the share of
discordant rows, delta: the margin); at pi_d = 10-20% a 5-point margin needs 247-495 rows and a
2-point margin 1,546-3,093 (`rows_needed`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
Z_ONE_SIDED_95, Z_POWER_80 = 1.6449, 0.8416


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: ``min(1, 2 * P[X <= min(b, c)])``, ``X ~ Bin(b + c, 1/2)``;
    1.0 when no row is discordant. ``b``, ``c``: rows right only under one arm, only under the other."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def rows_needed(discordant_share: float, margin: float) -> int:
    """Paired rows a non-inferiority test of accuracy needs at one-sided alpha 0.05 and 80% power
    (module docstring); ``margin`` and ``discordant_share`` as fractions."""
    return math.ceil((Z_ONE_SIDED_95 + Z_POWER_80) ** 2 * discordant_share / margin**2)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear interpolation (numpy's default); nan
    for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One arm's held-out figures: accuracy under each reading, generated tokens (mean, p50, p95;
    of every answer and of the strictly correct ones), the accuracy by answer count, and the
    accuracy of the best constant guess of the count over these rows (the guess floor of the
    lenient reading; a guess has no worked lines, so the strict reading's floor is 0)."""
    n = len(rows)
    tokens = [r["tokens"] for r in rows]
    right = [r["tokens"] for r in rows if r["correct_strict"]]
    counts = sorted({r["count"] for r in rows})
    by_count = {str(c): {"rows": sum(r["count"] == c for r in rows),
                         "accuracy_strict": _share([r["correct_strict"] for r in rows if r["count"] == c]),
                         "accuracy_lenient": _share([r["correct_lenient"] for r in rows if r["count"] == c])} for c in counts}
    floor = max((sum(r["count"] == c for r in rows) for c in counts), default=0) / max(1, n)
    out = {"num_rows": n, "accuracy_strict": _share([r["correct_strict"] for r in rows]),
           "accuracy_lenient": _share([r["correct_lenient"] for r in rows]), "guess_floor_lenient": floor,
           "guess_floor_strict": 0.0, "tokens_mean": _mean(tokens), "tokens_p50": percentile(tokens, 50),
           "tokens_p95": percentile(tokens, 95), "correct_tokens_mean": _mean(right), "correct_tokens_p95": percentile(right, 95),
           "truncated": sum(bool(r.get("truncated")) for r in rows), "by_count": by_count}
    if all("redundant_lines" in r for r in rows):  # reports before the field have none
        out["redundant_lines_mean"] = _mean([r["redundant_lines"] for r in rows])
        out["with_redundant_lines"] = _share([r["redundant_lines"] > 0 for r in rows])
    return out


def compare(arm: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], *, margin: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Arm against base on the same rows (module docstring); accuracies read strictly, with the
    lenient reading's difference beside it.

    Raises:
        ValueError: the two arms did not answer the same rows.
    """
    order = [r["row"] for r in base]
    by_row = {r["row"]: r for r in arm}
    if sorted(order) != sorted(by_row):
        raise ValueError(f"the arms answered different rows ({len(by_row)} against {len(order)}); compare needs the same rows")
    a = [by_row[k] for k in order]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(order), size=(BOOTSTRAP_RESAMPLES, len(order)))
    out: dict[str, Any] = {"num_rows": len(order), "margin_points": 100 * margin}
    for reading in ("strict", "lenient"):
        x = np.array([r[f"correct_{reading}"] for r in a], dtype=float)
        y = np.array([r[f"correct_{reading}"] for r in base], dtype=float)
        b, c = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
        diffs = (x - y)[picks].mean(axis=1)
        low95, high95 = np.percentile(diffs, [2.5, 97.5])
        lower_one_sided = float(np.percentile(diffs, 5))
        out[f"accuracy_{reading}"] = {
            "difference_points": round(100 * float((x - y).mean()), 2), "ci95_points": [round(100 * low95, 2), round(100 * high95, 2)],
            "lower_one_sided_95_points": round(100 * lower_one_sided, 2), "non_inferior": bool(lower_one_sided > -margin),
            "only_arm_right": b, "only_base_right": c, "mcnemar_p": mcnemar_exact(b, c)}
    ta = np.array([r["tokens"] for r in a], dtype=float)
    tb = np.array([r["tokens"] for r in base], dtype=float)
    ratios = ta[picks].mean(axis=1) / np.maximum(tb[picks].mean(axis=1), 1e-9)
    low, high = np.percentile(ratios, [2.5, 97.5])
    out["tokens_mean_ratio"] = round(float(ta.mean() / max(tb.mean(), 1e-9)), 4)
    out["tokens_mean_ratio_ci95"] = [round(float(low), 4), round(float(high), 4)]
    out["tokens_mean_cut"] = round(1 - out["tokens_mean_ratio"], 4)
    out["tokens_p95_ratio"] = round(percentile(ta, 95) / max(percentile(tb, 95), 1e-9), 4)
    out["tokens_p95_cut"] = round(1 - out["tokens_p95_ratio"], 4)
    return out


def _share(flags: Sequence[bool]) -> float:
    return sum(map(bool, flags)) / len(flags) if flags else float("nan")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
