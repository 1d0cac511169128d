"""The disaggregated partial-rollout stage (``trainer.rollout_mode=separate_async``): rollout workers
on their own Ray processes generate step s+1's batch while the trainer updates on step s.

A step s (the trainer's weights are version s, after update s-1):

1. waits for the prefetch that started at the end of step s-1 (its time is
   ``timing_s/rollout_wait``: the trainer idle, waiting for generation);
2. pushes version s to every rollout worker (``timing_s/weight_sync``: the cost of a switch);
3. generates what step s still lacks, if anything, with version s (`PartialRolloutStage.step`)
   and takes its batch, the oldest complete groups;
4. tops the pool up (on this thread: the sampler and the ledger have one writer) and starts the
   prefetch: chunks with version s, on a background thread, until step s+1's batch is complete
   (``data.batch_size`` groups and every group at step s+1's staleness bound).

The step's ``async/carried_*`` and ``async/ledger_*`` are read after the top-up: the groups and
the ledger its checkpoint holds (a checkpoint is written after the step's update, once the
prefetch has ended). The checkpoint's members also hold the prefetch's tokens, generated while the
metrics are logged; the next step counts them in its ``async/generated_tokens``, so the
checkpoint's pool tokens are the step's ``async/carried_tokens`` plus the prefetch's tokens
(its ``pending`` counts).

The loop then computes the old log-probs and updates the trainer on step s while the prefetch
generates. ``async/rollout_busy_s`` is how long the prefetch generated, ``async/rollout_idle_s`` how
long the rollout workers then waited for the trainer. Every trained token is at least one update old, and the behaviour weights of decoupled
PPO correct it. The prefetch's stopping point depends on the pool alone, not on timing, so a
checkpoint (which first waits for the prefetch, `state_dict`) is a consistent cut: a run killed
and resumed trains what the uninterrupted run trains.

After verl's one-step-off and fully-async trainers (a rollouter and a trainer on separate
devices, partial rollouts) and AReaL (arXiv 2505.24298).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from packrl.config.schema import RunConfig
from packrl.data.dataset import PromptSampler
from packrl.diagnostics.timers import Span, stage_timer
from packrl.distributed.rollout_pool import RolloutPool, rollout_pool
from packrl.rollout.engine import SamplingParams
from packrl.trainer.partial_rollout import PartialRolloutStage, Sampled, empty_counts


class SeparateRolloutStage(PartialRolloutStage):
    """`PartialRolloutStage` whose engines are a `RolloutPool`, with the next batch prefetched.

    Args:
        cfg, sampler, workers: as `PartialRolloutStage`; ``workers`` also gives the weights
            (``export_weights``) and the model context.
        run_dir: RUN_DIR (a private local Ray keeps its files there).
        pool: the rollout workers (default: started from ``cfg``, `rollout_pool`).
    """

    def __init__(self, cfg: RunConfig, sampler: PromptSampler, workers: Any, run_dir: Any, pool: RolloutPool | None = None) -> None:
        super().__init__(cfg, sampler, workers)
        self.engines = pool if pool is not None else rollout_pool(cfg, run_dir, workers.plan, workers.max_context_tokens)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending = empty_counts()  # what the prefetch generated for the next step
        self._busy_s = 0.0
        self._ended: float | None = None  # when the last prefetch finished (perf_counter)

    def __call__(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int) -> Sampled:
        arrived = time.perf_counter()
        with stage_timer(timing, "rollout_wait", spans):
            self._join()
        idle = 0.0 if self._ended is None else max(0.0, arrived - self._ended)  # the workers waited for the trainer
        with stage_timer(timing, "weight_sync", spans):
            self.engines.sync_weights(self.workers.export_weights())
        counts, self._pending = self._pending, empty_counts()
        rollout, scored, metrics = self.step(sampling, timing, spans, step, counts)
        metrics |= {"async/rollout_busy_s": self._busy_s, "async/rollout_idle_s": idle}
        self.fill(sampling, step)
        metrics |= self.carried_metrics()  # after the top-up: the groups and ledger this step's checkpoint holds
        self._thread = threading.Thread(target=self._prefetch, args=(sampling, step), name="packrl-prefetch", daemon=True)
        self._thread.start()
        return rollout, scored, metrics

    def _prefetch(self, sampling: SamplingParams, version: int) -> None:
        start = time.perf_counter()
        try:
            self.generate(sampling, target=version + 1, version=version, counts=self._pending)
        except BaseException as err:  # noqa: BLE001 - raised on the controller's thread at the next join
            self._error = err
        self._ended = time.perf_counter()
        self._busy_s = self._ended - start

    def _join(self) -> None:
        """Wait for the prefetch; re-raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def state_dict(self) -> dict[str, Any]:
        """The consistent cut: waits for the prefetch, then the pool, queue, ledger and what the
        prefetch generated for the next step."""
        self._join()
        return super().state_dict() | {"pending": dict(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._pending = empty_counts() | state.get("pending", {})

    def close(self) -> None:
        """Wait for the prefetch (its error, if any, is not raised again) and stop the rollout workers."""
        try:
            if self._thread is not None:
                self._thread.join()
        finally:
            self.engines.close()
