"""One-value conversions from a verl value to a packrl value, for the executable rules of the key table.

A converter takes the verl value (as `parse_override` typed it, or verl's default) and returns

==========================  ============================================================
return                      what the translation does
==========================  ============================================================
a plain value               sets the rule's packrl key to it
`Converted(value, note)`    sets it and prints ``note`` as the unit or name conversion
`NoEffect(reason)`          sets nothing; names the key as ignored with ``reason``, or
                            (``reason`` "") leaves it to the generic "no effect" message
==========================  ============================================================

or raises `Refused` (the value cannot be honoured: the message and the fix, where ``{key}``
stands for the verl key). Every converter is a pure function of that one value; conversions
that need several verl keys live in `packrl.compat.verl.relational`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

Converter = Callable[[Any], Any]
"""verl value -> packrl value, `Converted`, or `NoEffect`; raises `Refused`."""


@dataclass(frozen=True, slots=True)
class Converted:
    """A packrl value and the conversion to print with it."""

    value: Any
    note: str = ""


@dataclass(frozen=True, slots=True)
class NoEffect:
    """The verl value asks for nothing; ``reason`` (when not "") names why in the report."""

    reason: str = ""


class Refused(ValueError):
    """A verl value packrl cannot honour: ``message`` says why, ``fix`` what to set instead
    (``{key}`` in it stands for the verl key)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.message, self.fix = message, fix


def as_list(value: Any) -> list[Any]:
    """``value`` as a list: a list or tuple as it is, anything else as the one element."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def files(value: Any) -> list[str]:
    """verl's ``data.train_files``/``val_files`` (one path or a list) as a list with ``~`` expanded."""
    return [os.path.expanduser(str(f)) for f in as_list(value)]


