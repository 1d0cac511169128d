"""The worker-group protocol: what the single-controller loop asks of its workers.

An in-process group (`LocalWorkerGroup`) is the default; a group of Ray actors holding
torch.distributed ranks implements the same calls, so the loop does not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Protocol

from packrl.diagnostics.trace import NullTracer
from packrl.rollout.engine import SamplingParams
from packrl.trainer.actor import LogprobResult
from packrl.types import PromptBatch, RolloutBatch, TrainBatch

Role = Literal["actor", "ref"]


class WorkerGroup(Protocol):
    tokenizer: Any
    max_context_tokens: int
    """The policy's context in tokens, RoPE scaling included."""
    rope_factor: float
    """The RoPE scaling factor included in ``max_context_tokens`` (1.0 = none)."""
    model_summary: str
    """One line on the policy: trainable/total parameters and the memory features in force."""

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt from exactly ``prompts.prompt_ids``."""

    def compute_logprobs(self, rollout: RolloutBatch, role: Role) -> LogprobResult | None:
        """Per-response log-probs under the actor or the reference policy (None without one)."""

    def update(self, batch: TrainBatch, tracer: NullTracer = NullTracer()) -> dict[str, float]:
        """One update (all mini-batches and epochs); returns ``actor/*``, ``seqlen/*`` and
        ``bucket/*`` metrics. ``tracer`` times each update micro-batch (`NullTracer`: nothing)."""

    def save_checkpoint(self, run_dir: Path, step: int, trainer_state: dict) -> Path:
        """Write ``run_dir/checkpoints/step_N`` and return it."""

    def load_checkpoint(self, path: Path) -> dict:
        """Restore model and optimizer from ``path``; return its trainer state."""

    def close(self) -> None:
        """Release processes and devices (the Ray actors and process group of a distributed group)."""
