"""The actor's two jobs on packed, token-budgeted micro-batches: score log-probs and update.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``K`` tokens in a pack.

Both jobs plan micro-batches over real sequence lengths (`plan_microbatches`), pack each
micro-batch into one row, and read response tokens back by position: in a pack, sequence i's
response occupies its last ``R_i`` tokens, and `pack_logprobs` puts log p(x_k | x_<k) at k.
The update normalises every loss term by denominators counted once per mini-batch
(`LossDenominators`), so the gradient does not depend on the micro-batch split (invariant 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import logging
import math
import warnings

import torch

from packrl.algos.loss_agg import LossDenominators, aggregate_loss
from packrl.algos.losses import kl_penalty, ppo_clip_loss
from packrl.config.schema import RunConfig
from packrl.diagnostics.buckets import bucket_means, per_response_means
from packrl.diagnostics.trace import NullTracer
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.microbatch import plan_microbatches
from packrl.seqlen.packing import Pack, pack_sequences
from packrl.types import RolloutBatch, TrainBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogprobResult:
    """Per-response log-probs (and entropy) with the plan that produced them.

    Attributes:
        logprobs: ``N`` tensors of Shape [R_i], float32, nats.
        entropy: ``N`` tensors of Shape [R_i], float32, nats.
        microbatches: the log-prob micro-batches that ran (sequence indices).
    """

    logprobs: tuple[torch.Tensor, ...]
    entropy: tuple[torch.Tensor, ...]
    microbatches: tuple[tuple[int, ...], ...] = ()


def sequence_ids(rollout: RolloutBatch, i: int) -> torch.Tensor:
    """Prompt + response ids of sequence i. Shape [T_i], int64."""
    return torch.tensor(rollout.prompt_ids_of(i) + rollout.responses[i].response_ids, dtype=torch.long)


def _pack(rollout: RolloutBatch, indices: Sequence[int], device: torch.device) -> Pack:
    return pack_sequences([sequence_ids(rollout, i) for i in indices], indices=indices).to(device)


def _response_parts(pack: Pack, values: torch.Tensor, rollout: RolloutBatch) -> list[torch.Tensor]:
    """The last R_i entries of each packed sequence's per-token ``values`` ([K])."""
    return [part[-len(rollout.responses[i].response_ids):] for i, part in zip(pack.indices, pack.unpack(values))]


def _scatter_response(pack: Pack, rollout: RolloutBatch, per_seq: Sequence[torch.Tensor] | dict[int, torch.Tensor],
                      fill: float | bool) -> torch.Tensor:
    """Lay per-response values ([R_i] each, indexed like the rollout) over the pack: prompt
    tokens get ``fill``. Returns Shape [K]."""
    parts = []
    for i in pack.indices:
        values = per_seq[i].to(pack.input_ids.device)
        parts.append(torch.cat([values.new_full((len(rollout.prompt_ids_of(i)),), fill), values]))
    return torch.cat(parts)


def _response_positions(pack: Pack, rollout: RolloutBatch) -> torch.Tensor:
    """True at every response token of the pack. Shape [K], bool."""
    ones = {i: torch.ones(len(rollout.responses[i].response_ids), dtype=torch.bool) for i in pack.indices}
    return _scatter_response(pack, rollout, ones, False)


