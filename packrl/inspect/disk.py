"""Disk space for checkpoints, checked from the model config alone before any weight loads."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def checkpoint_bytes(cfg: Any) -> int:
    """Bytes one checkpoint of ``cfg``'s model takes, from its config alone (no weights):
    float32 weights (4 bytes per parameter; with LoRA only the adapter) plus AdamW's two float32
    moments (8 bytes per trainable parameter) plus 16 MiB for tokenizer files and state.

    Raises:
        ValueError: the model config cannot be read (names ``model.path``).
    """
    from packrl.inspect.memory import ModelShape
    from packrl.models.model_config import load_model_config

    shape = ModelShape.from_config(load_model_config(cfg.model.path), cfg.model.lora, cfg.model.path)
    saved = shape.num_lora_params if cfg.model.lora.rank > 0 else shape.num_params
    return 12 * saved + (16 << 20)


def check_disk_space(run_dir: Path, needed_bytes: int, *, lora: bool = False) -> None:
    """Fail before any model loads when RUN_DIR's disk cannot hold one checkpoint.

    Args:
        lora: the checkpoints hold a LoRA adapter (the fix then does not suggest LoRA).

    Raises:
        ValueError: free bytes < ``needed_bytes``; names the path, both numbers and the fix.
    """
    free = shutil.disk_usage(run_dir).free
    if free < needed_bytes:
        fix = "free disk space or choose another train.out_dir"
        if not lora:
            fix += ", or set model.lora.rank=16 (checkpoints then hold only the adapter)"
        raise ValueError(f"train.out_dir={str(run_dir)!r} has {_size(free)} ({free:,} bytes) free, less than the "
                         f"{_size(needed_bytes)} ({needed_bytes:,} bytes) one "
                         f"checkpoint needs (float32 weights + AdamW states); {fix}")


def _size(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.1f} MiB"
