"""The optimizer side of an update, the same for the actor and the critic: AdamW, the gradient
norm clipped over every rank, steps skipped for a non-finite gradient, and the warm-up schedule."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class SkipCounter:
    """Optimizer steps skipped because the gradient norm was not finite (a NaN/inf loss makes it
    so): in total, and in a row across training steps.

    Raises (from `record`):
        ValueError: ``max_consecutive`` skips in a row (``train.max_consecutive_skips``).
    """

    max_consecutive: int
    total: int = 0
    consecutive: int = 0
    lr_key: str = "train.lr"
    """The learning rate's config key, named in the fix."""

    def record(self, grad_norm: float) -> bool:
        """Count one optimizer step; return True when it must be skipped."""
        if math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.total += 1
        self.consecutive += 1
        logger.warning("gradient norm is %s: optimizer step skipped (%d in a row, %d in total)", grad_norm, self.consecutive, self.total)
        if self.consecutive >= self.max_consecutive:
            raise ValueError(
                f"{self.consecutive} optimizer steps in a row had a non-finite gradient (train.max_consecutive_skips="
                f"{self.max_consecutive}); the run stopped. Lower {self.lr_key}, set train.grad_clip, or check the rewards for NaN"
            )
        return True

    def state_dict(self) -> dict[str, int]:
        """``{skipped_steps, consecutive_skips}``, saved with each checkpoint."""
        return {"skipped_steps": self.total, "consecutive_skips": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue counting from a checkpoint's `state_dict` (absent keys count as 0)."""
        self.total, self.consecutive = int(state.get("skipped_steps", 0)), int(state.get("consecutive_skips", 0))


@dataclass(frozen=True)
class Optimization:
    """The optimizer side of an update: optimizer, LR schedule, skip counter, and the settings."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    skips: SkipCounter
    grad_clip: float

    @classmethod
    def build(cls, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, warmup_steps: int,
              max_consecutive_skips: int, grad_clip: float, lr_key: str = "train.lr") -> Optimization:
        """AdamW over ``params`` (`adamw`) with a linear warm-up over ``warmup_steps`` optimizer
        steps from 0 to ``lr`` (none at 0), a `SkipCounter` of ``max_consecutive_skips`` and
        ``grad_clip`` (0 = no clipping): the actor's (the update's
        `packrl.config.update_spec.OptimizerSpec`) and the critic's (``critic.*``). ``lr_key``
        names the learning rate's key in the skip counter's error."""
        optimizer = adamw(params, lr=lr, weight_decay=weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
        return cls(optimizer=optimizer, scheduler=scheduler, skips=SkipCounter(max_consecutive_skips, lr_key=lr_key), grad_clip=grad_clip)

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken so far, skipped ones included: the schedule's count, restored
        with a checkpoint's schedule; the same on every rank."""
        return int(self.scheduler.last_epoch)


def adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over ``params``, fused where torch has a fused kernel for
    their device and dtype (CPU, CUDA; FSDP2's DTensor shards included), else ``foreach``. The
    fused kernel is one pass over the parameters; on CPU torch's default is a loop over tensors
    (``bench/bench_update.py``). The update rule is the same."""
    fused_devices = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    fused = all(p.device.type in fused_devices and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None, foreach=None if fused else True)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` that also takes FSDP2 shards offloaded to host memory
    (``model.param_offload``): their total norm is a CPU DTensor whose reduction over ranks must
    run on the mesh's device (NCCL reduces device tensors only), so it moves there first.
    Returns the total norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    mesh = getattr(grads[0], "device_mesh", None) if grads else None
    if mesh is None or grads[0].device.type == mesh.device_type:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads).to(mesh.device_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def optimizer_step(model: torch.nn.Module, opt: Optimization) -> tuple[float, float]:
    """Clip the gradient norm to ``train.grad_clip`` (global over ranks: DTensor), step the
    optimizer unless the norm is not finite, step the schedule, zero the gradients.
    Returns ``(grad_norm, lr)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(params, opt.grad_clip if opt.grad_clip > 0 else float("inf"))
    lr = opt.optimizer.param_groups[0]["lr"]
    if not opt.skips.record(grad_norm):
        opt.optimizer.step()
    with warnings.catch_warnings():  # a skipped step still advances the schedule, as verl's does
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        opt.scheduler.step()
    opt.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr
