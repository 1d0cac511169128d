"""Checkpoints: ``RUN_DIR/checkpoints/step_N`` holds the HF model and tokenizer, the optimizer
and scheduler state, and the trainer state. Written to a temporary folder, flushed to the disk (fsync) and renamed,
so a folder named ``step_N`` is always complete.

With LoRA (``model.lora.rank > 0``) the model part is the adapter alone, as peft's
``save_pretrained`` writes it: ``adapter_model.safetensors`` (float32 A and B of every adapted
layer: 19.5 MB for SmolLM2-135M at rank 16, against 538 MB for the full model) and
``adapter_config.json``. The base weights are ``model.path``'s and are not copied; no merged HF
model is written either (peft's ``merge_and_unload`` makes one when a plain model is wanted).
Resume loads the adapter into a policy built with the same ``model.*`` settings
(`load_weights`), exactly. On FSDP2 ranks the adapter is gathered whole before rank 0 writes it,
and on resume every rank reads it and keeps its shards (`packrl.worker.strategy.FSDP2`), so a
checkpoint moves between one process and any number of ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, optimizer_state: dict, trainer_state: dict,
                    keep_last: int | None = None, state_dict: dict[str, torch.Tensor] | None = None,
                    extra_files: dict[str, Any] | None = None, copy_files: Sequence[Path] = ()) -> Path:
    """Write ``run_dir/checkpoints/step_{step}`` atomically and return its path; then, with
    ``keep_last`` (``train.keep_last``), delete the oldest complete checkpoints beyond that many.

    Args:
        model / tokenizer: saved with ``save_pretrained`` (safetensors; a peft model saves only
            its adapter).
        optimizer_state: ``{"optimizer": ..., "scheduler": ...}`` state dicts; the optimizer's
            is the full, parameter-name keyed form of `full_optimizer_state`, the same from
            one process and from FSDP ranks.
        trainer_state: JSON-serialisable state (step, data position, ...).
        state_dict: the weights to write instead of ``model``'s own: the gathered full state
            dict of an FSDP-sharded model, or its gathered adapter parameters for a LoRA model
            (peft's ``save_pretrained`` keeps the adapter's keys of it).
        extra_files: ``file name -> object`` written with ``torch.save`` into the same folder
            (the critic's state), inside the same atomic write.
        copy_files: files copied in as they are (a vision-language model's processor configs),
            so the checkpoint loads as a ``model.path``.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(tmp)
        for source in copy_files:
            shutil.copyfile(source, tmp / source.name)
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        for name, obj in (extra_files or {}).items():
            torch.save(obj, tmp / name)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        fsync_tree(tmp)
    except BaseException as err:  # an interrupted or failed write leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception):
            free = shutil.disk_usage(root).free / (1 << 30)
            raise OSError(f"writing checkpoint step_{step} into {root} failed ({type(err).__name__}: {err}); "
                          f"{free:.2f} GiB free there now: free disk space, set train.keep_last, or choose another "
                          "train.out_dir") from err
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)  # the rename itself reaches the disk
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path``, then the folders, to the disk (``os.fsync``), so a
    checkpoint renamed into place after a power loss holds its bytes, not empty files."""
    for sub, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(sub, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(sub))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # folders cannot be opened on some platforms (Windows); their entries are flushed with them
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    fix = "resume from another checkpoint with train.resume=RUN_DIR/checkpoints/step_N, or start a new run"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / STATE_FILE} cannot be read ({type(err).__name__}: {err}); {fix}") from err
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("sampler"), dict):
        raise ValueError(f"{path / STATE_FILE} lacks the step or the sampler position; {fix}")
    try:
        optimizer_state = torch.load(path / OPTIMIZER_FILE, weights_only=False)
    except Exception as err:  # torch raises several types for a truncated or corrupt file
        raise ValueError(f"{path / OPTIMIZER_FILE} cannot be read ({type(err).__name__}: {err}); {fix}") from err
    if not isinstance(optimizer_state, dict) or not {"optimizer", "scheduler"} <= set(optimizer_state):
        raise ValueError(f"{path / OPTIMIZER_FILE} holds no optimizer and scheduler state; {fix}")
    return state, optimizer_state


def find_resume_checkpoint(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint ``train.resume`` names: None when not resuming or when ``auto`` finds no
    complete checkpoint; the newest complete ``step_N`` (its trainer state written) for ``auto``.
    Incomplete ``.tmp-step_N`` folders are never chosen.

    Raises:
        ValueError: a ``train.resume`` path that is not a complete checkpoint.
    """
    candidates = resume_candidates(run_dir, resume)
    return candidates[0] if candidates else None


def resume_candidates(run_dir: Path, resume: str | None) -> list[Path]:
    """The checkpoints ``train.resume`` allows, newest first: none when not resuming; for ``auto``
    every complete ``step_N`` in RUN_DIR (an older one is the fallback when a newer one cannot be
    read); for a path, that path.

    Raises:
        ValueError: a ``train.resume`` path that does not exist or is not a complete checkpoint.
    """
    if resume is None:
        return []
    if resume == "auto":
        root = run_dir / "checkpoints"
        done = [(int(p.name[5:]), p) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
        return [p for _, p in sorted(done, reverse=True)]
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(f"train.resume={resume!r} does not exist; pass a RUN_DIR/checkpoints/step_N folder or train.resume=auto")
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"train.resume={resume!r} is not a complete checkpoint (no {STATE_FILE}); "
                         "pass a checkpoints/step_N folder or train.resume=auto")
    return [path]


def restore_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """After loading a checkpoint's optimizer and schedule: apply ``train.lr`` as the base learning
    rate (the schedule's position is the checkpoint's), so a resumed run can change it; warns when
    it differs from the checkpoint's."""
    old = scheduler.base_lrs[0] if scheduler.base_lrs else lr
    if not math.isclose(old, lr, rel_tol=1e-9):
        logger.warning("train.lr=%g differs from the checkpoint's %g: the resumed run uses %g from here on", lr, old, lr)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter names, every tensor whole and on the CPU
    (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` with a full state dict):
    the same layout from one process and from FSDP2 ranks (a collective there: call it on every rank)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sharded = dist.is_available() and dist.is_initialized()
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `full_optimizer_state` into ``optimizer`` (sharding it for FSDP2 parameters). The
    implementation flags (``fused``, ``foreach``) stay the optimizer's own: torch would take the
    saved ones, so a checkpoint from an older release would resume on a slower implementation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if state.get("state") and all(isinstance(k, int) for k in state["state"]):  # torch's own index-keyed form
        optimizer.load_state_dict(state)
    else:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    for group in optimizer.param_groups:
        group.update({flag: optimizer.defaults[flag] for flag in ("fused", "foreach") if flag in optimizer.defaults})


def weights_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The full weights of a checkpoint folder (or HF model folder): its ``model.safetensors``, or
    every shard its ``model.safetensors.index.json`` lists, as one state dict on the CPU.

    Raises:
        ValueError: no safetensors weights under ``path``; when it holds a LoRA adapter instead,
            the message names the ``model.lora.rank`` to set.
    """
    from safetensors.torch import load_file

    from packrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    if not all((path / f).is_file() for f in files):
        hint = ""
        if (path / ADAPTER_WEIGHTS).is_file():
            rank = json.loads((path / ADAPTER_CONFIG).read_text()).get("r") if (path / ADAPTER_CONFIG).is_file() else "<its rank>"
            hint = f"; it holds a LoRA adapter instead: set model.lora.rank={rank} (and its model.lora.* settings) to load it"
        raise ValueError(f"{path} holds no safetensors weights ({', '.join(files)} expected){hint}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return state


def load_optimizer_and_schedule(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, optimizer_state: dict,
                                lr: float, path: Path) -> None:
    """Load a checkpoint's optimizer (`load_full_optimizer_state`) and LR schedule, then apply
    ``train.lr`` (`restore_schedule`).

    Raises:
        ValueError: the saved state does not fit this model's optimizer (names ``path``).
    """
    try:
        load_full_optimizer_state(model, optimizer, optimizer_state["optimizer"])
        scheduler.load_state_dict(optimizer_state["scheduler"])
    except (KeyError, ValueError, RuntimeError) as err:
        raise ValueError(f"the optimizer state in {path / OPTIMIZER_FILE} does not fit this model ({type(err).__name__}: {err}); "
                         "resume with the model.* settings of the run that wrote it, or start a new run") from err
    restore_schedule(optimizer, scheduler, lr)


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's weights into ``model`` in place: its safetensors weights
    (`weights_state_dict`; tied weights absent from the files keep
    their tie), or for a LoRA model its adapter (`packrl.models.lora.load_adapter`; the base
    weights are ``model.path``'s).

    Raises:
        ValueError: no safetensors weights under ``path`` (naming ``model.lora.rank`` when it holds
            an adapter instead), a parameter of the model missing, or an adapter that does not fit.
    """
    from packrl.models.lora import is_lora, load_adapter

    if is_lora(model):
        load_adapter(model, path)
        return
    try:
        state = weights_state_dict(path)
    except ValueError:
        raise
    except Exception as err:  # safetensors raises its own error type for a truncated or corrupt file
        raise ValueError(f"the weights in {path} cannot be read ({type(err).__name__}: {err}); resume from another "
                         "checkpoint with train.resume=RUN_DIR/checkpoints/step_N") from err
    missing, _ = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=True)}
    really_missing = [m for m in missing if m in tied]
    if really_missing and getattr(model.config, "vision_config", None) is not None:
        # transformers writes a vision-language model under its original checkpoint names (``visual.*``,
        # ``model.*``) and maps them back when it loads: read the checkpoint that way
        loaded = cast(Any, type(model)).from_pretrained(path, dtype=next(model.parameters()).dtype)
        model.load_state_dict(loaded.state_dict())
        return
    if really_missing:
        raise ValueError(f"{path} lacks weights for {really_missing[:5]}")


# Disk space for checkpoints, checked from the model config alone before any weight loads.


def checkpoint_bytes(cfg: Any, model_config: Any = None) -> int:
    """Bytes one checkpoint of ``cfg``'s model takes, from its config alone (no weights):
    float32 weights (4 bytes per parameter; with LoRA only the adapter) plus AdamW's two float32
    moments (8 bytes per trainable parameter) plus 16 MiB for tokenizer files and state.
    ``model_config``: the model's config as already read (`packrl.models.loading.ResolvedPolicy.config`);
    None: read from ``model.path`` here.

    Raises:
        ValueError: the model config cannot be read (names ``model.path``).
    """
    from packrl.models.model_config import ModelShape, load_model_config

    config = model_config if model_config is not None else load_model_config(cfg.model.path)
    shape = ModelShape.from_config(config, cfg.model.lora, cfg.model.path)
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
