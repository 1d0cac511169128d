"""The worker group: the controller's side of the policy workers, one class for one process and for
data-parallel ranks alike.

The controller (the training loop's process) keeps the tokenizer and the data. It plans every
pass, sends each worker its part through a transport (`packrl.distributed.local.InProcess`: a
method call; `packrl.distributed.ray_group.RayActors`: Ray actors), and puts the results back in
input order:

    call               split                                           back in order by
    generate           prompts: karmarkar_karp on prompt + response    prompt position
                       budget (one rank: all); each prompt its seed
    compute_logprobs   sequences: `plan_ranks` under the log-prob      `RankPlan.restore`
                       budget (equal micro-batch counts)
    update             `plan_update`: per mini-batch, each rank's      -- (metrics merged)
                       micro-batches and the global denominators

A rollout whose multi-turn trajectories dropped turns from their context (the rolling window) is
scored and trained as step-wise samples (`packrl.seqlen.stepwise`): the log-prob passes run on the
samples and stitch the values back per trajectory, the update runs on the samples' batch. The loop
sees trajectories only, and calls these methods without knowing which transport runs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from packrl.algos.policy_losses import prepare_update
from packrl.config.plan import BatchPlan
from packrl.diagnostics.trace import NullTracer
from packrl.distributed.health import WorkerLost
from packrl.rollout.engine import SamplingParams
from packrl.seqlen.balance import karmarkar_karp
from packrl.seqlen.microbatch import GroupedCap
from packrl.seqlen.stepwise import StepSamples, step_samples
from packrl.seqlen.update_plan import UpdatePlan, groups_of
from packrl.types import ExtraInputs, PromptBatch, Response, RolloutBatch, TrainBatch, ValueEstimates
from packrl.worker.actor import ResponseSums, UpdateStats, update_metrics
from packrl.worker.critic import critic_metrics
from packrl.worker.policy import Role, WorkerInfo

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """How the controller reaches its workers."""

    num_ranks: int
    in_process: bool
    """True when the worker runs in this process (the tracer is passed to it directly)."""

    def call(self, method: str, args_per_rank: Sequence[tuple], ranks: Sequence[int] | None = None) -> list[Any]:
        """Call ``method`` on ``ranks`` (default ``0 .. len(args_per_rank) - 1``), the i-th with
        ``args_per_rank[i]``; wait for all and return their results in that order. A worker's
        exception is raised as itself."""

    def share(self, obj: Any) -> Any:
        """``obj`` in the form every rank's call may take (a Ray object reference, or itself)."""

    def trace_links(self) -> dict[str, str]:
        """Companion files of the trace (``{"ray_timeline": "ray_timeline.json"}``), named in trace.json."""

    def checkpoint_written(self) -> None:
        """Called after each checkpoint (Ray writes its timeline)."""

    def close(self, graceful: bool = True) -> None:
        """Release the workers (processes, process group)."""


@dataclass(frozen=True)
class LogprobResult:
    """Per-response log-probs (and entropy) with the plan that produced them.

    Attributes:
        logprobs: ``N`` tensors of Shape [R_i], float32, nats.
        entropy: ``N`` tensors of Shape [R_i], float32, nats.
        microbatches: the log-prob micro-batches that ran (sequence indices, or step-wise sample
            indices when the rollout was scored as samples; every rank's).
    """

    logprobs: tuple[torch.Tensor, ...]
    entropy: tuple[torch.Tensor, ...]
    microbatches: tuple[tuple[int, ...], ...] = ()


def draw_seeds(num_prompts: int) -> list[int]:
    """One sampling seed per prompt from torch's global RNG (the loop seeds it every step)."""
    return torch.randint(0, 1 << 62, (num_prompts,)).tolist()


