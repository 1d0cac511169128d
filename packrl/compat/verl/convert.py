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
ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo"}
"""verl's ``algorithm.adv_estimator`` values packrl has (same names)."""
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
"""verl's ``kl_loss_type`` / ``kl_penalty`` -> packrl's ``algorithm.kl_estimator``."""

dtype = one_of(DTYPES, "packrl computes in bf16 or fp32", "set {key}=bfloat16 (or float32)",
               note="compute dtype; parameters stay float32")
policy_loss = one_of(LOSS_MODES, f"has no packrl policy loss (packrl: {', '.join(LOSS_MODES)})",
                     "set {key}=vanilla (or gspo, clip_cov, kl_cov), or register the loss in a trainer.plugins file")
estimator = one_of(ESTIMATORS, f"has no packrl estimator (packrl: {', '.join(ESTIMATORS)})",
                   "set {key}=grpo (or gae, rloo), or register the estimator in a trainer.plugins file")
