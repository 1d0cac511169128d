"""``data.length_target``: the response length each prompt asks for (L1, Aggarwal & Welleck 2025,
arXiv 2503.04697: "Think for N tokens." appended to the prompt).

Each usable row gets a target N: its ``column`` field, or a draw from ``[min_tokens, max_tokens]``
seeded by ``train.seed`` and the row (so a row asks for the same N in every epoch and on every
rank). The template, ``{target}`` replaced by N, is appended to the row's last user message after
one space; it then goes through the chat template, the prompt budget and the prompt policy like any
prompt text. The target travels with the prompt (`packrl.types.PromptBatch.length_targets`) to the
``target_length`` objective and the ``length/target_error/*`` metrics.

With ``mode_column`` each row also says how it asks: ``exact`` rows take ``template``, ``max`` rows
``max_template`` (L1-Max's " Think for maximum N tokens."), and the mode travels with the prompt
(`packrl.types.PromptBatch.length_modes`) to the objective, which scores each row by its own mode.
L1 trains L1-Max on such a mix (cmu-l3/l1 ``scripts/data/deepscaler_dataset.py`` asks about half
the rows for a maximum).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from packrl.config.length_control import LengthTargetConfig
from packrl.data.examples import Example


def with_length_target(example: Example, raw: Any, cfg: LengthTargetConfig, seed: int, *,
                       max_tokens: int | None = None) -> Example | str:
    """``example`` asking for its target (module docstring), or the reason the row cannot be used.

    Args:
        example: the row, normalised (`packrl.data.examples.to_example`).
        raw: the row as loaded (a mapping; ``column`` is read from it).
        cfg: ``data.length_target`` (off: ``example`` is returned as it is).
        seed: ``train.seed``.
        max_tokens: the response budget a target must not exceed (the smallest stage of a length
            curriculum), or None to take any; a drawn range is checked against it at load.

    Returns:
        The example with its mode's template appended and ``length_target`` (and with
        ``mode_column`` ``length_mode``) set, or a reason string (the row has no ``column`` or
        ``mode_column`` field, its target is not a positive integer or exceeds ``max_tokens``, its
        mode is neither ``exact`` nor ``max``), counted as a bad row.
    """
    if not cfg.enabled:
        return example
    mode = _row_mode(raw, cfg)
    if mode not in (None, "exact", "max"):
        return mode
    if cfg.column is not None:
        if not isinstance(raw, dict) or cfg.column not in raw:
            fields = ", ".join(map(repr, raw)) if isinstance(raw, dict) else "none"
            return f"no field {cfg.column!r} (data.length_target.column); the row's fields: {fields}"
        value = raw[cfg.column]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"field {cfg.column!r} (data.length_target.column) is {value!r}, not a positive integer of tokens"
        if max_tokens is not None and value > max_tokens:
            return (f"field {cfg.column!r} (data.length_target.column) is {value:,} > the response budget {max_tokens:,} "
                    "(rollout.max_response_tokens; a length curriculum's smallest stage): the prompt would ask for a length "
                    "its response cannot reach")
        target = value
    else:
        assert cfg.min_tokens is not None and cfg.max_tokens is not None, "checked at config load"
        target = random.Random(f"{seed}:{example.row}:length_target").randint(cfg.min_tokens, cfg.max_tokens)
    template = cfg.max_template if mode == "max" else cfg.template
    return replace(example, chat=_asking(example.chat, template.strip().replace("{target}", str(target))), length_target=target,
                   length_mode=mode)


def _row_mode(raw: Any, cfg: LengthTargetConfig) -> str | None:
    """The row's mode (``exact`` or ``max``), None without ``cfg.mode_column``, or why the row has
    none (any other string)."""
    if cfg.mode_column is None:
        return None
    if not isinstance(raw, dict) or cfg.mode_column not in raw:
        fields = ", ".join(map(repr, raw)) if isinstance(raw, dict) else "none"
        return f"no field {cfg.mode_column!r} (data.length_target.mode_column); the row's fields: {fields}"
    value = raw[cfg.mode_column]
    if value in ("exact", "max"):
        return value
    return f"field {cfg.mode_column!r} (data.length_target.mode_column) is {value!r}, not 'exact' or 'max'"


def _asking(chat: list[dict[str, Any]], request: str) -> list[dict[str, Any]]:
    """``chat`` with ``request`` appended to its last user message (a text part for a message of parts)."""
    out = [dict(m) for m in chat]
    last = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=None)
    if last is None:
        out.append({"role": "user", "content": request})
        return out
    content = out[last]["content"]
    if isinstance(content, list):
        out[last]["content"] = [*content, {"type": "text", "text": f" {request}"}]
    else:
        out[last]["content"] = f"{str(content).rstrip()} {request}"
    return out
