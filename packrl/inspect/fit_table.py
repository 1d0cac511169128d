"""`packrl preflight --table`: per device memory size and memory setting, the longest prompt +
response that fits and the update budget (``train.max_tokens_per_microbatch``) to use.

verl's docs list "model / GPUs / recommended sequence length" by hand; this table computes the
same from the memory estimate (`packrl.inspect.memory.estimate_memory`, configs only) for the
configured model and run, for four settings, each on top of the run's config:

==========================  ================================================================
setting                     changes
==========================  ================================================================
plain                       gradient checkpointing, LoRA and parameter offload off
gradient checkpointing      ``model.gradient_checkpointing=true``
LoRA                        ``model.lora.rank`` (16 unless configured; the run's ranks)
param offload               ``model.param_offload=true`` (FSDP2 on CUDA: at least 2 ranks)
==========================  ================================================================

The longest sequence ``S`` is the largest multiple of 256 tokens (or the model context, which
caps it) for which every phase fits: an update and a log-prob micro-batch of ``S`` tokens, and
generation of ``rollout.max_num_seqs`` sequences of ``S`` tokens (prompts up to
``data.max_prompt_tokens``, at most half of ``S``). The budget is then the largest
``train.max_tokens_per_microbatch`` (a multiple of 256) whose update fits with those budgets.
A table of 4 sizes x 4 settings takes about 0.2 s for SmolLM2-135M (reading its config and
building its shapes on the meta device included).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from packrl.config import RunConfig, load_config
from packrl.inspect.memory import GIB, ModelShape, estimate_memory, max_fitting_tokens

DEFAULT_MEMORY_GIB: tuple[float, ...] = (24.0, 40.0, 80.0, 141.0)
"""Common accelerator sizes: 24 GiB (L4, RTX 4090), 40 and 80 GiB (A100, H100), 141 GiB (H200)."""
_STEP = 256
_NO_CONTEXT_CAP = 1 << 20


@dataclass(frozen=True)
class FitRow:
    """One device memory size under one setting.

    Attributes:
        device_memory_gib: memory per device, GiB.
        setting: ``plain``, ``gradient checkpointing``, ``LoRA rank R`` or ``param offload``.
        overrides: the ``key=value`` overrides that give this setting on top of the run.
        max_sequence_tokens: the longest prompt + response that fits (0: none does, or unavailable).
        max_tokens_per_microbatch: the ``train.max_tokens_per_microbatch`` to use (0 likewise).
        limit: what bounds ``max_sequence_tokens``: ``memory`` or ``model context``; for an
            unavailable setting the reason (e.g. ``needs CUDA``).
        available: False when the setting cannot run on this device kind.
    """

    device_memory_gib: float
    setting: str
    overrides: tuple[str, ...]
    max_sequence_tokens: int
    max_tokens_per_microbatch: int
    limit: str
    available: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"overrides": list(self.overrides)}


@dataclass(frozen=True)
class FitTable:
    """The rows of `fit_table`, ordered by memory size, then setting.

    Attributes:
        model_path: ``model.path``.
        device: ``cuda`` (device memory) or ``cpu`` (process RSS).
        max_context_tokens: the model context (with ``model.rope_scaling``), or None when unknown.
        max_num_seqs: ``rollout.max_num_seqs`` the generation phase was sized with.
        rows: `FitRow` per size and setting.
    """

    model_path: str
    device: str
    max_context_tokens: int | None
    max_num_seqs: int
    rows: list[FitRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``model_path``, ``device``, ``max_context_tokens``, ``max_num_seqs``, ``rows``."""
        return {"model_path": self.model_path, "device": self.device, "max_context_tokens": self.max_context_tokens,
                "max_num_seqs": self.max_num_seqs, "rows": [r.to_dict() for r in self.rows]}

    def to_text(self) -> str:
        """An aligned table with a header saying what it assumed."""
        context = f"{self.max_context_tokens:,}" if self.max_context_tokens else "unknown"
        lines = [f"model {self.model_path} on {self.device}, model context {context} tokens, generation of "
                 f"rollout.max_num_seqs={self.max_num_seqs} sequences at a time (fewer let longer sequences fit)",
                 "", f"{'GiB':>6}  {'setting':<26}{'longest prompt+response':>25}  {'train.max_tokens_per_microbatch':>31}  limit",
                 ]
        for r in self.rows:
            seq = f"{r.max_sequence_tokens:,}" if r.available else "-"
            budget = f"{r.max_tokens_per_microbatch:,}" if r.available else "-"
            lines.append(f"{r.device_memory_gib:>6g}  {r.setting:<26}{seq:>25}  {budget:>31}  {r.limit}")
        lines += ["", "settings: " + "; ".join(f"{r.setting}: {' '.join(r.overrides) or 'as configured'}"
                                               for r in self.rows[: len({r.setting for r in self.rows})])]
        return "\n".join(lines)


