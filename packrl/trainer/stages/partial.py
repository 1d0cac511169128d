"""The colocated partial-rollout stage (``trainer.rollout_mode=colocate_async``): a step stops
generating once ``data.batch_size`` prompt groups are complete and carries the rest to later steps.

At real budgets response lengths are long-tailed, so a synchronous step spends most of its
generation time decoding a few long rows while the batch sits finished. Here a step (version v):

1. fills its pool: groups carried from earlier steps (oldest first), then fresh prompts, up to
   ``data.batch_size + rollout.over_provision`` groups; a fresh group's response cap is fixed now
   (`packrl.rollout.partial.RolloutGroup.cap`);
2. generates until ``data.batch_size`` groups are complete and every group at
   ``rollout.max_staleness`` is complete (``wait``; with ``drop`` those still unfinished are
   dropped, counted with their lengths): with the HF engine on one in-process rank in one call
   stopped between decode rounds (`_until`); otherwise in chunks of ``rollout.partial_chunk_tokens``
   per member, each chunk one ``generate`` call of prompt + the member's tokens so far,
   re-prefilled under the current weights, for at most what is left of its cap (`_chunk`);
3. trains the ``data.batch_size`` oldest complete groups (by draw order); complete surplus groups
   and unfinished ones stay in the pool, their segments kept with the version that sampled them.

With unchanged weights a resumed member draws the tokens it would have drawn uninterrupted (the HF
engine keys its noise by seed and position). The loss weights carried tokens by pi_old /
pi_behaviour (`packrl.algos.rollout_correction.apply_behaviour_weights`). The pool, the queue of
drawn prompts and the ledger are the stage's state, saved in the checkpoint with the weights
(`state_dict`), so a resumed run trains the same prompts in the same groups, once each.

Design after verl's ``colocate_async`` (partial rollout, oldest-first consumption, ``wait``) and
AReaL (arXiv 2505.24298: interruptible generation, decoupled PPO); the chunked continuation is
verl PR #1826's engine-agnostic fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from packrl.config.schema import RunConfig
from packrl.data.dataset import PromptSampler
from packrl.diagnostics.timers import Span, stage_timer
from packrl.reward.score import score_rollout
from packrl.rollout.engine import SamplingParams, single_sample_seed
from packrl.rollout.partial import DROPPED, IN_FLIGHT, TRAINED, Ledger, Member, RolloutGroup
from packrl.types import FinishReason, PromptBatch, Response, RolloutBatch

Sampled = tuple[RolloutBatch, Any, dict[str, float]]


class PartialRolloutStage:
    """The sampling stage of ``colocate_async`` (`packrl.trainer.sampling.SamplingStage`).

    Args:
        cfg: the run's config (``data.batch_size``, the ``rollout`` async keys, ``reward``).
        sampler: the run's prompt sampler.
        workers: the worker group (``generate_ids``, ``tokenizer``, ``max_context_tokens``).
    """

    def __init__(self, cfg: RunConfig, sampler: PromptSampler, workers: Any) -> None:
        self.batch_size, self.rollout, self.reward = cfg.data.batch_size, cfg.rollout, cfg.reward
        over = cfg.rollout.over_provision
        self.over_provision = max(1, self.batch_size // 4) if over is None else over
        self.sampler, self.workers = sampler, workers
        self.engines: Any = workers  # what generates: the worker group's engines (a separate pool in separate_async)
        self.pool: list[RolloutGroup] = []
        self.queue: list[dict[str, Any]] = []  # drawn, not yet dispatched: prompt fields + uid
        self.ledger = Ledger()

    def __call__(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int) -> Sampled:
        return self.step(sampling, timing, spans, step, empty_counts())

    def step(self, sampling: SamplingParams, timing: dict[str, float], spans: list[Span], step: int,
             counts: dict[str, float]) -> Sampled:
        """Generate what step ``step`` still needs (tokens of version ``step``), take its batch and
        score it; ``counts`` holds what was generated for it earlier (a prefetch)."""
        with stage_timer(timing, "gen", spans):
            self.fill(sampling, step)
            must_finish = self.generate(sampling, target=step, version=step, counts=counts)
            dropped = [] if self.rollout.stale_groups == "wait" else self._drop(must_finish, step)
            trained = sorted((g for g in self.pool if g.complete), key=lambda g: g.uid)[: self.batch_size]
            taken = {g.uid for g in trained}
            self.pool = [g for g in self.pool if g.uid not in taken]
            for g in trained:
                self.ledger.mark(g.uid, TRAINED, step)
            rollout = _rollout_of(trained, self.rollout.n, step)
        with stage_timer(timing, "reward", spans):
            scored = score_rollout(rollout, self.workers.tokenizer, self.reward, sampling.max_response_tokens)
        return rollout, scored, self._metrics(rollout, step, counts, len(must_finish), dropped)

    def generate(self, sampling: SamplingParams, *, target: int, version: int, counts: dict[str, float]) -> set[int]:
        """Chunks (tokens tagged ``version``) until step ``target``'s batch is complete: ``data.batch_size``
        complete groups and, under ``wait``, every group at the staleness bound of ``target``.
        Returns the uids at that bound."""
        must_finish = {g.uid for g in self.pool if g.staleness(target) >= self.rollout.max_staleness}
        wait = self.rollout.stale_groups == "wait"
        if not self._enough(must_finish if wait else set()):
            self._until(sampling, version, counts, must_finish if wait else set())
        while not self._enough(must_finish if wait else set()):  # engines that cannot stop a call on a condition: chunks
            before = (counts["generated_tokens"], self._num_finished())
            self._chunk(sampling, version, counts, only=must_finish if self._num_complete() >= self.batch_size else None)
            if (counts["generated_tokens"], self._num_finished()) == before:
                raise RuntimeError(f"rollout.engine={self.rollout.engine} returned no tokens for {len(self.pool)} unfinished "
                                   "prompt groups and finished none; the engine must honour SamplingParams.max_response_tokens")
        return must_finish

    def fill(self, sampling: SamplingParams, step: int) -> None:
        """Top the pool up with fresh groups (their caps fixed now) to batch + over-provision."""
        draws: list[dict[str, Any]] = []
        while len(self.pool) + len(draws) < self.batch_size + self.over_provision:
            if not self.queue:
                batch = self.sampler.next_batch()
                self.queue = [{"uid": self.ledger.draw(), "prompt_ids": tuple(batch.prompt_ids[i]), "ground_truth": batch.ground_truths[i],
                               "data_source": batch.data_sources[i], "row": batch.rows[i],
                               "prompt_truncated": batch.prompt_truncated[i]} for i in range(len(batch))]
            draws.append(self.queue.pop(0))
        seeds = _draw_seeds(len(draws))
        for prompt, seed in zip(draws, seeds):
            room = self.workers.max_context_tokens - len(prompt["prompt_ids"])
            cap = min(sampling.max_response_tokens, room)
            reason: FinishReason = "length" if cap == sampling.max_response_tokens else "context"
            self.pool.append(RolloutGroup(**prompt, seed=seed, dispatch_step=step, cap=cap, cap_reason=reason,
                                          members=(Member(),) * self.rollout.n))
            self.ledger.mark(prompt["uid"], IN_FLIGHT)

    def _num_finished(self) -> int:
        return sum(m.finished for g in self.pool for m in g.members)

    def _num_complete(self) -> int:
        return sum(g.complete for g in self.pool)

    def _enough(self, must_finish: set[int]) -> bool:
        complete = {g.uid for g in self.pool if g.complete}
        return len(complete) >= min(self.batch_size, len(self.pool)) and must_finish <= complete

    def _until(self, sampling: SamplingParams, version: int, counts: dict[str, float], must_finish: set[int]) -> None:
        """Every unfinished member in one engine call that stops between decode rounds once the
        batch is complete (`packrl.distributed.group.WorkerGroup.generate_until`): members still
        running come back cut (``abort``) and are carried, none re-prefilled within the step.
        Nothing when the engines cannot (then `_chunk` does the work)."""
        until = getattr(self.engines, "generate_until", None)
        members = [(g, m) for g in self.pool for m, member in enumerate(g.members) if not member.finished]
        if until is None or not members:
            return
        done_before = {g.uid for g in self.pool if g.complete}
        slots: dict[int, list[int]] = {}
        for i, (g, _) in enumerate(members):
            slots.setdefault(g.uid, []).append(i)

        def enough(finished: Sequence[bool]) -> bool:
            complete = done_before | {uid for uid, idx in slots.items() if all(finished[i] for i in idx)}
            return len(complete) >= self.batch_size and must_finish <= complete

        prompts = [g.prompt_ids + g.members[m].token_ids for g, m in members]
        out = until(prompts, sampling, [single_sample_seed(g.seed, m) for g, m in members],
                    [g.members[m].tokens_left(g.cap) for g, m in members], enough)
        if out is None:
            return
        index = {g.uid: k for k, g in enumerate(self.pool)}
        counts["reprefill_tokens"] += sum(len(p) for p, (g, _) in zip(prompts, members) if len(p) > len(g.prompt_ids))
        for (g, m), response in zip(members, out):
            self._extend(index[g.uid], m, response, version, counts)
        counts["chunks"] += 1

    def _chunk(self, sampling: SamplingParams, step: int, counts: dict[str, float], only: set[int] | None) -> None:
        """One engine call per distinct token grant (``n=1`` per member: prompt + the member's
        tokens, sampled as its sample of the group's seed, `single_sample_seed`); a fresh group's
        members stay adjacent, so an engine that prefills a repeated prompt once still does."""
        index = {g.uid: k for k, g in enumerate(self.pool)}
        grants: dict[int, list[tuple[int, int]]] = {}  # tokens granted -> (uid, member)
        for g in self.pool:
            if only is None or g.uid in only:
                for m, member in enumerate(g.members):
                    if not member.finished:
                        grants.setdefault(min(self.rollout.partial_chunk_tokens, member.tokens_left(g.cap)), []).append((g.uid, m))
        for size, members in sorted(grants.items()):
            groups = [self.pool[index[uid]] for uid, _ in members]
            prompts = [g.prompt_ids + g.members[m].token_ids for g, (_, m) in zip(groups, members)]
            params = dataclasses.replace(sampling, n=1, max_response_tokens=size)
            seeds = [single_sample_seed(g.seed, m) for g, (_, m) in zip(groups, members)]
            out = self.engines.generate_ids(prompts, params, seeds, [g.row for g in groups])
            counts["reprefill_tokens"] += sum(len(p) for p, g in zip(prompts, groups) if len(p) > len(g.prompt_ids))
            for (uid, m), responses in zip(members, out):
                self._extend(index[uid], m, responses[0], step, counts)
        counts["chunks"] += 1

    def _extend(self, k: int, m: int, response: Response, step: int, counts: dict[str, float]) -> None:
        group = self.pool[k]
        self.pool[k] = group.with_member(m, group.members[m].extended(response, step, group.cap, group.cap_reason))
        counts["generated_tokens"] += len(response.response_ids)

    def _drop(self, stale: set[int], step: int) -> list[RolloutGroup]:
        """``stale_groups=drop``: groups at the staleness bound still unfinished leave the pool."""
        dropped = [g for g in self.pool if g.uid in stale and not g.complete]
        for g in dropped:
            self.ledger.mark(g.uid, DROPPED, step, "stale")
        self.pool = [g for g in self.pool if g not in dropped]
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
        return {"async/carried_groups": float(len(self.pool)), "async/carried_tokens": float(sum(g.num_tokens for g in self.pool)),
                "async/carried_complete_groups": float(self._num_complete())} | {f"async/ledger_{k}": float(v) for k, v in ledger.items()}

    def close(self) -> None:
        """Nothing to release: the worker group's engines belong to the group."""

    def state_dict(self) -> dict[str, Any]:
        """The pool, the drawn queue and the ledger, JSON-serialisable."""
        queue = [{**p, "prompt_ids": list(p["prompt_ids"])} for p in self.queue]
        return {"pool": [g.to_dict() for g in self.pool], "queue": queue, "ledger": self.ledger.to_dict()}

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
        caps = max((g.cap for g in pool), default=0)
        if caps > self.rollout.max_response_tokens:
            raise ValueError(f"the checkpoint carries partial groups with a {caps}-token response cap, above "
                             f"rollout.max_response_tokens={self.rollout.max_response_tokens}: their responses could outgrow "
                             f"this run's budgets; resume with rollout.max_response_tokens>={caps}")
        self.pool = pool
        self.queue = [{**p, "prompt_ids": tuple(p["prompt_ids"])} for p in state["queue"]]
        self.ledger = Ledger.from_dict(state["ledger"])


def empty_counts() -> dict[str, float]:
    """What a step generated: re-prefilled and generated tokens, engine call rounds."""
    return {"reprefill_tokens": 0, "chunks": 0, "generated_tokens": 0}


def _draw_seeds(num: int) -> list[int]:
    """Seeds from the run's global RNG (the loop seeds it every step), as `WorkerGroup.generate` draws them."""
    return torch.randint(0, 1 << 62, (num,)).tolist()


def _rollout_of(groups: Sequence[RolloutGroup], group_size: int, step: int) -> RolloutBatch:
    prompts = PromptBatch(tuple(g.prompt_ids for g in groups), tuple(g.ground_truth for g in groups),
                          tuple(g.data_source for g in groups), tuple(g.row for g in groups), tuple(g.prompt_truncated for g in groups))
    responses = tuple(m.response() for g in groups for m in g.members)
    return RolloutBatch(prompts, group_size, responses, policy_version=step)
