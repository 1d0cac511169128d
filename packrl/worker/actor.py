"""The actor's two jobs on packed, token-budgeted micro-batches: score log-probs and update.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``K`` tokens in a pack.

Both jobs run the micro-batches the controller planned (`packrl.seqlen.update_plan`), pack each
into one row, and read response tokens back by position: in a pack, sequence i's response
occupies its last ``R_i`` tokens, and `pack_logprobs` puts log p(x_k | x_<k) at k. The update
normalises every loss term by the mini-batch's denominators, counted once on the controller, so
the gradient does not depend on the micro-batch split or the rank count (invariant 4). The
policy loss is looked up by name (``algorithm.policy_loss``, `packrl.registry.POLICY_LOSSES`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from packrl.algos.loss_agg import aggregate_loss
from packrl.algos.losses import kl_penalty
from packrl.algos.policy_losses import PolicyLossFn, PolicyLossInputs, PolicyLossOutput
from packrl.algos.rollout_correction import weighted_token_loss
from packrl.config.schema import AlgorithmConfig, RunConfig
from packrl.diagnostics.buckets import bucket_means, per_response_means
from packrl.diagnostics.trace import NullTracer
from packrl.models import ulysses
from packrl.models.logprobs import pack_logprobs
from packrl.registry import POLICY_LOSSES
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.packing import Pack, pack_sequences, pack_shared
from packrl.seqlen.update_plan import UpdatePlan
from packrl.types import RolloutBatch, TrainBatch

logger = logging.getLogger(__name__)

Context = Callable[[], AbstractContextManager]


@dataclass(frozen=True, slots=True)
class PackForward:
    """How a pack's log-probs are computed (`pack_logprobs`): the same for every pass.

    Attributes:
        attention: ``model.packed_attention``.
        chunk_tokens: ``train.logits_chunk_tokens``.
        temperature: ``rollout.temperature`` (the trainer scores what the engine sampled).
        share_prompts: write a group's prompt once per pack (``train.share_prompts``, where the
            model's attention path can: `packrl.models.attention.supports_shared_prompts`).
    """

    attention: str
    chunk_tokens: int
    temperature: float
    share_prompts: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig, share_prompts: bool = False) -> PackForward:
        return cls(cfg.model.packed_attention, cfg.train.logits_chunk_tokens, cfg.rollout.temperature, share_prompts)

    def pack(self, rollout: RolloutBatch, indices: Sequence[int], device: torch.device) -> Pack:
        """The micro-batch ``indices`` of ``rollout`` as one pack: a group's prompt written once
        when prompts are shared (`packrl.seqlen.packing.pack_shared`), else every sequence whole."""
        if self.share_prompts:
            return pack_shared([rollout.prompt_ids_of(i) for i in indices], [rollout.responses[i].response_ids for i in indices],
                               indices).to(device)
        return pack_sequences([sequence_ids(rollout, i) for i in indices], indices=indices).to(device)

    def __call__(self, model: torch.nn.Module, pack: Pack, needed: torch.Tensor, entropy_grad: bool = False) -> Any:
        return pack_logprobs(model, pack, attention=self.attention, chunk_tokens=self.chunk_tokens,
                             temperature=self.temperature, entropy_grad=entropy_grad, needed=needed)


def sequence_ids(rollout: RolloutBatch, i: int) -> torch.Tensor:
    """Prompt + response ids of sequence i. Shape [T_i], int64."""
    return torch.tensor(rollout.prompt_ids_of(i) + rollout.responses[i].response_ids, dtype=torch.long)


def _response_parts(pack: Pack, values: torch.Tensor, rollout: RolloutBatch) -> list[torch.Tensor]:
    """The last R_i entries of each packed sequence's per-token ``values`` ([K])."""
    return [part[len(part) - len(rollout.responses[i].response_ids):] for i, part in zip(pack.indices, pack.unpack(values))]


def scatter_response(pack: Pack, rollout: RolloutBatch, per_seq: Sequence[torch.Tensor] | dict[int, torch.Tensor],
                      fill: float | bool) -> torch.Tensor:
    """Lay per-response values ([R_i] each, indexed like the rollout) over the pack: each
    response fills the last R_i tokens of its sequence's own segment; prompt tokens (shared or
    not) get ``fill``. Returns Shape [K]."""
    device = pack.input_ids.device
    template = per_seq[pack.indices[0]]  # the dtype every part takes
    parts = []
    for length, owner in zip(pack.seq_lens, pack.segment_owners()):
        if owner < 0:  # a shared prompt segment
            parts.append(template.new_full((length,), fill, device=device))
        else:  # the sequence's own segment: its response is the last R_i tokens
            values = per_seq[pack.indices[owner]].to(device)
            parts.append(torch.cat([values.new_full((length - len(values),), fill), values]))
    return torch.cat(parts)


def _response_positions(pack: Pack, rollout: RolloutBatch) -> torch.Tensor:
    """True at every response token of the pack. Shape [K], bool."""
    ones = {i: torch.ones(len(rollout.responses[i].response_ids), dtype=torch.bool) for i in pack.indices}
    return scatter_response(pack, rollout, ones, False)


def _rollout_logprobs(pack: Pack, rollout: RolloutBatch) -> torch.Tensor | None:
    """The engine's log-probs laid over the pack (Shape [K], float32), or None when a response lacks them."""
    values = {i: rollout.responses[i].rollout_logprobs for i in pack.indices}
    if any(v is None for v in values.values()):
        return None
    return scatter_response(pack, rollout, {i: torch.tensor(v, dtype=torch.float32) for i, v in values.items()}, 0.0)


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
            result = forward(model, pack, _response_positions(pack, rollout))
            sp = ulysses.active()
            if sp is not None:  # each rank holds the log-probs its tokens predict: sum the shards
                sp.all_reduce(result.token_logprobs)
                sp.all_reduce(result.entropy)
            for lp, ent in zip(_response_parts(pack, result.token_logprobs, rollout), _response_parts(pack, result.entropy, rollout)):
                out.append((lp.float().cpu(), ent.float().cpu()))
    model.train(was_training)
    return out


@dataclass
class StepTotals:
    """What one optimizer step leaves on one rank: metrics summed over its micro-batches (each
    already a share of a mini-batch value, so ranks add up too) and the packs' shape."""

    metrics: dict[str, float] = field(default_factory=dict)
    num_microbatches: int = 0
    max_microbatch_tokens: int = 0
    max_rank_tokens: int = 0
    num_positions: int = 0
    num_real_tokens: int = 0
    num_shared_tokens_saved: int = 0
    pending: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """Metric sums still on the device, read back once by `finish`."""

    def add(self, metrics: dict[str, torch.Tensor | float]) -> None:
        """Add one micro-batch's metrics: tensors are summed where they are (no device sync), numbers at once."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                self.pending[name] = self.pending[name] + value if name in self.pending else value
            else:
                self.metrics[name] = self.metrics.get(name, 0.0) + float(value)

    def finish(self) -> StepTotals:
        """Read the device sums back to the host, one copy per optimizer step; returns self."""
        if self.pending:
            names = list(self.pending)
            values = torch.stack([self.pending[n].double().reshape(()) for n in names]).cpu().tolist()
            for name, value in zip(names, values):
                self.metrics[name] = self.metrics.get(name, 0.0) + value
            self.pending = {}
        return self


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
    """How a micro-batch's loss is formed: the registered policy loss (``algorithm.policy_loss``),
    the ``algorithm`` section and the pack forward."""

    policy_loss: PolicyLossFn
    algo: AlgorithmConfig
    forward: PackForward

    @classmethod
    def from_config(cls, cfg: RunConfig, share_prompts: bool = False) -> MicrobatchLoss:
        """Raises: ValueError: ``algorithm.policy_loss`` is not registered (names the nearest)."""
        return cls(POLICY_LOSSES.lookup(cfg.algorithm.policy_loss), cfg.algorithm, PackForward.from_config(cfg, share_prompts))


def sequence_counts(pack: Pack, batch: TrainBatch, full_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """The loss tokens of each packed sequence as ``seq-mean-token-mean`` divides by them, Shape
    [S], float: counted from ``full_mask`` (Shape [K], bool, the whole micro-batch's loss tokens),
    or for step-wise samples their trajectory's count (`TrainBatch.trajectory_loss_tokens`), since
    the trajectory is the sequence the seq-mean modes average over."""
    if batch.trajectory_loss_tokens is None:
        return torch.zeros(len(pack.indices), device=full_mask.device).index_add_(0, seq_ids, full_mask.float())
    return torch.tensor([float(batch.trajectory_loss_tokens[i]) for i in pack.indices], device=full_mask.device)


def microbatch_loss(model: torch.nn.Module, pack: Pack, batch: TrainBatch, *, den: LossDenominators, loss: MicrobatchLoss,
                    totals: StepTotals, sums: ResponseSums) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss: the policy loss (times the truncated
    importance weights of ``algorithm.rollout_correction`` when the batch carries them; the
    batch's ``extras`` reach the loss laid over the pack) aggregated by
    ``algorithm.loss_agg_mode``, plus ``kl_coef`` x the KL to the reference (unless it is in the
    reward), minus ``entropy_coeff`` x the entropy. Adds the micro-batch's metrics to ``totals``."""
    algo, rollout = loss.algo, batch.rollout
    out = loss.forward(model, pack, _response_positions(pack, rollout), entropy_grad=algo.entropy_coeff > 0)
    full_mask = scatter_response(pack, rollout, batch.loss_masks, False)
    mask = full_mask & out.has_logprob  # under sequence parallelism: the tokens this rank's hidden states predict
    seq_ids = pack.sequence_ids()
    counts = sequence_counts(pack, batch, full_mask, seq_ids)
    logprobs = out.token_logprobs
    old = logprobs.detach() if batch.old_logprobs is None else scatter_response(pack, rollout, batch.old_logprobs, 0.0)
    ref = None if batch.ref_logprobs is None else scatter_response(pack, rollout, batch.ref_logprobs, 0.0)
    extras = {name: scatter_response(pack, rollout, values, 0) for name, values in batch.extras.items()}
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=old, advantages=scatter_response(pack, rollout, batch.advantages, 0.0),
                              loss_mask=mask, sequence_ids=seq_ids, denominators=den, cfg=algo, ref_logprobs=ref,
                              rollout_logprobs=_rollout_logprobs(pack, rollout), extras=extras)
    result = _checked(loss.policy_loss(inputs), logprobs, algo.policy_loss)
    token_loss = weighted_token_loss(result.token_loss, extras)  # x the truncated importance weights, when set
    pg = aggregate_loss(token_loss, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
    ent = aggregate_loss(out.entropy, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
    total = pg - algo.entropy_coeff * ent
    clipped = result.clipped if result.clipped is not None else torch.zeros_like(mask)
    token_kl = old - logprobs.detach()  # ppo_kl per token, the bucket KL without a reference
    metrics: dict[str, torch.Tensor | float] = {"actor/pg_loss": pg.detach(), "actor/entropy": ent.detach(),
                                                "actor/pg_clipfrac": den.token_share(clipped, mask),
                                                "actor/ppo_kl": den.token_share(token_kl, mask), "actor/kl_loss": 0.0}
    if ref is not None:
        ref_kl = kl_penalty(logprobs, ref, algo.kl_estimator)
        token_kl = ref_kl.detach()
        if not algo.kl_in_reward:
            kl = aggregate_loss(ref_kl, mask, algo.loss_agg_mode, den, sequence_ids=seq_ids, sequence_counts=counts)
            total = total + algo.kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
    sums.add(pack, mask, out.entropy, clipped, token_kl)
    totals.add(metrics | result.metrics)
    totals.num_microbatches += 1
    totals.max_microbatch_tokens = max(totals.max_microbatch_tokens, pack.num_tokens)
    sp = ulysses.active()
    totals.max_rank_tokens = max(totals.max_rank_tokens, pack.num_tokens if sp is None else sp.padded(pack.num_tokens) // sp.size)
    totals.num_positions += pack.input_ids.numel()
    totals.num_real_tokens += pack.num_tokens  # a pack has no padding
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


@dataclass(frozen=True)
class Parallel:
    """What the parallelism strategy adds to the micro-batch loop.

    Attributes:
        grad_sync: called with True before a mini-batch's last backward and False before the
            others (FSDP's ``set_requires_gradient_sync``: gradients reduced once per mini-batch);
            None in one process.
        loss_scale: multiplies the loss before the backward (the rank count under FSDP, whose
            reduce-scatter averages gradients over ranks); metrics are not scaled.
    """

    grad_sync: Callable[[bool], None] | None = None
    loss_scale: float = 1.0


def run_microbatches(model: torch.nn.Module, batch: TrainBatch, microbatches: Sequence[Sequence[int]], *, den: LossDenominators,
                     loss: MicrobatchLoss, context: Context, sums: ResponseSums, tracer: NullTracer = NullTracer(),
                     parallel: Parallel = Parallel()) -> StepTotals:
    """Forward and backward each micro-batch; gradients accumulate in ``model``.

    Args:
        microbatches: sequence indices per micro-batch; an empty one (a data-parallel rank with
            fewer sequences) runs a one-token forward and a zero backward, so every rank runs the
            same number of passes.
        den: the mini-batch's global denominators (all ranks together).
        context: each forward's context (autocast, activation offload).
    """
    if den.num_tokens == 0:
        logger.warning("a mini-batch has no loss tokens (all masked, e.g. algorithm.truncated=mask with every "
                       "response truncated); it contributes no gradient: raise rollout.max_response_tokens")
    device = next(model.parameters()).device
    totals = StepTotals()
    for k, indices in enumerate(microbatches):
        if parallel.grad_sync is not None:
            parallel.grad_sync(k == len(microbatches) - 1)
        if not indices:
            with context():
                idle = _idle_forward(model).sum() * 0.0
            idle.backward()
            continue
        pack = loss.forward.pack(batch.rollout, indices, device)
        sp = ulysses.active()
        before = (sp.all_to_all_s, sp.num_exchanges) if sp is not None else None
        with tracer.microbatch(num_sequences=len(indices), num_tokens=pack.num_tokens, num_positions=pack.input_ids.numel()):
            with context():
                share = microbatch_loss(model, pack, batch, den=den, loss=loss, totals=totals, sums=sums)
            (share * parallel.loss_scale if parallel.loss_scale != 1.0 else share).backward()  # outside autocast, as torch recommends
        if sp is not None:
            tracer.all_to_all(sp.all_to_all_s - before[0], sp.num_exchanges - before[1])
    return totals.finish()


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


@dataclass
class UpdateStats:
    """What one rank's update leaves for the metrics: per optimizer step its totals, gradient
    norm and learning rate, the per-response sums, the skip count so far and the bytes of saved
    activations the update moved to host memory (``model.activation_offload``)."""

    steps: list[tuple[StepTotals, float, float]]
    sums: ResponseSums
    skipped_steps: int
    offloaded_bytes: int = 0
    all_to_all_s: float = 0.0


@dataclass(frozen=True)
class Optimization:
    """The optimizer side of an update: optimizer, LR schedule, skip counter, and the settings."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    skips: SkipCounter
    grad_clip: float


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


def run_update(model: torch.nn.Module, batch: TrainBatch, plan: UpdatePlan, *, rank: int, loss: MicrobatchLoss, opt: Optimization,
               context: Context, tracer: NullTracer = NullTracer(), parallel: Parallel = Parallel()) -> UpdateStats:
    """Rank ``rank``'s part of ``plan``: ``num_epochs`` passes over the mini-batches, each its
    micro-batches' forwards and backwards and one optimizer step (`optimizer_step`)."""
    sums = ResponseSums.zeros(len(batch.rollout))
    steps: list[tuple[StepTotals, float, float]] = []
    model.train()
    for _ in range(plan.num_epochs):
        for minibatch in plan.minibatches:
            totals = run_microbatches(model, batch, minibatch.microbatches(rank), den=minibatch.denominators, loss=loss,
                                      context=context, sums=sums, tracer=tracer, parallel=parallel)
            steps.append((totals, *optimizer_step(model, opt)))
    return UpdateStats(steps, sums.finish(), opt.skips.total)


def update_metrics(ranks: Sequence[UpdateStats], batch: TrainBatch, max_response_tokens: int) -> dict[str, float]:
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
        ``perf/all_to_all_s`` and ``seqlen/microbatch_tokens_per_rank_max`` (with sequence
        parallelism: forward all-to-all seconds of the update and tokens of the largest shard),
        and ``bucket/entropy|clipfrac|kl/<lo>-<hi>`` (per-response means over loss tokens and
        every pass, averaged per response-length bucket; kl is the token KL estimate to the
        reference, else ``old_logprobs - logprobs``).
    """
    first = ranks[0]
    count = len(first.steps)
    totals = [t for r in ranks for t, _, _ in r.steps]
    names = sorted({name for t in totals for name in t.metrics})
    lengths = [len(r.response_ids) for r in batch.rollout.responses]
    positions = sum(t.num_positions for t in totals)
    out = ResponseSums.merged([r.sums for r in ranks]).metrics(lengths, max_response_tokens)
    out |= {name: sum(t.metrics.get(name, 0.0) for t in totals) / count for name in names}
    out |= {
        "actor/grad_norm": sum(g for _, g, _ in first.steps) / count,
        "actor/lr": first.steps[-1][2],
        "train/skipped_steps": float(first.skipped_steps),
        "seqlen/num_microbatches": float(max(sum(t.num_microbatches for t, _, _ in r.steps) for r in ranks)),
        "seqlen/microbatch_tokens_max": float(max(t.max_microbatch_tokens for t in totals)),
        "seqlen/pad_fraction": 1.0 - sum(t.num_real_tokens for t in totals) / max(1, positions),
    }
    saved = sum(t.num_shared_tokens_saved for t in totals)
    if saved:
        out["seqlen/shared_prompt_tokens_saved"] = float(saved)
    if any(r.offloaded_bytes for r in ranks):
        out["perf/offloaded_activation_gib"] = max(r.offloaded_bytes for r in ranks) / 2**30
    if any(r.all_to_all_s for r in ranks):
        out["perf/all_to_all_s"] = max(r.all_to_all_s for r in ranks)
        out["seqlen/microbatch_tokens_per_rank_max"] = float(max(t.max_rank_tokens for t in totals))
    return out
