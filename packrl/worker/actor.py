"""The actor's two jobs on packed, token-budgeted micro-batches: score log-probs, and its loss
for the update loop (`packrl.worker.update`).

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``K`` tokens in a pack.

Both run the micro-batches the controller planned (`packrl.seqlen.update_plan`), one pack each,
reading response tokens back by position (`packrl.worker.packs`). The policy loss is looked up
by name (``algorithm.policy_loss``, `packrl.registry.POLICY_LOSSES`); its aggregation, the KL
term and the entropy bonus divide by the mini-batch's denominators (invariant 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from packrl.algos.loss_agg import aggregate_loss
from packrl.algos.losses import kl_penalty
from packrl.algos.policy_losses import PolicyLossFn, PolicyLossInputs, PolicyLossOutput, loss_options
from packrl.algos.rollout_correction import behaviour_weights_in_update, weighted_token_loss
from packrl.config.schema import AlgorithmConfig, RunConfig
from packrl.config.update_spec import UpdateSpec
from packrl.diagnostics.buckets import bucket_means, per_response_means
from packrl.diagnostics.trace import NullTracer
from packrl.models import ulysses
from packrl.models.lora_dropout import dropout_draw
from packrl.registry import POLICY_LOSSES
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.packing import Pack
from packrl.seqlen.update_plan import UpdatePlan
from packrl.types import RolloutBatch, TrainBatch
from packrl.worker.optim import Optimization
from packrl.worker.packs import PackForward, response_parts, response_positions, rollout_logprobs_over, scatter_response, sequence_counts
from packrl.worker.strategy import Parallel
from packrl.worker.update import Context, Step, StepTotals, run_microbatches, run_update, step_metrics


def _idle_forward(model: torch.nn.Module) -> torch.Tensor:
    """A one-token forward: what a rank with no sequence left runs, so every rank runs the same
    number of forwards (FSDP gathers parameters in each)."""
    device = next(model.parameters()).device
    return model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False).logits


def compute_logprobs(model: torch.nn.Module, rollout: RolloutBatch, microbatches: Sequence[Sequence[int]], *,
                     forward: PackForward, context: Context) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """No-grad log-probs and entropy of every response token of the planned micro-batches. The
    model runs in eval mode (no dropout, e.g. ``model.lora.dropout``), restored afterwards.

    Args:
        context: the forward's context (autocast; the reference's adapters off).
        microbatches: sequence indices of ``rollout`` per micro-batch (this rank's part of a
            `packrl.seqlen.balance.RankPlan`); an empty one runs a one-token forward.

    Returns:
        ``(logprobs, entropy)`` of each planned sequence, in plan order (micro-batch after
        micro-batch): Shape [R_i] each, float32, nats, on the CPU. `RankPlan.restore` puts
        them back in rollout order.
    """
    device = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    was_training = model.training
    model.eval()
    with torch.no_grad(), context():
        for indices in microbatches:
            if not indices:
                _idle_forward(model)
                continue
            pack = forward.pack(rollout, indices, device)
            result = forward(model, pack, response_positions(pack, rollout))
            sp = ulysses.active()
            if sp is not None:  # each rank holds the log-probs its tokens predict: sum the shards
                sp.all_reduce(result.token_logprobs)
                sp.all_reduce(result.entropy)
            for lp, ent in zip(response_parts(pack, result.token_logprobs, rollout), response_parts(pack, result.entropy, rollout)):
                out.append((lp.float().cpu(), ent.float().cpu()))
    model.train(was_training)
    return out


@dataclass
class ResponseSums:
    """Per-response sums over loss tokens, over every pass of one update (for ``bucket/*``).

    Attributes (each Shape [N], float64): ``entropy`` (nats), ``clipped`` (tokens where the
    policy loss's clip is active), ``kl`` (token KL estimate to the reference, or ``old -
    current`` log-prob without one, nats) and ``num_tokens`` (loss tokens seen).
    """

    entropy: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor
    num_tokens: torch.Tensor
    pending: torch.Tensor | None = None
    """[4, N] sums on the compute device not yet added in (`finish`)."""

    @classmethod
    def zeros(cls, num_responses: int) -> ResponseSums:
        return cls(*(torch.zeros(num_responses, dtype=torch.float64) for _ in range(4)))

    def add(self, pack: Pack, mask: torch.Tensor, entropy: torch.Tensor, clipped: torch.Tensor, kl: torch.Tensor) -> None:
        """Add one micro-batch's per-token values (Shape [K]) at the loss tokens (``mask``)."""
        per_token = torch.stack([entropy.detach().float(), clipped.float(), kl.detach().float(), torch.ones_like(kl, dtype=torch.float)])
        per_token = torch.where(mask, per_token, 0.0)  # [4, K]
        per_seq = per_token.new_zeros(4, len(pack.indices)).index_add_(1, pack.sequence_ids(), per_token)  # [4, S]
        if self.pending is None:  # sums stay on the compute device until `finish`
            self.pending = per_seq.new_zeros(4, len(self.entropy), dtype=torch.float64)
        self.pending.index_add_(1, torch.tensor(pack.indices, dtype=torch.long, device=per_seq.device), per_seq.double())

    def finish(self) -> ResponseSums:
        """Add the device sums into the host tensors, one copy per update; returns self."""
        if self.pending is not None:
            pending = self.pending.cpu()
            for row, total in enumerate((self.entropy, self.clipped, self.kl, self.num_tokens)):
                total.add_(pending[row])
            self.pending = None
        return self

    @classmethod
    def merged(cls, parts: Sequence[ResponseSums]) -> ResponseSums:
        """The sums of several ranks (each rank's are zero where it saw no token)."""
        return cls(*(sum(getattr(p, name) for p in parts) for name in ("entropy", "clipped", "kl", "num_tokens")))

    def metrics(self, lengths: Sequence[int], max_response_tokens: int) -> dict[str, float]:
        """``bucket/entropy|clipfrac|kl/<lo>-<hi>``: per-response means, averaged per length bucket."""
        out: dict[str, float] = {}
        for name, sums in (("entropy", self.entropy), ("clipfrac", self.clipped), ("kl", self.kl)):
            out |= bucket_means(name, per_response_means(sums, self.num_tokens), lengths, max_response_tokens)
        return out


@dataclass(frozen=True)
class MicrobatchLoss:
    """How a micro-batch's loss is formed: the registered policy loss of the recipe's update
    (`packrl.config.update_spec.UpdateSpec`: ``algorithm.policy_loss`` in RL, ``sft`` in `packrl
    sft`) and its options (built once), the loss section, the pack forward and the metric names."""

    policy_loss: PolicyLossFn
    algo: AlgorithmConfig
    forward: PackForward
    options: Any = None
    loss_metric: str = "actor/pg_loss"
    rl_metrics: bool = True

    @classmethod
    def of(cls, update: UpdateSpec, forward: PackForward) -> MicrobatchLoss:
        """The loss of ``update`` over ``forward``.

        Raises:
            ValueError: the policy loss is not registered (names the nearest), or its
                ``policy_loss_args`` do not fit its options.
        """
        algo = update.algorithm
        return cls(POLICY_LOSSES.lookup(algo.policy_loss), algo, forward, loss_options(algo), update.loss_metric, update.rl_metrics)

    @classmethod
    def from_config(cls, cfg: RunConfig, share_prompts: bool = False) -> MicrobatchLoss:
        """RL's loss (`UpdateSpec.rl`) over `PackForward.from_config`. Raises as `of`."""
        update = UpdateSpec.rl(cfg.algorithm, cfg.train, batch_size=cfg.data.batch_size, temperature=cfg.rollout.temperature)
        return cls.of(update, PackForward.from_config(cfg, share_prompts))


def microbatch_loss(model: torch.nn.Module, pack: Pack, batch: TrainBatch, *, den: LossDenominators, loss: MicrobatchLoss,
                    totals: StepTotals, sums: ResponseSums) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: the policy loss (times the truncated
    importance weights of ``algorithm.rollout_correction`` when the batch carries them; the
    batch's ``extras`` reach the loss laid over the pack) aggregated by
    ``algorithm.loss_agg_mode``, plus ``kl_coef`` x the KL to the reference (unless it is in the
    reward), minus ``entropy_coeff`` x the entropy. Adds the micro-batch's metrics to ``totals``:
    the policy loss as ``loss.loss_metric``, ``actor/entropy``, and with ``loss.rl_metrics`` the
    clip fraction, PPO KL and KL loss."""
    algo, rollout = loss.algo, batch.rollout
    out = loss.forward(model, pack, response_positions(pack, rollout), entropy_grad=algo.entropy_coeff > 0)
    full_mask = scatter_response(pack, rollout, batch.loss_masks, False)
    mask = full_mask & out.has_logprob  # under sequence parallelism: the tokens this rank's hidden states predict
    seq_ids = pack.sequence_ids()
    counts = sequence_counts(pack, batch, full_mask, seq_ids)
    logprobs = out.token_logprobs
    old = logprobs.detach() if batch.old_logprobs is None else scatter_response(pack, rollout, batch.old_logprobs, 0.0)
    ref = None if batch.ref_logprobs is None else scatter_response(pack, rollout, batch.ref_logprobs, 0.0)
    extras = {name: scatter_response(pack, rollout, values, 0) for name, values in batch.extras.items()}
    engine = rollout_logprobs_over(pack, rollout)
    extras, behaviour = behaviour_weights_in_update(extras, logprobs, engine, mask, algo.rollout_correction.rollout_is_threshold)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=scatter_response(pack, rollout, batch.advantages, 0.0),
                              loss_mask=mask, sequence_ids=seq_ids, denominators=den, cfg=algo, ref_logprobs=ref,
                              rollout_logprobs=engine, extras=extras, options=loss.options)
    result = _checked(loss.policy_loss(inputs), logprobs, algo.policy_loss)
    token_loss = weighted_token_loss(result.token_loss, extras)  # x the truncated importance weights, when set
    pg = aggregate_loss(token_loss, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
    ent = aggregate_loss(out.entropy, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
    total = pg - algo.entropy_coeff * ent
    clipped = result.clipped if result.clipped is not None else torch.zeros_like(mask)
    token_kl = old - logprobs.detach()  # ppo_kl per token, the bucket KL without a reference
    metrics: dict[str, torch.Tensor | float] = {loss.loss_metric: pg.detach(), "actor/entropy": ent.detach()}
    if loss.rl_metrics:
        metrics |= {"actor/pg_clipfrac": den.token_share(clipped, mask), "actor/ppo_kl": den.token_share(token_kl, mask),
                    "actor/kl_loss": 0.0}
    if ref is not None:
        ref_kl = kl_penalty(logprobs, ref, algo.kl_estimator)
        token_kl = ref_kl.detach()
        if not algo.kl_in_reward:
            kl = aggregate_loss(ref_kl, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
            total = total + algo.kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
    sums.add(pack, mask, out.entropy, clipped, token_kl)
    totals.add({**metrics, **result.metrics, **behaviour})
    totals.num_microbatches += 1
    totals.max_microbatch_tokens = max(totals.max_microbatch_tokens, pack.num_tokens)
    sp = ulysses.active()
    totals.max_rank_tokens = max(totals.max_rank_tokens, pack.num_tokens if sp is None else sp.padded(pack.num_tokens) // sp.size)
    totals.num_positions += pack.input_ids.numel()
    totals.num_real_tokens += pack.num_tokens  # a pack has no padding
    for name, load in pack.grouped_loads().items():
        totals.max_grouped_loads[name] = max(totals.max_grouped_loads.get(name, 0), load)
    totals.num_shared_tokens_saved += sum(len(rollout.prompt_ids_of(i)) + len(rollout.responses[i].response_ids)
                                          for i in pack.indices) - pack.num_tokens
    return total


def _checked(result: Any, logprobs: torch.Tensor, name: str) -> PolicyLossOutput:
    """A policy loss's result, or ValueError naming ``algorithm.policy_loss`` and what is wrong."""
    what = None
    if not isinstance(result, PolicyLossOutput):
        what = f"returned a {type(result).__name__}, not a PolicyLossOutput (packrl.algos.policy_losses)"
    elif not isinstance(result.token_loss, torch.Tensor) or result.token_loss.shape != logprobs.shape:
        what = f"returned a token loss of Shape {tuple(getattr(result.token_loss, 'shape', ()))} for {logprobs.shape[0]} tokens"
    elif logprobs.requires_grad and not result.token_loss.requires_grad:
        what = "returned a token loss without a gradient (computed from detached values, not from inputs.logprobs)"
    elif result.clipped is not None and (result.clipped.shape != logprobs.shape or result.clipped.dtype != torch.bool):
        what = f"returned clipped of Shape {tuple(result.clipped.shape)} and dtype {result.clipped.dtype}, not [{logprobs.shape[0]}] bool"
    if what is not None:
        raise ValueError(f"algorithm.policy_loss={name!r} {what}; return PolicyLossOutput(token_loss=<Shape [K], from "
                         "inputs.logprobs>, clipped=<Shape [K] bool or None>, metrics={...})")
    return result


def actor_microbatches(model: torch.nn.Module, batch: TrainBatch, microbatches: Sequence[Sequence[int]], *, den: LossDenominators,
                       loss: MicrobatchLoss, context: Context, sums: ResponseSums, tracer: NullTracer = NullTracer(),
                       parallel: Parallel = Parallel(), draw: int = 0) -> StepTotals:
    """One mini-batch's micro-batches of the actor forward and backward
    (`packrl.worker.update.run_microbatches` with `microbatch_loss`, LoRA dropout masks of
    ``draw``); gradients accumulate in ``model``, per-response sums in ``sums``."""
    device = next(model.parameters()).device
    return run_microbatches(model, microbatches, den=den, loss=_loss_fn(model, batch, loss, sums),
                            pack=lambda indices: loss.forward.pack(batch.rollout, indices, device), idle=partial(_idle_forward, model),
                            context=context, tracer=tracer, parallel=parallel, around=partial(_dropout_draw, batch.rollout), draw=draw)


def actor_update(model: torch.nn.Module, batch: TrainBatch, plan: UpdatePlan, *, rank: int, loss: MicrobatchLoss, opt: Optimization,
                 context: Context, tracer: NullTracer = NullTracer(), parallel: Parallel = Parallel()) -> UpdateStats:
    """Rank ``rank``'s part of ``plan`` for the actor (`packrl.worker.update.run_update` with
    `microbatch_loss`)."""
    device = next(model.parameters()).device
    sums = ResponseSums.zeros(len(batch.rollout))
    steps = run_update(model, plan, rank=rank, loss=_loss_fn(model, batch, loss, sums),
                       pack=lambda indices: loss.forward.pack(batch.rollout, indices, device), idle=partial(_idle_forward, model),
                       opt=opt, context=context, tracer=tracer, parallel=parallel, around=partial(_dropout_draw, batch.rollout))
    return UpdateStats(steps, sums.finish(), opt.skips.total)


def _dropout_draw(rollout: RolloutBatch, pack: Pack | None, draw: int) -> AbstractContextManager:
    """The LoRA dropout masks of a micro-batch of ``rollout`` (`packrl.models.lora_dropout.dropout_draw`;
    nothing is computed for a model without dropout)."""
    return dropout_draw(pack, [] if pack is None else [rollout.prompt_ids_of(i) for i in pack.indices], draw)


def _loss_fn(model: torch.nn.Module, batch: TrainBatch, loss: MicrobatchLoss, sums: ResponseSums) -> Any:
    """`microbatch_loss` as the update loop's ``loss(pack, denominators, totals)``."""
    return lambda pack, den, totals: microbatch_loss(model, pack, batch, den=den, loss=loss, totals=totals, sums=sums)


@dataclass
class UpdateStats:
    """What one rank's update leaves for the metrics: per optimizer step its totals, gradient
    norm and learning rate, the per-response sums, the skip count so far and the bytes of saved
    activations the update moved to host memory (``model.activation_offload``)."""

    steps: list[Step]
    sums: ResponseSums
    skipped_steps: int
    offloaded_bytes: int = 0
    all_to_all_s: float = 0.0


def update_metrics(ranks: Sequence[UpdateStats], batch: TrainBatch, max_response_tokens: int, *, buckets: bool = True) -> dict[str, float]:
    """The update's metrics from every rank's `UpdateStats` (one in a single process).

    Loss terms and the policy loss's metrics are each rank's share of a globally normalised
    value, so ranks add up; the gradient norm and learning rate are the same on every rank;
    ``seqlen/num_microbatches`` is per rank (every rank runs the same count),
    ``seqlen/microbatch_tokens_max`` the largest pack anywhere and ``seqlen/pad_fraction`` over
    all ranks' packs.

    Returns:
        ``actor/pg_loss``, ``actor/kl_loss``, ``actor/entropy``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl`` and the policy loss's own metrics (means over optimizer steps),
        ``actor/grad_norm``, ``actor/lr``, ``train/skipped_steps``, ``seqlen/num_microbatches``,
        ``seqlen/microbatch_tokens_max``, ``seqlen/pad_fraction``, ``perf/offloaded_activation_gib``
        (with ``model.activation_offload``: saved activations moved to host memory, largest rank),
        ``seqlen/shared_prompt_tokens_saved`` (with ``train.share_prompts``: prompt tokens the
        update's packs did not compute again, all passes and ranks),
        ``seqlen/microbatch_<load>_max`` (per grouped-cap load the packs report, `Pack.grouped_loads`:
        the most one micro-batch encoded, e.g. ``vision_patches``), ``perf/all_to_all_s`` and
        ``seqlen/microbatch_tokens_per_rank_max`` (with sequence parallelism: forward all-to-all
        seconds of the update and tokens of the largest shard),
        and with ``buckets`` ``bucket/entropy|clipfrac|kl/<lo>-<hi>`` (per-response means over
        loss tokens and every pass, averaged per response-length bucket of ``max_response_tokens``;
        kl is the token KL estimate to the reference, else ``old_logprobs - logprobs``). The
        policy loss is named by the update (`packrl.config.update_spec.UpdateSpec.loss_metric`),
        and a supervised update has no clip fraction, PPO KL or KL loss (``rl_metrics``).
    """
    first = ranks[0]
    totals = [t for r in ranks for t, _, _ in r.steps]
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    positions = sum(t.num_positions for t in totals)
    out = ResponseSums.merged([r.sums for r in ranks]).metrics(lengths, max_response_tokens) if buckets else {}
    out |= step_metrics([r.steps for r in ranks], "actor")
    stale = out.pop("async/behaviour_stale_tokens", 0.0)
    weight_sum = out.pop("async/behaviour_weight_sum", 0.0)
    if stale:  # weighted in the update (one on-policy step): the mean over stale loss tokens
        out["async/behaviour_weight_mean"] = weight_sum / stale
    out |= {
        "train/skipped_steps": float(first.skipped_steps),
        "seqlen/num_microbatches": float(max(sum(t.num_microbatches for t, _, _ in r.steps) for r in ranks)),
        "seqlen/microbatch_tokens_max": float(max(t.max_microbatch_tokens for t in totals)),
        "seqlen/pad_fraction": 1.0 - sum(t.num_real_tokens for t in totals) / max(1, positions),
    }
    for name in sorted({name for t in totals for name in t.max_grouped_loads}):  # e.g. seqlen/microbatch_vision_patches_max
        out[f"seqlen/microbatch_{name}_max"] = float(max(t.max_grouped_loads.get(name, 0) for t in totals))
    saved = sum(t.num_shared_tokens_saved for t in totals)
    if saved:
        out["seqlen/shared_prompt_tokens_saved"] = float(saved)
    if any(r.offloaded_bytes for r in ranks):
        out["perf/offloaded_activation_gib"] = max(r.offloaded_bytes for r in ranks) / 2**30
    if any(r.all_to_all_s for r in ranks):
        out["perf/all_to_all_s"] = max(r.all_to_all_s for r in ranks)
        out["seqlen/microbatch_tokens_per_rank_max"] = float(max(t.max_rank_tokens for t in totals))
    return out
