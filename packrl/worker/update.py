"""The update loop, once for every model a worker trains (the actor and the critic): a rank's part
of the controller's `packrl.seqlen.update_plan.UpdatePlan`, each mini-batch's micro-batches
forward and backward (gradients accumulate), one optimizer step per mini-batch.

Shapes: ``K`` tokens in a pack.

What differs between the models is one function, the micro-batch's share of the mini-batch loss
(``loss(pack, denominators, totals) -> scalar``): the actor's policy loss
(`packrl.worker.actor`), the critic's value loss (`packrl.worker.critic`). Every loss term is
normalised by the mini-batch's denominators, counted once on the controller, so the gradient
does not depend on the micro-batch split or the rank count (invariant 4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from packrl.diagnostics.trace import NullTracer
from packrl.models import ulysses
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.packing import Pack
from packrl.seqlen.update_plan import UpdatePlan
from packrl.worker.optim import Optimization, optimizer_step
from packrl.worker.strategy import Parallel

logger = logging.getLogger(__name__)

Context = Callable[[], AbstractContextManager]

Around = Callable[[Pack | None, int], AbstractContextManager]
"""``around(pack, draw)``: the context one micro-batch's forward and backward run in, given its
pack (None: an idle rank's one-token forward) and its draw (the optimizer steps taken before its
mini-batch): the actor's LoRA dropout masks (`packrl.models.lora_dropout.dropout_draw`)."""


def no_draw(pack: Pack | None, draw: int) -> AbstractContextManager:
    """`Around` for a model without keyed dropout (the critic): nothing."""
    return nullcontext()


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
    max_grouped_loads: dict[str, int] = field(default_factory=dict)
    """Per grouped-cap load (`packrl.seqlen.packing.Pack.grouped_loads`), the most one micro-batch
    encoded (a vision-language model's ``vision_patches``)."""
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


MicrobatchLossFn = Callable[[Pack, LossDenominators, "StepTotals"], torch.Tensor]
"""``loss(pack, denominators, totals) -> scalar``: one micro-batch's share of the mini-batch loss
(differentiable), its metrics added to ``totals``."""

Step = tuple[StepTotals, float, float]
"""One optimizer step of one rank: its totals, the gradient norm and the learning rate."""


def run_microbatches(model: torch.nn.Module, microbatches: Sequence[Sequence[int]], *, den: LossDenominators, loss: MicrobatchLossFn,
                     pack: Callable[[Sequence[int]], Pack], idle: Callable[[], torch.Tensor], context: Context,
                     tracer: NullTracer = NullTracer(), parallel: Parallel = Parallel(), around: Around = no_draw,
                     draw: int = 0) -> StepTotals:
    """Forward and backward each micro-batch of one mini-batch; gradients accumulate in ``model``.

    Args:
        microbatches: sequence indices per micro-batch; an empty one (a data-parallel rank with
            fewer sequences) runs ``idle()`` (a one-token forward) and a zero backward, so every
            rank runs the same number of passes (FSDP gathers parameters in each).
        den: the mini-batch's global denominators (all ranks together).
        loss: the micro-batch's share of the mini-batch loss (`MicrobatchLossFn`).
        pack: sequence indices -> their pack, on the model's device.
        context: each forward's context (autocast, activation offload).
        parallel: the strategy's gradient sync and loss scale (`packrl.worker.strategy.Parallel`).
        around / draw: each micro-batch's forward and backward run in ``around(pack, draw)`` (`Around`).
    """
    if den.num_tokens == 0:
        logger.warning("a mini-batch has no loss tokens (all masked, e.g. algorithm.truncated=mask with every "
                       "response truncated); it contributes no gradient: raise rollout.max_response_tokens")
    totals = StepTotals()
    for k, indices in enumerate(microbatches):
        if parallel.grad_sync is not None:
            parallel.grad_sync(k == len(microbatches) - 1)
        if not indices:
            with around(None, draw):
                with context():
                    share = idle().sum() * 0.0
                share.backward()
            continue
        packed = pack(indices)
        sp = ulysses.active()
        before = (sp.all_to_all_s, sp.num_exchanges) if sp is not None else None
        with (tracer.microbatch(num_sequences=len(indices), num_tokens=packed.num_tokens, num_positions=packed.input_ids.numel()),
              around(packed, draw)):
            with context():
                share = loss(packed, den, totals)
            (share * parallel.loss_scale if parallel.loss_scale != 1.0 else share).backward()  # outside autocast, as torch recommends
        if sp is not None and before is not None:
            tracer.all_to_all(sp.all_to_all_s - before[0], sp.num_exchanges - before[1])
    return totals.finish()


def run_update(model: torch.nn.Module, plan: UpdatePlan, *, rank: int, loss: MicrobatchLossFn, pack: Callable[[Sequence[int]], Pack],
               idle: Callable[[], torch.Tensor], opt: Optimization, context: Context, tracer: NullTracer = NullTracer(),
               parallel: Parallel = Parallel(), around: Around = no_draw) -> list[Step]:
    """Rank ``rank``'s part of ``plan``: ``num_epochs`` passes over the mini-batches, each its
    micro-batches' forwards and backwards (`run_microbatches`, in ``around(pack, draw)``, the draw
    being the optimizer steps taken so far, `packrl.worker.optim.Optimization.num_steps`) and one
    optimizer step (`packrl.worker.optim.optimizer_step`). Returns every optimizer step of this rank."""
    steps: list[Step] = []
    model.train()
    for _ in range(plan.num_epochs):
        for minibatch in plan.minibatches:
            totals = run_microbatches(model, minibatch.microbatches(rank), den=minibatch.denominators, loss=loss, pack=pack, idle=idle,
                                      context=context, tracer=tracer, parallel=parallel, around=around, draw=opt.num_steps)
            steps.append((totals, *optimizer_step(model, opt)))
    return steps


def step_metrics(ranks: Sequence[Sequence[Step]], prefix: str) -> dict[str, float]:
    """The metrics of every rank's optimizer steps (one rank in a single process): each loss term
    and metric summed over micro-batches and ranks (each a share of a globally normalised value)
    and averaged over optimizer steps, and ``<prefix>/grad_norm`` (averaged) and ``<prefix>/lr``
    (the last step's), the same on every rank (verl's names)."""
    first, count = ranks[0], len(ranks[0])
    totals = [t for steps in ranks for t, _, _ in steps]
    names = sorted({name for t in totals for name in t.metrics})
    out = {name: sum(t.metrics.get(name, 0.0) for t in totals) / count for name in names}
    return out | {f"{prefix}/grad_norm": sum(g for _, g, _ in first) / count, f"{prefix}/lr": first[-1][2]}
