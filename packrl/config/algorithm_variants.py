"""Config of rollout correction (``algorithm.rollout_correction``) and the nested-section checks
of ``algorithm``. (A policy loss's own knobs are checked against the
options it registered with, `packrl.config.load.build_options`.)

Every check returns `packrl.errors.ConfigProblem`s naming the key, the value, the limit and the
fix. A key that would have no effect in the chosen mode is refused rather than ignored. The
module imports no torch: ``packrl config`` stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from packrl.errors import ConfigProblem

RolloutIsLevel = Literal["token"]
RolloutRsLevel = Literal["geometric"]

@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Correction for the gap between the engine that sampled and the policy being trained
    (`packrl.algos.rollout_correction`; names as verl's ``algorithm.rollout_correction``). Both
    parts need the engine's log-probs, which the engine then returns whatever
    ``rollout.return_logprobs`` says, and the old-log-prob pass."""

    rollout_is: RolloutIsLevel | None = None
    """Truncated importance sampling (TIS): `token` multiplies every token's policy loss by
    w_t = min(exp(old_logprob_t - rollout_logprob_t), `rollout_is_threshold`); null = off."""

    rollout_is_threshold: float = 2.0
    """Upper bound C of the token weight (verl's default 2.0; > 1)."""

    rollout_rs: RolloutRsLevel | None = None
    """Rejection sampling: `geometric` rejects a response whose geometric-mean token ratio
    exp(mean_t(old_logprob_t - rollout_logprob_t)) lies outside [`rollout_rs_threshold_lower`,
    `rollout_rs_threshold`]; its tokens leave the loss and the denominators. null = off. (verl's
    `sequence` level, a product of ratios, is not offered: it rejects long responses more often
    for the same per-token mismatch.)"""

    rollout_rs_threshold: float | None = None
    """Upper bound of the geometric-mean ratio (> 1; typical 1.0002-1.001). Required with
    `rollout_rs`."""

    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the geometric-mean ratio (in (0, 1)); null = 1 / `rollout_rs_threshold`."""

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """``(lower, upper)`` of the rejection statistic (call only with `rollout_rs` set)."""
        assert self.rollout_rs_threshold is not None, "rollout_rs needs rollout_rs_threshold (checked at load)"
        upper = self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return lower, upper

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        if not 1.0 < self.rollout_is_threshold < math.inf:
            out.append(ConfigProblem(f"{prefix}.rollout_is_threshold", self.rollout_is_threshold, "must be a finite number > 1",
                                     f"set {prefix}.rollout_is_threshold=2.0"))
        upper, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if self.rollout_rs is None:
            for key, value in (("rollout_rs_threshold", upper), ("rollout_rs_threshold_lower", lower)):
                if value is not None:
                    out.append(_no_effect(f"{prefix}.{key}", value, f"{prefix}.rollout_rs is null",
                                          f"set {prefix}.rollout_rs=geometric or remove {prefix}.{key}"))
            return out
        if upper is None:
            out.append(ConfigProblem(f"{prefix}.rollout_rs", self.rollout_rs, f"needs {prefix}.rollout_rs_threshold (the upper bound)",
                                     f"set {prefix}.rollout_rs_threshold=1.001",
                                     keys=(f"{prefix}.rollout_rs", f"{prefix}.rollout_rs_threshold")))
        elif not 1.0 < upper < math.inf:
            out.append(ConfigProblem(f"{prefix}.rollout_rs_threshold", upper, "must be a finite number > 1 (a geometric-mean ratio)",
                                     f"set {prefix}.rollout_rs_threshold=1.001"))
        if lower is not None and not 0.0 < lower < 1.0:
            out.append(ConfigProblem(f"{prefix}.rollout_rs_threshold_lower", lower, "must be in (0, 1)",
                                     f"set {prefix}.rollout_rs_threshold_lower=0.999 or null (= 1 / rollout_rs_threshold)"))
        return out


def _no_effect(key: str, value: Any, why: str, fix: str) -> ConfigProblem:
    return ConfigProblem(key, value, f"has no effect: {why}", fix)


def algorithm_variant_problems(algo: Any, prefix: str = "algorithm") -> list[ConfigProblem]:
    """The nested rollout-correction section.

    Args:
        algo: the ``algorithm`` section (`packrl.config.schema.AlgorithmConfig`, which calls this
            from its own check; typed loosely so that this module, which the schema imports,
            does not import it back).
    """
    return list(algo.rollout_correction.problems(f"{prefix}.rollout_correction"))