def as_int(value: Any) -> int:
    """``value`` as a whole number. Raises `Refused` for another value (a bool included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    raise Refused("must be a whole number", "set {key} to an integer")


def as_float(value: Any) -> float:
    """``value`` as a number. Raises `Refused` for another value (a bool included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise Refused("must be a number", "set {key} to a number")


def as_bool(value: Any) -> bool:
    """``value``'s truth, as verl's ``if config.x:`` reads it."""
    return bool(value)


def as_str(value: Any) -> str:
    """``value`` as text (a path or a model id)."""
    return str(value)


def as_is(value: Any) -> Any:
    """``value`` unchanged (the same names in both)."""
    return value


def one_of(names: dict[str, str], message: str, fix: str, note: str | None = None) -> Converter:
    """A converter renaming verl's ``names`` to packrl's; any other value is refused with
    ``message`` and ``fix``. The note is ``note`` when given, else ``verl -> packrl`` for a
    renamed value."""

    def convert(value: Any) -> Any:
        if str(value) not in names:
            raise Refused(message, fix)
        renamed = names[str(value)]
        return Converted(renamed, note if note is not None else (f"{value} -> {renamed}" if renamed != value else ""))

    return convert


def never_to_zero(note: str = "") -> Converter:
    """verl's ``-1`` (never) -> packrl's ``0`` (never) for an every-N-steps key
    (``trainer.save_freq``, ``trainer.test_freq``); ``note`` is added to the conversion."""

    def convert(value: Any) -> Converted:
        steps = as_int(value)
        return Converted(max(0, steps), f"{steps} (never) -> 0{note}" if steps <= 0 else "")

    return convert


def switch_on(note: str) -> Converter:
    """A path-valued verl key that turns a packrl switch on: null -> nothing, a path -> True."""

    def convert(value: Any) -> Any:
        return NoEffect() if value is None else Converted(True, note)

    return convert


def unless_null(convert: Converter, reason: str, note: str = "") -> Converter:
    """``convert`` for a value, `NoEffect(reason)` for null; ``note`` is printed with the value."""

    def converter(value: Any) -> Any:
        return NoEffect(reason) if value is None else Converted(convert(value), note)

    return converter


def top_k(value: Any) -> Converted:
    """verl's ``rollout.top_k`` (-1 = off) -> packrl's (0 = off)."""
    k = as_int(value)
    return Converted(max(0, k), "-1 (off) -> 0 (off)" if k < 0 else "")


def val_rows(value: Any) -> Converted:
    """verl's ``data.val_max_samples`` (-1 or null = all, N = a random N) -> packrl's
    ``data.max_val_rows`` (null = all, N = the first N)."""
    rows = None if value is None else as_int(value)
    if rows is None or rows < 0:
        return Converted(None, "-1 (all) -> null")
    return Converted(rows, "the first N rows (verl: a random N)")


def keep_last(value: Any) -> Any:
    """verl's ``trainer.max_actor_ckpt_to_keep`` (null or <= 0 = all) -> ``train.keep_last`` (null = all)."""
    keep = None if value is None else as_int(value)
    return keep if keep is not None and keep > 0 else None


LOGGERS = ("console", "wandb", "tensorboard", "mlflow")
"""The ``trainer.logger`` names packrl logs to (``train.loggers``)."""


def loggers(value: Any) -> Converted:
    """verl's ``trainer.logger`` (a name or a list) -> ``train.loggers``: the names packrl has,
    console when none is left; the others are named in the note."""
    names = [str(n) for n in as_list(value)]
    kept, dropped = [n for n in names if n in LOGGERS], [n for n in names if n not in LOGGERS]
    return Converted(kept or ["console"], f"dropped {', '.join(dropped)} (packrl logs to {', '.join(LOGGERS)})" if dropped else "")


def torch_compile(value: Any) -> Converted:
    """verl's ``actor.use_torch_compile`` -> ``model.compile``: false -> false, true -> null
    (compiled decoder layers where packrl can run them)."""
    return Converted(None if value else False, "true -> null: on where packrl can compile")


def engine(value: Any) -> Any:
    """verl's ``rollout.name`` -> ``rollout.engine`` (vllm, hf); null -> nothing. Raises `Refused`
    for another engine (sglang, trtllm)."""
    if value is None:
        return NoEffect()
    if value not in ("vllm", "hf"):
        raise Refused("packrl's engines are vllm and hf", "set {key}=vllm (or hf)")
    return value


DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}
"""verl's ``fsdp_config.dtype`` -> packrl's ``model.dtype``."""
LOSS_MODES = {"vanilla": "ppo_clip", "gspo": "gspo", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}
"""verl's ``policy_loss.loss_mode`` -> packrl's ``algorithm.policy_loss``."""
ESTIMATORS = {name: name for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")}
"""verl's ``algorithm.adv_estimator`` values packrl has (same names and formulas: verl 0.9.1
``core_algos.py``)."""
LOSS_AGG_MODES = {name: name for name in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")}
"""verl's ``actor.loss_agg_mode`` values packrl has (same names; verl 0.9's ``token-sum`` is not one)."""
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
"""verl's ``kl_loss_type`` / ``kl_penalty`` -> packrl's ``algorithm.kl_estimator``."""

dtype = one_of(DTYPES, "packrl computes in bf16 or fp32", "set {key}=bfloat16 (or float32)",
               note="compute dtype; parameters stay float32")
policy_loss = one_of(LOSS_MODES, f"has no packrl policy loss (packrl: {', '.join(LOSS_MODES)})",
                     "set {key}=vanilla (or gspo, clip_cov, kl_cov), or register the loss in a trainer.plugins file")
estimator = one_of(ESTIMATORS, f"has no packrl estimator (packrl: {', '.join(ESTIMATORS)})",
                   "set {key}=grpo (or gae, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline), or register the "
                   "estimator in a trainer.plugins file")
loss_agg_mode = one_of(LOSS_AGG_MODES, f"has no packrl loss aggregation (packrl: {', '.join(LOSS_AGG_MODES)})",
                       "set {key}=token-mean (or seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm)")
trainer_mode = one_of({"sync": "sync"}, "is an asynchronous verl trainer; packrl's colocate_async and separate_async modes "
                      "bound staleness and carry partial rollouts their own way (docs/async.md), so they are not the same run",
                      "set {key}=sync, or drop it and add trainer.rollout_mode=colocate_async (or separate_async) to the "
                      "printed packrl train command")


def _ratio_bound(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise ValueError(text)
    return value


def geometric_bounds(value: Any) -> tuple[float, float | None]:
    """verl >= 0.7.1's ``rollout_rs=seq_mean_k1`` threshold -> packrl's geometric rejection
    bounds ``(rollout_rs_threshold, rollout_rs_threshold_lower)``.

    verl (``rollout_corr_helper.compute_rollout_rejection_mask``) keeps a response when
    ``log(lower) <= mean_t(-log r_t) <= log(upper)``, r_t = pi_old / pi_rollout with each log r_t
    clamped to +-20: its bounds are on the inverse geometric-mean ratio 1/rho. packrl keeps it when
    ``lower' <= rho <= upper'`` (`packrl.algos.rollout_correction`), so ``upper' = 1 / lower`` and
    ``lower' = 1 / upper``. verl's spec is ``"lower_upper"`` or one number u, which verl reads as
    ``[1/u, u]``: packrl's ``(u, null)`` (null = 1 / u), the same interval.

    Raises:
        Refused: not one ``lower_upper`` pair or one number, or bounds that do not bracket 1
            (packrl's bounds are lower' < 1 < upper').
    """
    fix = "set {key}='0.999_1.001' (lower_upper on verl's inverse ratio; packrl keeps 1/1.001 <= rho <= 1/0.999)"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or "," in str(value):
        raise Refused("must be one lower_upper pair or one number (packrl has one rejection criterion)", fix)
    lower_text, sep, upper_text = str(value).strip().partition("_")
    try:
        lower = _ratio_bound(lower_text) if sep else None
        upper = _ratio_bound(upper_text if sep else lower_text)
    except ValueError:
        raise Refused("is not a number or a lower_upper pair of positive numbers", fix) from None
    if lower is None:
        if upper <= 1.0:
            raise Refused("must be > 1: verl keeps [1/u, u]", fix)
        return upper, None
    if not lower < 1.0 < upper:
        raise Refused("must bracket 1 (lower < 1 < upper): a window without ratio 1 rejects on-policy responses", fix)
    return 1.0 / lower, 1.0 / upper