class WorkerGroup:
    """The policy workers as the training loop sees them.

    Every pass is planned by one `packrl.seqlen.update_plan.PassPlanner` (``planner``), built from
    the run's `BatchPlan` and what the workers found at set-up; the group reads no other setting
    but the recipe's update (`BatchPlan.update`, whose loss section a policy loss's ``prepare`` takes).

    Args:
        plan: the run's derived sizes and budgets (`BatchPlan`), the one the workers were built with.
        tokenizer: the policy's tokenizer (decodes responses for rewards and dumps).
        transport: how the workers are reached.
        info: what the workers reported at set-up (`WorkerInfo`).
    """

    def __init__(self, *, plan: BatchPlan, tokenizer: Any, transport: Transport, info: WorkerInfo):
        self.plan, self.tokenizer, self.transport = plan, tokenizer, transport
        self.max_context_tokens, self.rope_factor, self.model_summary = info.max_context_tokens, info.rope_factor, info.model_summary
        self.packing = info.packing
        self.share_prompts = info.share_prompts
        # a call stopped on a condition of the whole call runs where the condition can be read: one rank, in this process
        one_call = transport.in_process and transport.num_ranks == 1
        self.capabilities = replace(info.capabilities, stop_on_condition=info.capabilities.stop_on_condition and one_call)
        self.planner = plan.planner(packed=info.packing.packs, share_prompts=info.share_prompts)
        self._linked = False

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks: each takes a share of every batch (a group of ``sequence_parallel_size`` workers)."""
        return self.plan.data_parallel_size

    def _spread(self, per_rank: Sequence[tuple]) -> list[tuple]:
        """Every worker's arguments: each data-parallel rank's go to all the workers of its sequence-parallel group."""
        return [args for args in per_rank for _ in range(self.plan.sequence_parallel_size)]

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt from exactly ``prompts.prompt_ids``. Every
        prompt's seed is drawn here, so the responses do not depend on the rank that generates
        them. A raising engine is retried once (`generate_with_retry`)."""
        groups = self.generate_ids(prompts.prompt_ids, params, draw_seeds(len(prompts)), prompts.rows, prompts.extra_inputs)
        return RolloutBatch(prompts, params.n, tuple(r for group in groups for r in group))

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                     rows: Sequence[int] = (), extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
        """``[B][G]`` responses to ``prompt_ids`` with the given per-prompt seeds, the prompts split
        over the data-parallel ranks by cost (prompt + response budget); ``rows`` (the data rows,
        for messages) may be empty; ``extra_inputs``: each prompt's inputs beyond its ids (its images).
        Retried once as `generate`."""
        size = self.plan.sequence_parallel_size
        return generate_split(prompt_ids, params, seeds, rows, self.num_ranks,  # one worker per data-parallel rank
                              lambda calls: self.transport.call("generate", calls, [r * size for r in range(len(calls))]),
                              extra_inputs=extra_inputs)

    def generate_until(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                       caps: Sequence[int], enough: Callable[[Sequence[bool]], bool]) -> list[Response]:
        """One response per prompt, each capped at ``caps[i]``, generation stopped between decode
        rounds once ``enough(finished)`` holds (`packrl.rollout.engine.InterruptibleEngine`); only
        where ``capabilities.stop_on_condition`` (one rank in this process, an engine that declares
        it: a stage checks before calling)."""
        assert self.capabilities.stop_on_condition, "a stage calls generate_until only where capabilities.stop_on_condition holds"
        return self.transport.call("generate_until", [(prompt_ids, params, seeds, caps, enough)])[0]

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The policy's current whole weights by name, on the CPU (every rank takes part)."""
        weights = [w for w in self.transport.call("export_weights", [()] * self.transport.num_ranks) if w is not None]
        assert len(weights) == 1, "exactly one writer rank returns the weights"
        return weights[0]

    def compute_logprobs(self, rollout: RolloutBatch, role: Role) -> LogprobResult | None:
        """Per-response log-probs under the actor or the reference, in sequence order; None when
        that pass does not run (no reference; the actor's when the update is on-policy)."""
        if (role == "ref" and not self.plan.has_reference) or (role == "actor" and not self.plan.needs_old_logprobs):
            return None
        size = self.plan.sequence_parallel_size
        steps = step_samples(rollout)
        scored = rollout if steps is None else steps.rollout
        ranks = self.planner.scoring(scored.sequence_lengths(), _prompts(scored), self._caps(scored))
        shared = self.transport.share(scored)
        results = self.transport.call("compute_logprobs", self._spread([(shared, role, p.microbatches) for p in ranks.ranks]))
        values = ranks.restore(results[::size])  # a sequence-parallel group's workers return the same values
        logprobs, entropy = tuple(lp for lp, _ in values), tuple(ent for _, ent in values)
        if steps is not None:
            lengths = [len(r.response_ids) for r in rollout.responses]
            logprobs, entropy = steps.stitch(logprobs, lengths), steps.stitch(entropy, lengths)
        return LogprobResult(logprobs, entropy, tuple(mb for p in ranks.ranks for mb in p.microbatches))

    def compute_values(self, rollout: RolloutBatch) -> ValueEstimates | None:
        """The critic's values of every response (`packrl.worker.critic.compute_values`), planned
        like the log-prob passes (``train.max_tokens_per_logprob_microbatch``); None without a critic."""
        if not self.plan.has_critic:
            return None
        steps = step_samples(rollout)
        scored = rollout if steps is None else steps.rollout
        ranks = self.planner.scoring(scored.sequence_lengths(), _prompts(scored), self._caps(scored))
        shared = self.transport.share(scored)
        size = self.plan.sequence_parallel_size
        values = ranks.restore(self.transport.call("compute_values", self._spread([(shared, p.microbatches) for p in ranks.ranks]))[::size])
        per_token, bootstrap = tuple(v for v, _ in values), [b for _, b in values]
        if steps is None:
            return ValueEstimates(per_token, torch.tensor(bootstrap, dtype=torch.float32))
        return ValueEstimates(steps.stitch(per_token, [len(r.response_ids) for r in rollout.responses]), steps.last_of(bootstrap))

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """One critic update on every rank, planned like the actor's under ``critic.max_tokens_per_microbatch``;
        returns ``critic/*`` metrics (`packrl.worker.critic.critic_metrics`), none without a critic."""
        if not self.plan.has_critic:
            return {}
        trained, plan, _ = self._planned(batch, critic=True)
        results = self.transport.call("update_critic", [(self.transport.share(trained), plan)] * self.transport.num_ranks)
        return critic_metrics(results)

    def _planned(self, batch: TrainBatch, critic: bool = False) -> tuple[TrainBatch, UpdatePlan, StepSamples | None]:
        """The batch an update trains (the step-wise samples' batch when turns were dropped,
        `packrl.seqlen.stepwise`), its plan (the actor's, or with ``critic`` the critic's budget),
        and the samples (None: whole responses)."""
        steps = step_samples(batch.rollout)
        if steps is None:
            return batch, self.plan_update(batch, critic=critic), None
        trained = steps.train_batch(batch)
        return trained, self.plan_update(trained, list(steps.prompt_of), list(steps.trajectory_of), critic=critic), steps

    def plan_update(self, batch: TrainBatch, groups: list[int] | None = None, units: list[int] | None = None,
                    critic: bool = False) -> UpdatePlan:
        """The step's `UpdatePlan` (`PassPlanner.update`): mini-batches of ``train.mini_batch_size``
        prompts, each split over the ranks under the actor's (or the critic's) micro-batch budget,
        with global denominators. ``groups`` / ``units``: the prompt and the trajectory of each
        sequence of a step-wise samples' batch; default: whole responses.

        Raises:
            ValueError: a sequence over the micro-batch budget (named by index).
        """
        groups = groups_of(len(batch.rollout), batch.rollout.group_size) if groups is None else groups
        return self.planner.update(batch.rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks], _prompts(batch.rollout),
                                   groups=groups, units=units, critic=critic, caps=self._caps(batch.rollout))

    def _caps(self, rollout: RolloutBatch) -> list[GroupedCap]:
        """The grouped caps of ``rollout``'s micro-batches (`PassPlanner.grouped_caps` over the
        loads its prompts' extra inputs report); none for a text rollout."""
        return self.planner.grouped_caps(*rollout.grouped_loads())

    def update(self, batch: TrainBatch, tracer: NullTracer = NullTracer(), step: int = 1) -> dict[str, float]:
        """One update (all mini-batches and epochs) of the recipe's `BatchPlan.update` on every
        rank; returns ``actor/*`` (the loss under `UpdateSpec.loss_metric`), ``seqlen/*`` and, for
        an update with ``rl_metrics``, ``bucket/*`` metrics (`update_metrics`), with several ranks
        ``seqlen/rank_imbalance`` (costliest rank over the mean, averaged over mini-batches), and
        for a rollout trained as step-wise samples ``seqlen/num_step_samples`` (sequences trained),
        where sequences without a loss token stayed out of the micro-batches `_left_out_metrics`,
        and the metrics of the policy loss's ``prepare`` (`packrl.algos.policy_losses.prepare_update`).
        At a ``step`` within ``critic.warmup_steps`` the actor does not train: ``{"critic/warmup": 1.0}``.
        ``tracer`` times each update micro-batch (`NullTracer`: nothing)."""
        if step <= self.plan.critic_warmup_steps:
            return {"critic/warmup": 1.0}  # only the critic trains yet (critic.warmup_steps)
        trained, plan, steps = self._planned(batch)
        # a loss that chooses tokens over whole mini-batches (Clip-Cov, KL-Cov) does it here, once,
        # seeded by the step's seed (the loop reseeds torch every step)
        trained, prepared = prepare_update(trained, [mb.sequences for mb in plan.minibatches], self.plan.update.algorithm,
                                           torch.initial_seed())
        shared = self.transport.share(trained)
        own = tracer if self.transport.in_process else None
        results = self.transport.call("update", [(shared, plan, own)] * self.transport.num_ranks)
        if steps is not None:  # per-sample sums -> per trajectory, for the length-bucket metrics
            results = [(_folded(stats, steps.fold), spans) for stats, spans in results]
        for rank, (_, spans) in enumerate(results):
            if spans:
                tracer.add_worker_spans(rank, spans)
        if not self._linked:
            for key, name in self.transport.trace_links().items():
                tracer.link(key, name)
            self._linked = True
        metrics = update_metrics([stats for stats, _ in results], batch, self.plan.max_response_tokens,
                                 buckets=self.plan.update.rl_metrics) | prepared
        metrics |= {"seqlen/rank_imbalance": plan.imbalance()} if self.num_ranks > 1 else {}
        metrics |= {"seqlen/num_step_samples": float(len(trained.rollout))} if steps is not None else {}
        metrics |= _left_out_metrics(plan, trained)
        return metrics | ({"seqlen/sequence_parallel_size": float(self.plan.sequence_parallel_size)}
                          if self.plan.sequence_parallel_size > 1 else {})

    def save_checkpoint(self, run_dir: Path, step: int, trainer_state: dict) -> Path:
        """Write ``run_dir/checkpoints/step_N`` and return it."""
        paths = self.transport.call("save_checkpoint", [(str(run_dir), step, trainer_state)] * self.transport.num_ranks)
        self.transport.checkpoint_written()
        return Path(paths[0])

    def load_checkpoint(self, path: Path) -> dict:
        """Restore model and optimizer from ``path`` on every rank; return its trainer state.

        Raises:
            ValueError: a file of ``path`` is missing, unreadable or does not fit the model (named).
        """
        return self.transport.call("load_checkpoint", [(str(path),)] * self.transport.num_ranks)[0]

    def close(self, graceful: bool = True) -> None:
        """Release the workers; ``graceful=False`` after a failure (a rank may be inside a collective)."""
        self.transport.close(graceful)


