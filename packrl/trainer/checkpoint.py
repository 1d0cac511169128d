"""Checkpoints: ``RUN_DIR/checkpoints/step_N`` holds the HF model and tokenizer, the optimizer
and scheduler state, and the trainer state. Written to a temporary folder and renamed, so a
folder named ``step_N`` is always complete.

With LoRA (``model.lora.rank > 0``) the model part is the adapter alone, as peft's
``save_pretrained`` writes it: ``adapter_model.safetensors`` (float32 A and B of every adapted
layer: 19.5 MB for SmolLM2-135M at rank 16, against 538 MB for the full model) and
``adapter_config.json``. The base weights are ``model.path``'s and are not copied; no merged HF
model is written either (peft's ``merge_and_unload`` makes one when a plain model is wanted).
Resume loads the adapter into a policy built with the same ``model.*`` settings
(`packrl.distributed.local.load_weights`), exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, optimizer_state: dict, trainer_state: dict,
                    keep_last: int | None = None) -> Path:
    """Write ``run_dir/checkpoints/step_{step}`` atomically and return its path; then, with
    ``keep_last`` (``train.keep_last``), delete the oldest complete checkpoints beyond that many.

    Args:
        model / tokenizer: saved with ``save_pretrained`` (safetensors; a peft model saves only
            its adapter).
        optimizer_state: ``{"optimizer": ..., "scheduler": ...}`` state dicts.
        trainer_state: JSON-serialisable state (step, data position, ...).
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
    except BaseException:  # an interrupted or failed write leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` highest-numbered ``step_N`` folders under ``root``.
    Temporary (incomplete) folders are not checkpoints and are never counted. Returns the deleted."""
    assert keep_last >= 1, "keep_last is validated by the config"
    steps = sorted((int(p.name[5:]), p) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    doomed = [p for _, p in steps[:-keep_last]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load_trainer_state(path: Path) -> tuple[dict, dict]:
    """``(trainer_state, optimizer_state)`` of a checkpoint folder.

    Raises:
        ValueError: the folder is not a complete checkpoint.
    """
    if not (path / STATE_FILE).is_file() or not (path / OPTIMIZER_FILE).is_file():
        raise ValueError(f"{path} is not a complete packrl checkpoint (needs {STATE_FILE} and {OPTIMIZER_FILE})")
    state = json.loads((path / STATE_FILE).read_text())
    return state, torch.load(path / OPTIMIZER_FILE, weights_only=False)