def compute_logprobs(model: torch.nn.Module, rollout: RolloutBatch, cfg: RunConfig, autocast: Callable[[], AbstractContextManager],
                     microbatches: Sequence[Sequence[int]] | None = None) -> LogprobResult:
    """No-grad log-probs and entropy of every response token, in log-prob micro-batches of at
    most ``train.max_tokens_per_logprob_microbatch`` real tokens. The model runs in eval mode
    (no dropout, e.g. ``model.lora.dropout``) and its mode is restored afterwards.

    Args:
        microbatches: this rank's micro-batches (sequence indices of ``rollout``) from a
            data-parallel plan (`packrl.seqlen.balance.balance_ranks`); an empty one runs a
            one-token forward so every rank runs the same number of forwards (FSDP gathers
            parameters in each). Default: plan all sequences here. Sequences not in any
            micro-batch get empty tensors.

    Raises:
        ValueError: a sequence longer than the log-prob budget (named by index).
    """
    if microbatches is None:
        microbatches = plan_microbatches(
            rollout.sequence_lengths(), cfg.train.max_tokens_per_logprob_microbatch,
            balance=cfg.train.balance_microbatches, budget_key="train.max_tokens_per_logprob_microbatch",
        ).microbatches
    device = next(model.parameters()).device
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rollout)
    entropy: list[torch.Tensor] = [torch.empty(0)] * len(rollout)
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast():
        for indices in microbatches:
            if not indices:
                model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)
                continue
            pack = _pack(rollout, indices, device)
            out = pack_logprobs(model, pack, attention=cfg.model.packed_attention, chunk_tokens=cfg.train.logits_chunk_tokens,
                                temperature=cfg.rollout.temperature, needed=_response_positions(pack, rollout))
            for i, lp, ent in zip(indices, _response_parts(pack, out.token_logprobs, rollout), _response_parts(pack, out.entropy, rollout)):
                logprobs[i], entropy[i] = lp.float().cpu(), ent.float().cpu()
    model.train(was_training)
    return LogprobResult(tuple(logprobs), tuple(entropy), tuple(tuple(mb) for mb in microbatches))


@dataclass
class _Totals:
    """Sums over the micro-batches of one mini-batch (each term already globally normalised)."""

    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy: float = 0.0
    clipped_tokens: float = 0.0
    ppo_kl: float = 0.0
    num_microbatches: int = 0
    max_microbatch_tokens: int = 0
    num_positions: int = 0
    num_real_tokens: int = 0


@dataclass
class _ResponseSums:
    """Per-response sums over loss tokens, over every pass of one update (for ``bucket/*``).

    Attributes (each Shape [N], float64): ``entropy`` (nats), ``clipped`` (tokens where the PPO
    clip is active), ``kl`` (token KL estimate to the reference, or ``old - current`` log-prob
    without one, nats) and ``num_tokens`` (loss tokens seen).
    """

    entropy: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor
    num_tokens: torch.Tensor

    @classmethod
    def zeros(cls, num_responses: int) -> _ResponseSums:
        return cls(*(torch.zeros(num_responses, dtype=torch.float64) for _ in range(4)))

    def add(self, pack: Pack, mask: torch.Tensor, entropy: torch.Tensor, clipped: torch.Tensor, kl: torch.Tensor) -> None:
        """Add one micro-batch's per-token values (Shape [K]) at the loss tokens (``mask``)."""
        per_token = torch.stack([entropy.detach().float(), clipped.float(), kl.detach().float(), torch.ones_like(kl, dtype=torch.float)])
        per_token = torch.where(mask, per_token, 0.0)  # [4, K]
        per_seq = per_token.new_zeros(4, len(pack.indices)).index_add_(1, pack.sequence_ids(), per_token)  # [4, S]
        per_seq = per_seq.double().cpu()  # one device-to-host copy per micro-batch
        index = torch.tensor(pack.indices, dtype=torch.long)
        for row, total in enumerate((self.entropy, self.clipped, self.kl, self.num_tokens)):
            total.index_add_(0, index, per_seq[row])

    def metrics(self, lengths: Sequence[int], max_response_tokens: int) -> dict[str, float]:
        """``bucket/entropy|clipfrac|kl/<lo>-<hi>``: per-response means, averaged per length bucket."""
        out: dict[str, float] = {}
        for name, sums in (("entropy", self.entropy), ("clipfrac", self.clipped), ("kl", self.kl)):
            out |= bucket_means(name, per_response_means(sums, self.num_tokens), lengths, max_response_tokens)
        return out


