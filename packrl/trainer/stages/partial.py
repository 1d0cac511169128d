"""The colocated partial-rollout stage (``trainer.rollout_mode=colocate_async``): a step stops
generating once ``data.batch_size`` prompt groups are complete and carries the rest to later steps.

At real budgets response lengths are long-tailed, so a synchronous step spends most of its
generation time decoding a few long rows while the batch sits finished. Here a step (version v):

1. fills its pool: groups carried from earlier steps (oldest first), then fresh prompts, up to
   ``data.batch_size + rollout.over_provision`` groups; a fresh group's response budget and cap
   are fixed now (`packrl.trainer.stages.pool.RolloutGroup.dispatch_budget`, ``dispatch_cap``);
2. generates until ``data.batch_size`` groups are complete and every group at
   ``rollout.max_staleness`` is complete (``wait``; with ``drop`` those still unfinished are
   dropped, counted with their lengths): where the generator can stop a call on a condition
   (`packrl.trainer.stages.base.InterruptibleGenerator`: the HF engine on one in-process rank) in
   one call stopped between decode rounds (`PartialRollouts._until`); otherwise in chunks of
   ``rollout.partial_chunk_tokens`` per member, each chunk one ``generate`` call of prompt + the
   member's tokens so far, re-prefilled under the current weights, for its grant: at most what is
   left of its cap (`RolloutGroup.chunk_grant`, `PartialRollouts._chunk`);
3. trains the ``data.batch_size`` oldest complete groups (by draw order); complete surplus groups
   and unfinished ones stay in the pool, their segments kept with the version that sampled them.

With unchanged weights a resumed member draws the tokens it would have drawn uninterrupted (the HF
engine keys its noise by seed and position). The loss weights carried tokens by pi_old /
pi_behaviour (`packrl.algos.rollout_correction.apply_behaviour_weights`). The pool, the queue of
drawn prompts and the ledger are the stage's state, saved in the checkpoint with the weights
(`state_dict`), so a resumed run trains the same prompts in the same groups, once each. A trained
group's responses are scored against its dispatch budget (`packrl.types.PromptBatch.response_budgets`),
the budget that cut them, even when a length curriculum has moved on since.

`PartialRollouts` is the pool and what fills it, over any `packrl.trainer.stages.base.Generator`;
`PartialRolloutStage` (``colocate_async``) generates with the worker group's engines, and
``separate_async`` (`packrl.trainer.stages.separate`) composes the same pool with rollout workers
of its own.

Design after verl's ``colocate_async`` (partial rollout, oldest-first consumption, ``wait``) and
AReaL (arXiv 2505.24298: interruptible generation, decoupled PPO); the chunked continuation is
verl PR #1826's engine-agnostic fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from packrl.config.rollout_modes import default_over_provision
from packrl.config.schema import RolloutConfig
from packrl.data.dataset import PromptSampler
from packrl.diagnostics.timers import Span, stage_timer
from packrl.distributed.group import draw_seeds
from packrl.registry import ROLLOUT_MODES
from packrl.reward.score import score_rollout
from packrl.rollout.engine import SamplingParams, single_sample_seed
from packrl.trainer.stages.base import Generator, InterruptibleGenerator, Sampled, StageContext
from packrl.trainer.stages.pool import DROPPED, IN_FLIGHT, TRAINED, Ledger, Member, RolloutGroup
from packrl.types import FinishReason, PromptBatch, Response, RolloutBatch


class PartialRollouts:
    """The pool of prompt groups in flight and what fills it, over a `Generator`.

    Args:
        batch_size: prompt groups a step trains (``data.batch_size``).
        rollout: the ``rollout`` section (``n``, the partial-rollout keys, ``engine`` for messages).
        sampler: the run's prompt sampler.
        generator: what generates (the worker group, or ``separate_async``'s rollout workers).
        max_context_tokens: the model context, in tokens (a group's cap fits it).
    """

    def __init__(self, batch_size: int, rollout: RolloutConfig, sampler: PromptSampler, generator: Generator,
                 max_context_tokens: int) -> None:
        self.batch_size, self.rollout = batch_size, rollout
        over = rollout.over_provision
        self.over_provision = default_over_provision(batch_size) if over is None else over
        self.sampler, self.generator, self.max_context_tokens = sampler, generator, max_context_tokens
        self.groups: list[RolloutGroup] = []  # the pool: groups in flight (dispatched, not yet trained or dropped)
        self.queue: list[dict[str, Any]] = []  # drawn, not yet dispatched: prompt fields + uid
        self.ledger = Ledger()

    def take(self, step: int, must_finish: set[int], counts: dict[str, float]) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch: under ``drop`` the stale unfinished groups leave first; the
        ``data.batch_size`` oldest complete groups leave the pool, marked trained. Returns the
        rollout and the step's ``async/*`` metrics (the pool as it is after the take)."""
        dropped = [] if self.rollout.stale_groups == "wait" else self._drop(must_finish, step)
        trained = sorted((g for g in self.groups if g.complete), key=lambda g: g.uid)[: self.batch_size]
        taken = {g.uid for g in trained}
        self.groups = [g for g in self.groups if g.uid not in taken]
        for g in trained:
            self.ledger.mark(g.uid, TRAINED, step)
        rollout = _rollout_of(trained, self.rollout.n, step)
        return rollout, self._metrics(rollout, step, counts, len(must_finish), dropped)

    def generate(self, sampling: SamplingParams, *, target: int, version: int, counts: dict[str, float]) -> set[int]:
        """Generate (tokens tagged ``version``) until step ``target``'s batch is complete:
        ``data.batch_size`` complete groups and, under ``wait``, every group at the staleness bound
        of ``target``. Returns the uids at that bound."""
        must_finish = {g.uid for g in self.groups if g.staleness(target) >= self.rollout.max_staleness}
        wait = self.rollout.stale_groups == "wait"
        if not self._enough(must_finish if wait else set()) and self.generator.capabilities.stop_on_condition:
            self._until(sampling, version, counts, must_finish if wait else set())
        while not self._enough(must_finish if wait else set()):  # generators that cannot stop a call on a condition: chunks
            before = (counts["generated_tokens"], self._num_finished())
            self._chunk(sampling, version, counts, only=must_finish if self._num_complete() >= self.batch_size else None)
            if (counts["generated_tokens"], self._num_finished()) == before:
                raise RuntimeError(f"rollout.engine={self.rollout.engine} returned no tokens for {len(self.groups)} unfinished "
                                   "prompt groups and finished none; the engine must honour SamplingParams.max_response_tokens")
        return must_finish

    def fill(self, sampling: SamplingParams, step: int) -> None:
        """Top the pool up with fresh groups to batch + over-provision; each group's response
        budget is the step's (``sampling.max_response_tokens``) and its cap fits the context."""
        draws: list[dict[str, Any]] = []
        while len(self.groups) + len(draws) < self.batch_size + self.over_provision:
            if not self.queue:
                batch = self.sampler.next_batch()
                self.queue = [{"uid": self.ledger.draw(), "prompt_ids": tuple(batch.prompt_ids[i]), "ground_truth": batch.ground_truths[i],
                               "data_source": batch.data_sources[i], "row": batch.rows[i], "prompt_truncated": batch.prompt_truncated[i],
                               "length_target": None if batch.length_targets is None else batch.length_targets[i],
                               "length_mode": None if batch.length_modes is None else batch.length_modes[i]}
                              for i in range(len(batch))]
            draws.append(self.queue.pop(0))
        budget = sampling.max_response_tokens
        for prompt, seed in zip(draws, draw_seeds(len(draws))):
            cap = min(budget, self.max_context_tokens - len(prompt["prompt_ids"]))
            reason: FinishReason = "length" if cap == budget else "context"
            self.groups.append(RolloutGroup(**prompt, seed=seed, dispatch_step=step, dispatch_budget=budget, dispatch_cap=cap,
                                          cap_reason=reason, members=(Member(),) * self.rollout.n))
            self.ledger.mark(prompt["uid"], IN_FLIGHT)

    def _num_finished(self) -> int:
        return sum(m.finished for g in self.groups for m in g.members)

    def _num_complete(self) -> int:
        return sum(g.complete for g in self.groups)

    def _enough(self, must_finish: set[int]) -> bool:
        complete = {g.uid for g in self.groups if g.complete}
        return len(complete) >= min(self.batch_size, len(self.groups)) and must_finish <= complete

    def _until(self, sampling: SamplingParams, version: int, counts: dict[str, float], must_finish: set[int]) -> None:
        """Every unfinished member in one call that stops between decode rounds once the batch is
        complete (`InterruptibleGenerator.generate_until`, each member capped at what is left of its
        dispatch cap): members still running come back cut (``abort``) and are carried, none
        re-prefilled within the step."""
        members = [(g, m) for g in self.groups for m, member in enumerate(g.members) if not member.finished]
        if not members:
            return
        done_before = {g.uid for g in self.groups if g.complete}
        slots: dict[int, list[int]] = {}
        for i, (g, _) in enumerate(members):
            slots.setdefault(g.uid, []).append(i)

        def enough(finished: Sequence[bool]) -> bool:
            complete = done_before | {uid for uid, idx in slots.items() if all(finished[i] for i in idx)}
            return len(complete) >= self.batch_size and must_finish <= complete

        prompts = [g.prompt_ids + g.members[m].token_ids for g, m in members]
        out = cast(InterruptibleGenerator, self.generator).generate_until(
            prompts, sampling, [single_sample_seed(g.seed, m) for g, m in members],
            [g.members[m].tokens_left(g.dispatch_cap) for g, m in members], enough)
        index = {g.uid: k for k, g in enumerate(self.groups)}
        counts["reprefill_tokens"] += sum(len(p) for p, (g, _) in zip(prompts, members) if len(p) > len(g.prompt_ids))
        for (g, m), response in zip(members, out):
            self._extend(index[g.uid], m, response, version, counts)
        counts["chunks"] += 1

    def _chunk(self, sampling: SamplingParams, step: int, counts: dict[str, float], only: set[int] | None) -> None:
        """One generation call per distinct chunk grant (`RolloutGroup.chunk_grant`; ``n=1`` per
        member: prompt + the member's tokens, sampled as its sample of the group's seed,
        `single_sample_seed`); a fresh group's members stay adjacent, so an engine that prefills
        a repeated prompt once still does."""
        index = {g.uid: k for k, g in enumerate(self.groups)}
        by_grant: dict[int, list[tuple[int, int]]] = {}  # tokens granted -> (uid, member)
        for g in self.groups:
            if only is None or g.uid in only:
                for m, member in enumerate(g.members):
                    if not member.finished:
                        by_grant.setdefault(g.chunk_grant(m, self.rollout.partial_chunk_tokens), []).append((g.uid, m))
        for grant, members in sorted(by_grant.items()):
            groups = [self.groups[index[uid]] for uid, _ in members]
            prompts = [g.prompt_ids + g.members[m].token_ids for g, (_, m) in zip(groups, members)]
            call = sampling.continuation(grant)
            seeds = [single_sample_seed(g.seed, m) for g, (_, m) in zip(groups, members)]
            out = self.generator.generate_ids(prompts, call, seeds, [g.row for g in groups])
            counts["reprefill_tokens"] += sum(len(p) for p, g in zip(prompts, groups) if len(p) > len(g.prompt_ids))
            for (uid, m), responses in zip(members, out):
                self._extend(index[uid], m, responses[0], step, counts)
        counts["chunks"] += 1

    def _extend(self, k: int, m: int, response: Response, step: int, counts: dict[str, float]) -> None:
        group = self.groups[k]
        self.groups[k] = group.with_member(m, group.members[m].extended(response, step, group.dispatch_cap, group.cap_reason))
        counts["generated_tokens"] += len(response.response_ids)

    def _drop(self, stale: set[int], step: int) -> list[RolloutGroup]:
        """``stale_groups=drop``: groups at the staleness bound still unfinished leave the pool."""
        dropped = [g for g in self.groups if g.uid in stale and not g.complete]
        for g in dropped:
            self.ledger.mark(g.uid, DROPPED, step, "stale")
        self.groups = [g for g in self.groups if g not in dropped]
        return dropped

    def _metrics(self, rollout: RolloutBatch, step: int, counts: dict[str, float], num_must_finish: int,
                 dropped: Sequence[RolloutGroup]) -> dict[str, float]:
        """The ``async/*`` metrics of the step (docs/metrics.md)."""
        staleness = [[step - v for v in (r.token_versions or ())] for r in rollout.responses]
        tokens = [s for row in staleness for s in row]
        worst = [max(row) for row in staleness if row]
        out = {
            "async/staleness_token_mean": sum(tokens) / max(1, len(tokens)), "async/staleness_token_max": float(max(tokens, default=0)),
            "async/staleness_trajectory_mean": sum(worst) / max(1, len(worst)),
            "async/partial_ratio": sum(1 for row in staleness if row and max(row) > 0) / max(1, len(staleness)),
            "async/reprefill_tokens": float(counts["reprefill_tokens"]), "async/generated_tokens": float(counts["generated_tokens"]),
            "async/num_chunks": float(counts["chunks"]), "async/must_finish_groups": float(num_must_finish),
            "async/dropped_groups": float(len(dropped)),
            "async/dropped_tokens_mean": sum(g.num_tokens for g in dropped) / max(1, len(dropped) * self.rollout.n),
        }
        return out | self.carried_metrics()

    def carried_metrics(self) -> dict[str, float]:
        """What the stage holds now, as its checkpoint (`state_dict`) would hold it: the pool
        (``async/carried_groups``, ``_tokens``, ``_complete_groups``) and the ledger's counts
        (``async/ledger_*``)."""
        ledger = self.ledger.counts()
        return {"async/carried_groups": float(len(self.groups)), "async/carried_tokens": float(sum(g.num_tokens for g in self.groups)),
                "async/carried_complete_groups": float(self._num_complete())} | {f"async/ledger_{k}": float(v) for k, v in ledger.items()}

    def state_dict(self) -> dict[str, Any]:
        """The pool, the drawn queue and the ledger, JSON-serialisable."""
        queue = [{**p, "prompt_ids": list(p["prompt_ids"])} for p in self.queue]
        return {"pool": [g.to_dict() for g in self.groups], "queue": queue, "ledger": self.ledger.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (an empty mapping: a checkpoint of a ``sync`` run, nothing carried).

        Raises:
            ValueError: the state holds groups of another group size (``rollout.n`` changed), or
                groups whose response cap exceeds ``rollout.max_response_tokens`` (lowered since).
        """
        if not state:
            return
        pool = [RolloutGroup.from_dict(g) for g in state["pool"]]
        sizes = sorted({len(g.members) for g in pool} - {self.rollout.n})
        if sizes:
            raise ValueError(f"the checkpoint carries prompt groups of {sizes[0]} responses, not rollout.n={self.rollout.n}; "
                             f"resume with rollout.n={sizes[0]}")
        caps = max((g.dispatch_cap for g in pool), default=0)
        if caps > self.rollout.max_response_tokens:
            raise ValueError(f"the checkpoint carries partial groups with a {caps}-token response cap, above "
                             f"rollout.max_response_tokens={self.rollout.max_response_tokens}: their responses could outgrow "
                             f"this run's budgets; resume with rollout.max_response_tokens>={caps}")
        self.groups = pool
        self.queue = [{**p, "prompt_ids": tuple(p["prompt_ids"])} for p in state["queue"]]
        self.ledger = Ledger.from_dict(state["ledger"])


def empty_counts() -> dict[str, float]:
    """What a step generated: re-prefilled and generated tokens, engine call rounds."""
    return {"reprefill_tokens": 0, "chunks": 0, "generated_tokens": 0}


def _rollout_of(groups: Sequence[RolloutGroup], group_size: int, step: int) -> RolloutBatch:
    """The trained groups as a rollout of step ``step``: each prompt with its dispatch budget."""
    prompts = PromptBatch(tuple(g.prompt_ids for g in groups), tuple(g.ground_truth for g in groups),
                          tuple(g.data_source for g in groups), tuple(g.row for g in groups), tuple(g.prompt_truncated for g in groups),
                          response_budgets=tuple(g.dispatch_budget for g in groups),
                          length_targets=(tuple(g.length_target or 0 for g in groups)
                                          if any(g.length_target is not None for g in groups) else None),
                          length_modes=(tuple(g.length_mode or "exact" for g in groups)
                                        if any(g.length_mode is not None for g in groups) else None))
    responses = tuple(m.response() for g in groups for m in g.members)
    return RolloutBatch(prompts, group_size, responses, policy_version=step)


class PartialRolloutStage:
    """The sampling stage of ``colocate_async`` (`packrl.trainer.stages.base.SamplingStage`): the
    pool generated with the worker group's engines, in this process's steps.

    Args:
        context: the stage's `StageContext` (``data.batch_size``, the ``rollout`` and ``reward``
            sections, the sampler, the worker group).
    """

    def __init__(self, context: StageContext) -> None:
        cfg, workers = context.cfg, context.workers
        self.pool = PartialRollouts(cfg.data.batch_size, cfg.rollout, context.sampler, workers, workers.max_context_tokens)
        self.reward, self.tokenizer = cfg.reward, workers.tokenizer

    def __call__(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int) -> Sampled:
        counts = empty_counts()
        with stage_timer(timing, "gen", spans):
            self.pool.fill(sampling, step)
            must_finish = self.pool.generate(sampling, target=step, version=step, counts=counts)
            rollout, metrics = self.pool.take(step, must_finish, counts)
        with stage_timer(timing, "reward", spans):
            scored = score_rollout(rollout, self.tokenizer, self.reward, sampling.max_response_tokens, step=step)
        return rollout, scored, metrics

    def state_dict(self) -> dict[str, Any]:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release: the worker group's engines belong to the group."""


@ROLLOUT_MODES.register("colocate_async")
def colocate_async_stage(context: StageContext) -> PartialRolloutStage:
    """The ``colocate_async`` mode (`PartialRolloutStage`)."""
    return PartialRolloutStage(context)