def _prompts(rollout: RolloutBatch) -> list[tuple[int, ...]]:
    """Each sequence's prompt ids (what `PassPlanner` shares)."""
    return [rollout.prompt_ids_of(i) for i in range(len(rollout))]


def _left_out_metrics(plan: UpdatePlan, trained: TrainBatch) -> dict[str, float]:
    """``seqlen/update_left_out_sequences`` and ``seqlen/update_left_out_tokens``: the sequences
    the update did not pack, forward or back-propagate (no loss token: GFPO's filtered responses,
    masked truncations, rejected responses; `packrl.seqlen.update_plan.trained_sequences`) and
    their prompt + response tokens, per step (not per epoch); none when every sequence trained."""
    left_out = plan.left_out()
    if not left_out:
        return {}
    lengths = trained.rollout.sequence_lengths()
    return {"seqlen/update_left_out_sequences": float(len(left_out)),
            "seqlen/update_left_out_tokens": float(sum(lengths[i] for i in left_out))}


def _folded(stats: UpdateStats, fold: Callable) -> UpdateStats:
    """``stats`` with its per-sample `ResponseSums` added up per trajectory (``fold``)."""
    sums = stats.sums
    return replace(stats, sums=ResponseSums(fold(sums.entropy), fold(sums.clipped), fold(sums.kl), fold(sums.num_tokens)))