def _microbatch_loss(model, pack: Pack, batch: TrainBatch, den: LossDenominators, cfg: RunConfig, totals: _Totals,
                     sums: _ResponseSums) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss (PPO clip + KL - entropy bonus)."""
    algo, rollout = cfg.algorithm, batch.rollout
    out = pack_logprobs(model, pack, attention=cfg.model.packed_attention, chunk_tokens=cfg.train.logits_chunk_tokens,
                        temperature=cfg.rollout.temperature, entropy_grad=algo.entropy_coeff > 0,
                        needed=_response_positions(pack, rollout))
    mask = _scatter_response(pack, rollout, batch.loss_masks, False)
    if batch.old_logprobs is None:  # on-policy: pi_old is the current policy
        old = out.token_logprobs.detach()
    else:
        old = _scatter_response(pack, rollout, batch.old_logprobs, 0.0)
    adv = _scatter_response(pack, rollout, batch.advantages, 0.0)
    seq_ids = pack.sequence_ids()
    mode = algo.loss_agg_mode
    pg_tokens, clipped = ppo_clip_loss(out.token_logprobs, old, adv, clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high)
    pg = aggregate_loss(pg_tokens, mask, mode, den, sequence_ids=seq_ids)
    ent = aggregate_loss(out.entropy, mask, mode, den, sequence_ids=seq_ids)
    loss = pg - algo.entropy_coeff * ent
    token_kl = old - out.token_logprobs.detach()  # ppo_kl per token, the bucket KL without a reference
    if batch.ref_logprobs is not None:
        ref = _scatter_response(pack, rollout, batch.ref_logprobs, 0.0)
        ref_kl = kl_penalty(out.token_logprobs, ref, algo.kl_estimator)
        token_kl = ref_kl.detach()
    if batch.ref_logprobs is not None and not algo.kl_in_reward:
        kl = aggregate_loss(ref_kl, mask, mode, den, sequence_ids=seq_ids)
        loss = loss + algo.kl_coef * kl
        totals.kl_loss += kl.item()
    sums.add(pack, mask, out.entropy, clipped, token_kl)
    num_tokens = max(1, den.num_tokens)
    totals.pg_loss += pg.item()
    totals.entropy += ent.item()
    totals.clipped_tokens += (clipped & mask).sum().item() / num_tokens
    totals.ppo_kl += torch.where(mask, old - out.token_logprobs.detach(), 0.0).sum().item() / num_tokens
    totals.num_microbatches += 1
    totals.max_microbatch_tokens = max(totals.max_microbatch_tokens, pack.num_tokens)
    totals.num_positions += pack.input_ids.numel()
    totals.num_real_tokens += sum(pack.seq_lens)
    return loss


def plan_minibatch(batch: TrainBatch, indices: Sequence[int], cfg: RunConfig) -> tuple[list[list[int]], LossDenominators]:
    """The micro-batches (sequence indices) and loss denominators of one mini-batch in one process.

    Raises:
        ValueError: a sequence longer than ``train.max_tokens_per_microbatch`` (named by index).
    """
    scale = cfg.algorithm.loss_scale_factor or cfg.rollout.max_response_tokens
    den = LossDenominators.from_masks([batch.loss_masks[i] for i in indices], scale)
    lengths = batch.rollout.sequence_lengths()
    plan = plan_microbatches([lengths[i] for i in indices], cfg.train.max_tokens_per_microbatch,
                             balance=cfg.train.balance_microbatches)
    return [[indices[j] for j in local] for local in plan.microbatches], den


def run_microbatches(model: torch.nn.Module, batch: TrainBatch, microbatches: Sequence[Sequence[int]], den: LossDenominators,
                     cfg: RunConfig, autocast: Callable[[], AbstractContextManager], sums: _ResponseSums,
                     tracer: NullTracer = NullTracer(), grad_sync: Callable[[bool], None] | None = None,
                     loss_scale: float = 1.0) -> _Totals:
    """Forward and backward each micro-batch; gradients accumulate in ``model``.

    Args:
        microbatches: sequence indices per micro-batch; an empty one (a data-parallel rank with
            fewer sequences) runs a one-token forward and a zero backward, so every rank runs the
            same number of passes.
        den: the mini-batch's global denominators (all ranks together).
        grad_sync: called with True before the last backward and False before the others (FSDP's
            ``set_requires_gradient_sync``: reduce gradients once per mini-batch).
        loss_scale: multiplies the loss before the backward (the rank count under FSDP, whose
            reduce-scatter averages gradients over ranks); metrics are not scaled.
    """
    if den.num_tokens == 0:
        logger.warning("a mini-batch has no loss tokens (all masked, e.g. algorithm.truncated=mask with every "
                       "response truncated); it contributes no gradient: raise rollout.max_response_tokens")
    device = next(model.parameters()).device
    totals = _Totals()
    for k, indices in enumerate(microbatches):
        if grad_sync is not None:
            grad_sync(k == len(microbatches) - 1)
        if not indices:
            with autocast():
                loss = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False).logits.sum() * 0.0
            loss.backward()
            continue
        pack = _pack(batch.rollout, indices, device)
        with tracer.microbatch(num_sequences=len(indices), num_tokens=pack.num_tokens, num_positions=pack.input_ids.numel()):
            with autocast():
                loss = _microbatch_loss(model, pack, batch, den, cfg, totals, sums)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()  # outside autocast, as torch recommends
    return totals


def update_minibatch(model: torch.nn.Module, batch: TrainBatch, indices: Sequence[int], cfg: RunConfig,
                     autocast: Callable[[], AbstractContextManager], sums: _ResponseSums | None = None,
                     tracer: NullTracer = NullTracer()) -> _Totals:
    """Forward and backward one mini-batch (sequences ``indices``) in token-budgeted packs in
    this process (`plan_minibatch` + `run_microbatches`). The caller steps the optimizer.

    Raises:
        ValueError: a sequence longer than ``train.max_tokens_per_microbatch`` (named by index).
    """
    microbatches, den = plan_minibatch(batch, indices, cfg)
    sums = sums if sums is not None else _ResponseSums.zeros(len(batch.rollout))
    return run_microbatches(model, batch, microbatches, den, cfg, autocast, sums, tracer)


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
                f"{self.max_consecutive}); the run stopped. Lower train.lr, set train.grad_clip, or check the rewards for NaN"
            )
        return True

    def state_dict(self) -> dict[str, int]:
        """``{skipped_steps, consecutive_skips}``, saved with each checkpoint."""
        return {"skipped_steps": self.total, "consecutive_skips": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue counting from a checkpoint's `state_dict` (absent keys count as 0)."""
        self.total, self.consecutive = int(state.get("skipped_steps", 0)), int(state.get("consecutive_skips", 0))


Shard = Callable[[list[int]], tuple[Sequence[Sequence[int]], LossDenominators]]
"""Mini-batch sequence indices -> this rank's micro-batches and the mini-batch's global denominators."""


@dataclass
class UpdateStats:
    """What one rank's update leaves for the metrics: per optimizer step its totals, gradient
    norm and learning rate, the per-response sums, and the skip count so far."""

    steps: list[tuple[_Totals, float, float]]
    sums: _ResponseSums
    skipped_steps: int


def run_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
               batch: TrainBatch, cfg: RunConfig, autocast: Callable[[], AbstractContextManager],
               tracer: NullTracer = NullTracer(), skips: SkipCounter | None = None, shard: Shard | None = None,
               grad_sync: Callable[[bool], None] | None = None, loss_scale: float = 1.0) -> UpdateStats:
    """``train.ppo_epochs`` passes over the batch in mini-batches of ``train.mini_batch_size``
    prompts (whole groups), one optimizer step per mini-batch, gradient norm clipped to
    ``train.grad_clip``; a non-finite norm skips the step (``skips``). ``shard`` gives this
    rank's part of each mini-batch (default: all of it, `plan_minibatch`); ``grad_sync`` and
    ``loss_scale`` are passed to `run_microbatches`. With FSDP parameters the norm is the global one (DTensor)."""
    group, num_prompts = batch.rollout.group_size, len(batch.rollout.prompts)
    sums = _ResponseSums.zeros(len(batch.rollout))
    mini = cfg.train.mini_batch_size or num_prompts
    params = [p for p in model.parameters() if p.requires_grad]
    skips = skips or SkipCounter(cfg.train.max_consecutive_skips)
    shard = shard or (lambda indices: plan_minibatch(batch, indices, cfg))
    steps: list[tuple[_Totals, float, float]] = []
    model.train()
    for _ in range(cfg.train.ppo_epochs):
        for start in range(0, num_prompts, mini):
            microbatches, den = shard(list(range(start * group, min(start + mini, num_prompts) * group)))
            totals = run_microbatches(model, batch, microbatches, den, cfg, autocast, sums, tracer, grad_sync, loss_scale)
            max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            lr = optimizer.param_groups[0]["lr"]
            if not skips.record(grad_norm):
                optimizer.step()
            with warnings.catch_warnings():  # a skipped step still advances the schedule, as verl's does
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append((totals, grad_norm, lr))
    return UpdateStats(steps, sums, skips.total)