def _with(cfg: Any, values: dict[str, Any]) -> Any:
    """``cfg`` with dotted keys replaced (``{"model.lora.rank": 16}``); never validated."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        groups.setdefault(head, {})[rest] = value
    changes = {head: (_with(getattr(cfg, head), sub) if "" not in sub else sub[""]) for head, sub in groups.items()}
    return dataclasses.replace(cfg, **changes)


def _settings(lora_rank: int, workers: int, device: str) -> list[tuple[str, dict[str, Any], str | None]]:
    """``(name, dotted changes, reason it cannot run or None)`` per setting, for a run of
    ``model.lora.rank=lora_rank`` (0: the table's LoRA rank is 16) on ``trainer.num_workers=workers``."""
    off = {"model.gradient_checkpointing": False, "model.lora.rank": 0, "model.param_offload": False}
    rank = lora_rank or 16
    lora = off | {"model.lora.rank": rank}
    offload = off | {"model.param_offload": True} | ({"trainer.num_workers": 2} if workers == 1 else {})
    return [
        ("plain", off, None),
        ("gradient checkpointing", off | {"model.gradient_checkpointing": True}, None),
        (f"LoRA rank {rank}", lora, None),
        (f"param offload ({max(2, workers)} ranks)", offload, None if device == "cuda" else "needs CUDA (FSDP2 offload)"),
    ]


def _with_sequence(cfg: RunConfig, tokens: int) -> RunConfig:
    """``cfg`` sized for sequences of ``tokens``: prompts up to ``data.max_prompt_tokens`` (at most
    half), responses the rest, update and log-prob micro-batches of exactly one sequence."""
    prompt = min(cfg.data.max_prompt_tokens, tokens // 2)
    return _with(cfg, {"data.max_prompt_tokens": prompt, "rollout.max_response_tokens": tokens - prompt,
                       "train.max_tokens_per_microbatch": tokens, "train.max_tokens_per_logprob_microbatch": tokens})


def longest_sequence(cfg: RunConfig, shape: ModelShape, memory_bytes: int, *, device: str, cap: int) -> int:
    """The largest prompt + response (a multiple of 256 tokens, or ``cap``) whose every phase fits
    ``memory_bytes`` per device; 0 when 256 tokens do not."""
    def fits(tokens: int) -> bool:
        return estimate_memory(_with_sequence(cfg, tokens), shape, device=device).peak_bytes <= memory_bytes

    if fits(cap):
        return cap
    lo, hi = 0, cap // _STEP + 1  # fits(lo * STEP) (or lo = 0), not fits(hi * STEP)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * _STEP) else (lo, mid)
    return lo * _STEP


def fit_table(preset: str | None, overrides: list[str] | tuple[str, ...] = (), *,
              memory_gib: tuple[float, ...] | list[float] = DEFAULT_MEMORY_GIB, device: str = "cuda") -> FitTable:
    """The longest prompt + response and the update budget per memory size and setting.

    Args:
        preset / overrides: the run (`packrl.config.load_config`).
        memory_gib: memory per device, GiB (2^30 bytes), each > 0.
        device: ``cuda`` (device memory) or ``cpu`` (process RSS).

    Returns:
        `FitTable` with ``len(memory_gib) x 4`` rows.

    Raises:
        ValueError: a size that is not positive, an unknown device, a config problem
            (`ConfigError`), or a model config that cannot be read or built.
    """
    from packrl.models.model_config import apply_rope_scaling, load_model_config
    from packrl.seqlen.budgets import model_context_tokens

    bad = [g for g in memory_gib if not (g > 0 and math.isfinite(g))]
    if bad or not memory_gib:
        raise ValueError(f"--memory-gib {' '.join(map(str, memory_gib))}: give one or more positive sizes in GiB, e.g. 24 80")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device={device!r} must be cpu or cuda")
    cfg = load_config(preset, list(overrides))
    model_config = load_model_config(cfg.model.path)
    try:
        context: int | None = model_context_tokens(apply_rope_scaling(model_config, cfg.model.rope_scaling))[0]
    except ValueError:
        context = None
    table = FitTable(cfg.model.path, device, context, cfg.rollout.max_num_seqs)
    shapes: dict[int, ModelShape] = {}
    for gib in memory_gib:
        for name, changes, unavailable in _settings(cfg.model.lora.rank, cfg.trainer.num_workers, device):
            variant = _with(cfg, changes)
            keys = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items() if _get(cfg, k) != v]
            if unavailable:
                table.rows.append(FitRow(gib, name, tuple(keys), 0, 0, unavailable, available=False))
                continue
            rank = variant.model.lora.rank
            shape = shapes.get(rank) or shapes.setdefault(rank, ModelShape.from_config(model_config, variant.model.lora))
            memory_bytes = int(gib * GIB)
            longest = longest_sequence(variant, shape, memory_bytes, device=device, cap=context or _NO_CONTEXT_CAP)
            budget = max_fitting_tokens(_with_sequence(variant, longest), shape, memory_bytes, device=device) if longest else 0
            limit = "model context" if context is not None and longest == context else "memory"
            table.rows.append(FitRow(gib, name, tuple(keys), longest, budget, limit))
    return table


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg
