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
from packrl.seqlen.microbatch import MicrobatchPlan, plan_microbatches
from packrl.seqlen.packing import Pack, pack_sequences
from packrl.types import RolloutBatch, TrainBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogprobResult:
    """Per-response log-probs (and entropy) with the plan that produced them.

    Attributes:
        logprobs: ``N`` tensors of Shape [R_i], float32, nats.
        entropy: ``N`` tensors of Shape [R_i], float32, nats.
        plan: the log-prob micro-batch plan (for ``seqlen/*`` metrics).
    """

    logprobs: tuple[torch.Tensor, ...]
    entropy: tuple[torch.Tensor, ...]
    plan: MicrobatchPlan


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


def compute_logprobs(model: torch.nn.Module, rollout: RolloutBatch, cfg: RunConfig, autocast: Callable[[], AbstractContextManager]) -> LogprobResult:
    """No-grad log-probs and entropy of every response token, in log-prob micro-batches of at
    most ``train.max_tokens_per_logprob_microbatch`` real tokens. The model runs in eval mode
    (no dropout, e.g. ``model.lora.dropout``) and its mode is restored afterwards.

    Raises:
        ValueError: a sequence longer than the log-prob budget (named by index).
    """
    plan = plan_microbatches(
        rollout.sequence_lengths(), cfg.train.max_tokens_per_logprob_microbatch,
        balance=cfg.train.balance_microbatches, budget_key="train.max_tokens_per_logprob_microbatch",
    )
    device = next(model.parameters()).device
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rollout)
    entropy: list[torch.Tensor] = [torch.empty(0)] * len(rollout)
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast():
        for indices in plan.microbatches:
            pack = _pack(rollout, indices, device)
            out = pack_logprobs(model, pack, attention=cfg.model.packed_attention, chunk_tokens=cfg.train.logits_chunk_tokens,
                                temperature=cfg.rollout.temperature, needed=_response_positions(pack, rollout))
            for i, lp, ent in zip(indices, _response_parts(pack, out.token_logprobs, rollout), _response_parts(pack, out.entropy, rollout)):
                logprobs[i], entropy[i] = lp.float().cpu(), ent.float().cpu()
    model.train(was_training)
    return LogprobResult(tuple(logprobs), tuple(entropy), plan)


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


def update_minibatch(model: torch.nn.Module, batch: TrainBatch, indices: Sequence[int], cfg: RunConfig,
                     autocast: Callable[[], AbstractContextManager], sums: _ResponseSums | None = None,
                     tracer: NullTracer = NullTracer()) -> _Totals:
    """Forward and backward one mini-batch (sequences ``indices``) in token-budgeted packs.
    Gradients accumulate in ``model``; the caller steps the optimizer. Per-response statistics
    are added to ``sums``; each micro-batch is timed by ``tracer``.

    Raises:
        ValueError: a sequence longer than ``train.max_tokens_per_microbatch`` (named by index).
    """
    rollout = batch.rollout
    scale = cfg.algorithm.loss_scale_factor or cfg.rollout.max_response_tokens
    den = LossDenominators.from_masks([batch.loss_masks[i] for i in indices], scale)
    if den.num_tokens == 0:
        logger.warning("a mini-batch of %d responses has no loss tokens (all masked, e.g. algorithm.truncated=mask with every "
                       "response truncated); it contributes no gradient: raise rollout.max_response_tokens", len(indices))
    lengths = rollout.sequence_lengths()
    plan = plan_microbatches([lengths[i] for i in indices], cfg.train.max_tokens_per_microbatch,
                             balance=cfg.train.balance_microbatches)
    device = next(model.parameters()).device
    totals = _Totals()
    sums = sums if sums is not None else _ResponseSums.zeros(len(rollout))
    for local in plan.microbatches:
        pack = _pack(rollout, [indices[j] for j in local], device)
        with tracer.microbatch(num_sequences=len(local), num_tokens=pack.num_tokens, num_positions=pack.input_ids.numel()):
            with autocast():
                loss = _microbatch_loss(model, pack, batch, den, cfg, totals, sums)
            loss.backward()  # outside autocast, as torch recommends
    return totals


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


def update_actor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 batch: TrainBatch, cfg: RunConfig, autocast: Callable[[], AbstractContextManager],
                 tracer: NullTracer = NullTracer(), skips: SkipCounter | None = None) -> dict[str, float]:
    """``train.ppo_epochs`` passes over the batch in mini-batches of ``train.mini_batch_size``
    prompts (whole groups), one optimizer step per mini-batch, gradient norm clipped to
    ``train.grad_clip``. ``tracer`` times every micro-batch (forward + backward).

    Returns:
        ``actor/pg_loss``, ``actor/kl_loss``, ``actor/entropy``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ``actor/grad_norm``, ``actor/lr`` (means over optimizer steps) and
        ``seqlen/num_microbatches``, ``seqlen/microbatch_tokens_max``, ``seqlen/pad_fraction``, and
        ``bucket/entropy|clipfrac|kl/<lo>-<hi>`` (per-response means over loss tokens and every
        pass, averaged per response-length bucket; kl is the token KL estimate to the reference,
        else ``old_logprobs - logprobs``).
    """
    group, num_prompts = batch.rollout.group_size, len(batch.rollout.prompts)
    sums = _ResponseSums.zeros(len(batch.rollout))
    mini = cfg.train.mini_batch_size or num_prompts
    params = [p for p in model.parameters() if p.requires_grad]
    skips = skips or SkipCounter(cfg.train.max_consecutive_skips)
    steps: list[tuple[_Totals, float, float]] = []
    model.train()
    for _ in range(cfg.train.ppo_epochs):
        for start in range(0, num_prompts, mini):
            indices = list(range(start * group, min(start + mini, num_prompts) * group))
            totals = update_minibatch(model, batch, indices, cfg, autocast, sums=sums, tracer=tracer)
            max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            lr = optimizer.param_groups[0]["lr"]
            if not skips.record(grad_norm):
                optimizer.step()
            with warnings.catch_warnings():  # a skipped step still advances the schedule, as verl's does
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append((totals, grad_norm, lr))
    count = len(steps)
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    return sums.metrics(lengths, cfg.rollout.max_response_tokens) | {
        "actor/pg_loss": sum(t.pg_loss for t, _, _ in steps) / count,
        "actor/kl_loss": sum(t.kl_loss for t, _, _ in steps) / count,
        "actor/entropy": sum(t.entropy for t, _, _ in steps) / count,
        "actor/pg_clipfrac": sum(t.clipped_tokens for t, _, _ in steps) / count,
        "actor/ppo_kl": sum(t.ppo_kl for t, _, _ in steps) / count,
        "actor/grad_norm": sum(g for _, g, _ in steps) / count,
        "actor/lr": steps[-1][2],
        "train/skipped_steps": float(skips.total),
        "seqlen/num_microbatches": float(sum(t.num_microbatches for t, _, _ in steps)),
        "seqlen/microbatch_tokens_max": float(max(t.max_microbatch_tokens for t, _, _ in steps)),
        "seqlen/pad_fraction": 1.0 - sum(t.num_real_tokens for t, _, _ in steps) / max(1, sum(t.num_positions for t, _, _ in steps)),
    }