def update_metrics(ranks: Sequence[UpdateStats], batch: TrainBatch, cfg: RunConfig) -> dict[str, float]:
    """The update's metrics from every rank's `UpdateStats` (one in a single process).

    Loss terms are each rank's share of the globally normalised loss, so ranks add up; the
    gradient norm and learning rate are the same on every rank; ``seqlen/num_microbatches`` is
    per rank (every rank runs the same count), ``seqlen/microbatch_tokens_max`` the largest pack
    anywhere and ``seqlen/pad_fraction`` over all ranks' packs.

    Returns:
        ``actor/pg_loss``, ``actor/kl_loss``, ``actor/entropy``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ``actor/grad_norm``, ``actor/lr`` (means over optimizer steps),
        ``train/skipped_steps``, ``seqlen/num_microbatches``, ``seqlen/microbatch_tokens_max``,
        ``seqlen/pad_fraction``, and ``bucket/entropy|clipfrac|kl/<lo>-<hi>`` (per-response means
        over loss tokens and every pass, averaged per response-length bucket; kl is the token KL
        estimate to the reference, else ``old_logprobs - logprobs``).
    """
    first = ranks[0]
    count = len(first.steps)
    totals = [[r.steps[k][0] for r in ranks] for k in range(count)]  # [step][rank]

    def mean_of(field: str) -> float:
        return sum(getattr(t, field) for step in totals for t in step) / count

    sums = _ResponseSums(*(sum(getattr(r.sums, f) for r in ranks) for f in ("entropy", "clipped", "kl", "num_tokens")))
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    positions = sum(t.num_positions for step in totals for t in step)
    return sums.metrics(lengths, cfg.rollout.max_response_tokens) | {
        "actor/pg_loss": mean_of("pg_loss"),
        "actor/kl_loss": mean_of("kl_loss"),
        "actor/entropy": mean_of("entropy"),
        "actor/pg_clipfrac": mean_of("clipped_tokens"),
        "actor/ppo_kl": mean_of("ppo_kl"),
        "actor/grad_norm": sum(g for _, g, _ in first.steps) / count,
        "actor/lr": first.steps[-1][2],
        "train/skipped_steps": float(first.skipped_steps),
        "seqlen/num_microbatches": float(max(sum(t.num_microbatches for t in (s[r] for s in totals)) for r in range(len(ranks)))),
        "seqlen/microbatch_tokens_max": float(max(t.max_microbatch_tokens for step in totals for t in step)),
        "seqlen/pad_fraction": 1.0 - sum(t.num_real_tokens for step in totals for t in step) / max(1, positions),
    }


def update_actor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 batch: TrainBatch, cfg: RunConfig, autocast: Callable[[], AbstractContextManager],
                 tracer: NullTracer = NullTracer(), skips: SkipCounter | None = None) -> dict[str, float]:
    """The whole update in this process (`run_update`) and its metrics (`update_metrics`).
    ``tracer`` times every micro-batch (forward + backward).

    Raises:
        ValueError: a sequence over ``train.max_tokens_per_microbatch``; ``train.max_consecutive_skips``
            non-finite gradient norms in a row.
    """
    return update_metrics([run_update(model, optimizer, scheduler, batch, cfg, autocast, tracer, skips)], batch, cfg)