def generate_split(prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int], rows: Sequence[int],
                   num_parts: int, call: Callable[[list[tuple]], list],
                   extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
    """``[B][G]`` responses to ``prompt_ids``, the prompts split into at most ``num_parts`` parts of
    even cost (prompt + response budget, `karmarkar_karp`); ``call(args)`` runs part k's
    ``(prompt_ids, params, seeds)`` = ``args[k]`` (with ``extra_inputs``, each part's as a fourth
    argument) on its own generator and returns each part's ``[b][G]`` responses. Retried once
    (`generate_with_retry`)."""
    costs = [len(p) + params.max_response_tokens for p in prompt_ids]
    parts = [sorted(p) for p in karmarkar_karp(costs, min(num_parts, len(costs))) if p]

    def run() -> list:
        out: list = [None] * len(costs)
        extra = extra_inputs if extra_inputs is not None and any(x is not None for x in extra_inputs) else None
        results = call([([prompt_ids[i] for i in part], params, [seeds[i] for i in part])
                        + (([extra[i] for i in part],) if extra is not None else ()) for part in parts])
        for part, groups in zip(parts, results):
            for i, group in zip(part, groups):
                out[i] = group
        return out

    return generate_with_retry(run, rows)


def generate_with_retry(generate: Callable[[], list], rows: Sequence[int]) -> list:
    """``generate()``, retried once when it raises anything but a ValueError (a bad prompt is not
    retried) or a `WorkerLost` (a lost actor does not come back; the run's supervisor restarts the
    group); a second failure is a RuntimeError naming the batch's data rows and the cause."""
    try:
        return generate()
    except (ValueError, WorkerLost):
        raise
    except Exception as err:  # noqa: BLE001 - engine failures (OOM, a driver hiccup) get one more try
        logger.warning("generation raised %s: %s; retrying once", type(err).__name__, err)
        try:
            return generate()
        except WorkerLost:
            raise
        except Exception as again:
            raise RuntimeError(f"generation failed twice for data rows {list(rows)[:16]}: "
                               f"{type(again).__name__}: {again}") from again
