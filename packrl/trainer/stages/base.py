"""The contract of a sampling stage and of what it generates with.

Shapes: ``B`` prompts · ``G`` responses per prompt · ``N = B*G``; response i answers prompt ``i // G``.

A stage is what the loop calls once per step for its scored rollout (`SamplingStage`). It is built
by a factory registered under a ``trainer.rollout_mode`` name (`packrl.registry.ROLLOUT_MODES`)
from a `StageContext`, and it generates through a `Generator`: the worker group's engines, or the
rollout workers of ``separate_async`` (`packrl.distributed.rollout_pool.RolloutPool`). Stopping a
generation call on a condition of the whole call is a capability a generator declares
(`Generator.capabilities`, `packrl.capabilities.EngineCapabilities.stop_on_condition`), with
the method in `InterruptibleGenerator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from packrl.diagnostics.timers import Span
from packrl.rollout.engine import EngineCapabilities, SamplingParams
from packrl.types import ExtraInputs, Response, RolloutBatch, ScoredBatch

if TYPE_CHECKING:
    from packrl.config.schema import RunConfig
    from packrl.data.dataset import PromptSampler
    from packrl.distributed.group import WorkerGroup

Sampled = tuple[RolloutBatch, ScoredBatch, dict[str, float]]
"""(rollout, scored rollout, ``train/*`` or ``async/*`` sampling metrics) of one step; ``scored.rollout is rollout``."""


class Generator(Protocol):
    """What a stage generates with.

    Attributes:
        capabilities: what its engines can do (``modalities``; ``stop_on_condition``: it is an
            `InterruptibleGenerator` and may stop a call on a condition of the whole call).
    """

    capabilities: EngineCapabilities

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                     rows: Sequence[int] = (), extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
        """``[B][G]`` responses to ``prompt_ids`` with the given per-prompt seeds (`packrl.rollout.engine.RolloutEngine.generate`);
        ``rows``: the data rows (for messages), may be empty; ``extra_inputs``: each prompt's inputs beyond its ids."""
        ...


class InterruptibleGenerator(Generator, Protocol):
    """A generator that can stop a call between decode rounds (`packrl.rollout.engine.InterruptibleEngine`)."""

    def generate_until(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                       caps: Sequence[int], enough: Callable[[Sequence[bool]], bool]) -> list[Response]:
        """One response per prompt, each capped at ``caps[i]`` tokens, the call stopped once ``enough(finished)``."""
        ...


@runtime_checkable
class SamplingStage(Protocol):
    """What the loop calls once per step (`packrl.trainer.loop`)."""

    def __call__(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int) -> Sampled:
        """Step ``step``'s scored rollout; generation and scoring time add to ``timing["gen"]`` and ``timing["reward"]``."""

    def state_dict(self) -> dict[str, Any]:
        """What the stage carries between steps (JSON-serialisable; saved with each checkpoint)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` on resume."""

    def close(self) -> None:
        """Release what the stage holds (rollout workers of its own)."""


@dataclass(frozen=True)
class StageContext:
    """What a stage factory gets.

    Attributes:
        cfg: the run's config (a stage reads ``data.batch_size``, ``rollout``, ``reward`` and its
            own keys; ``separate_async`` makes its rollout workers' `RolloutWorkerSpec` from it,
            `packrl.distributed.rollout_pool`).
        sampler: the run's prompt sampler (every drawn prompt comes from it, so the checkpointed
            sampler position covers what the stage drew).
        workers: the worker group: the default `Generator`, the tokenizer, the plan, the policy's
            weights (`WorkerGroup.export_weights`) and the model context.
        run_dir: RUN_DIR (a stage's processes keep their files there).
    """

    cfg: RunConfig
    sampler: PromptSampler
    workers: WorkerGroup
    run_dir: Path


StageFactory = Callable[[StageContext], SamplingStage]
"""``factory(context) -> stage``, registered in `packrl.registry.ROLLOUT_MODES`."""


def no_carried_state(state: dict[str, Any], mode: str) -> None:
    """Refuse a checkpoint of a mode that carries prompt groups, on resume in a mode that does not.

    Raises:
        ValueError: ``state`` carries partial groups or drawn prompts, which ``mode`` would never train.
    """
    if state.get("pool") or state.get("queue"):
        raise ValueError(f"the checkpoint carries {len(state.get('pool', []))} partial prompt groups and "
                         f"{len(state.get('queue', []))} drawn prompts of a partial-rollout run, which "
                         f"trainer.rollout_mode={mode} would never train; resume with the trainer.rollout_mode it was "
                         "trained with (colocate_async or separate_async)")
