"""The `train` section: micro-batch token budgets, the optimizer, checkpoints, validation and loggers.

Part of the typed run configuration (`packrl.config.schema.RunConfig`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from packrl.errors import ConfigProblem, check_positive

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _logger_problems(key: str, loggers: Sequence[str]) -> list[ConfigProblem]:
    """A problem for each logger whose package is not importable (checked before any model loads)."""
    import importlib.util

    out = []
    for name in loggers:
        package = _LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            extra = "pip install 'packrl[tensorboard]'" if name == "tensorboard" else f"pip install {package}"
            kept = [n for n in loggers if n != name] or ["console"]
            out.append(ConfigProblem(key, loggers, f"names {name} but the {package} package is not installed",
                                     f"{extra}, or set {key}=[{','.join(kept)}]", machine=True))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    max_tokens_per_microbatch: int = 8192
    """Hard cap on real (non-pad) tokens in one update micro-batch (forward + backward), per
    device. Must hold the longest possible sequence, `max_prompt_tokens + max_response_tokens`."""

    max_tokens_per_logprob_microbatch: int = 16384
    """Hard cap on real tokens in one no-grad log-prob micro-batch (old and reference log-probs),
    per device. No activations are kept for backward, so it can be larger than the update budget."""

    max_vision_patches_per_microbatch: int | None = None
    """A vision-language model's second micro-batch budget: vision-encoder patches (each image's
    ``t*h*w`` before the spatial merge, 4 per image token for Qwen2-VL) of the distinct images in
    one micro-batch, per device, in every pass (log-probs and update). They set the vision
    tower's activation memory and its attention cost as tokens set the language model's; a
    group's responses in one micro-batch share one encoding of their prompt's images. Images are
    resized at data load so every prompt's images fit (as `data.max_image_tokens` does). None
    (default): no patch budget (the token budgets alone plan the micro-batches)."""

    logits_chunk_tokens: int = 1024
    """Tokens per chunk when computing log-probs and entropy from hidden states: logits never
    exceed `logits_chunk_tokens x vocab` floats, forward or backward."""

    share_prompts: bool | None = None
    """Write a group's prompt once per pack in the log-prob and update passes: each response
    attends to it and to itself (`packrl.seqlen.packing.pack_shared`; exact). Micro-batch budgets
    count the prompt once. It runs on `model.packed_attention=varlen` through packrl's SDPA path
    (CPU, or CUDA without flash-attn) and on `block_mask`, without sequence parallelism.
    null (default): on wherever it can run, else off (model.txt says which and why). true: on; refused
    at load with `position_ids` or sequence parallelism, off with a warning on flash-attn's
    varlen kernel. false: off."""

    balance_microbatches: bool = True
    """Balance micro-batches by the cost model `a*L + L^2` (same micro-batch count, flatter
    step time). False keeps the first-fit-decreasing packing as is."""

    total_steps: int = 5
    """Training steps (each: rollout, reward, advantages, update)."""

    lr: float = 1e-6
    """AdamW learning rate after warmup."""

    warmup_steps: int = 0
    """Optimizer steps of linear LR warmup from 0."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    mini_batch_size: int | None = None
    """Prompts per optimizer step (verl `ppo_mini_batch_size`); None = `data.batch_size` (one
    optimizer step per epoch). Must divide `data.batch_size`."""

    ppo_epochs: int = 1
    """Passes over each step's batch."""

    seed: int = 0
    """Seeds data order, sampling and initialisation."""

    out_dir: str | None = None
    """Run directory (RUN_DIR); None = a new timestamped folder under `runs/`."""

    save_every: int = 0
    """Save a checkpoint every this many steps and at the end (0 = only at the end)."""

    resume: str | None = None
    """Continue a run: `auto` = from the newest complete checkpoint in `train.out_dir` (a fresh start
    when there is none), or a path to a `checkpoints/step_N` folder. Restores the model, optimizer,
    LR schedule, data position and step; every step reseeds from `train.seed` and its number."""

    max_consecutive_skips: int = 3
    """Stop the run after this many optimizer steps in a row skipped for a non-finite gradient
    (each skip is a warning and counts in `train/skipped_steps`)."""

    keep_last: int | None = None
    """Keep only the newest this many checkpoints (None = all). Older ones are deleted only after
    a newer one is complete on disk."""

    val_every: int = 0
    """Validate every this many steps and at the end (0 = never, also when `data.val_files` is set)."""

    dump_rollouts: bool = False
    """Write every response of step N to `RUN_DIR/rollouts/step_N.jsonl` (prompt and response text,
    lengths, finish reason, reward, advantage), for `packrl view` and the report. Off by default:
    it stores the whole rollout on disk; the `demo` preset turns it on."""

    trace: bool = True
    """Write `RUN_DIR/trace.json` (Chrome trace-event format, opens in Perfetto): a span per stage
    and per update micro-batch of every step, with token counts; rewritten after every step."""

    loggers: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    """Where step metrics go: `jsonl` (`RUN_DIR/metrics.jsonl`; written even when not listed, since
    it is the run's record that `packrl report` and `packrl view` read), `console` (progress bar),
    `tensorboard` (`RUN_DIR/tensorboard`, needs the `tensorboard` package), `wandb`, `mlflow` (need
    their packages and own settings)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        for name in ("max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch", "logits_chunk_tokens", "total_steps", "ppo_epochs"):
            out += check_positive(f"{prefix}.{name}", getattr(self, name))
        for name in ("mini_batch_size", "max_vision_patches_per_microbatch"):
            if getattr(self, name) is not None:
                out += check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.keep_last is not None and self.keep_last < 1:
            out.append(ConfigProblem(f"{prefix}.keep_last", self.keep_last, "must be >= 1 (or null to keep every checkpoint)",
                                     f"set {prefix}.keep_last=2"))
        out += check_positive(f"{prefix}.max_consecutive_skips", self.max_consecutive_skips)
        if self.resume == "auto" and not self.out_dir:
            out.append(ConfigProblem(f"{prefix}.resume", self.resume, "needs the run's folder to look for checkpoints in",
                                     f"set {prefix}.out_dir to the run to continue", keys=(f"{prefix}.resume", f"{prefix}.out_dir")))
        for name in ("warmup_steps", "save_every", "val_every"):
            if getattr(self, name) < 0:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be >= 0", f"set {prefix}.{name}=0"))
        if not 0 < self.lr < math.inf:
            out.append(ConfigProblem(f"{prefix}.lr", self.lr, "must be a finite number > 0", "set train.lr=1e-6"))
        if self.weight_decay < 0 or self.grad_clip < 0:
            out.append(ConfigProblem(f"{prefix}.grad_clip", self.grad_clip, "grad_clip and weight_decay must be >= 0",
                                     "set train.grad_clip=1.0"))
        return out + _logger_problems(f"{prefix}.loggers", self.loggers)
