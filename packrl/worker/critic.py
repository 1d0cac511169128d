"""The critic of PPO with a value model: its model, its value pass and its update, on packed,
token-budgeted micro-batches exactly like the actor's (`packrl.worker.actor`).

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``K`` tokens in a pack.

The value model is the policy's architecture with its LM head replaced by a scalar head
(`ValueModel`; verl builds ``AutoModelForTokenClassification`` with one label the same way), loaded
from ``critic.model.path`` or the policy's checkpoint. ``values[k]`` of a pack is V of the state
after token k, so the value of the state before response token k (the one GAE pairs with it) is
``values[k - 1]``, the same alignment as the log-probs, and a sequence's last position gives the
value after its last token (the bootstrap of a truncated response, `packrl.algos.gae`).

The value loss is PPO's clipped value loss (verl ``core_algos.compute_value_loss``):

    V_clip = V_old + clip(V - V_old, -c, c)        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

with ``c = critic.cliprange_value`` and R the GAE returns, aggregated by ``algorithm.loss_agg_mode``
over the mini-batch's global denominators, so it does not depend on the micro-batch split or the
rank count (invariant 4), as the actor's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from packrl.algos.loss_agg import aggregate_loss
from packrl.config.schema import CriticConfig, LossAggMode, ModelConfig, RunConfig, TrainConfig
from packrl.hardware import ComputeDtype
from packrl.models.attention import PackedAttention, packed_forward
from packrl.models.compile import CompiledLayers, active
from packrl.seqlen.denominators import LossDenominators
from packrl.seqlen.packing import Pack, pack_sequences
from packrl.seqlen.update_plan import UpdatePlan
from packrl.types import RolloutBatch, TrainBatch
from packrl.worker.checkpoint import full_optimizer_state, load_optimizer_and_schedule
from packrl.worker.optim import Optimization
from packrl.worker.packs import PackForward, scatter_response, sequence_counts
from packrl.worker.strategy import Parallel
from packrl.worker.update import Context, Step, StepTotals, run_microbatches, run_update, step_metrics

CRITIC_FILE = "critic.pt"
"""The critic's weights, optimizer, schedule and skip counter inside a checkpoint folder."""


class ValueModel(torch.nn.Module):
    """A decoder with a scalar value head.

    Args:
        decoder: a transformers decoder (``causal_lm.get_decoder()``), its attention set up for
            packs (`packrl.models.attention.use_packed_attention`).
        config: the causal LM's config (``hidden_size``, the attention implementation).
        attention: ``model.packed_attention``.
        head_std: std of the value head's initial weights (bias 0). 0 (the default) starts every
            value at exactly 0: a random head on a pretrained model's hidden states starts far
            from the rewards (SmolLM2-135M: values near 1.0 against rewards near 0.03), and GAE
            then bootstraps the responses a budget cut from that guess, which rewards running into
            the budget until the critic has learned. With a zero head the first advantages are the
            rewards-to-go and the head learns from the first step (its gradient is not zero).
        seed: seeds a random head (``train.seed``), so every data-parallel rank starts alike.
    """

    def __init__(self, decoder: torch.nn.Module, config: Any, attention: PackedAttention = "varlen", head_std: float = 0.0,
                 seed: int = 0):
        super().__init__()
        self.model, self.config, self.attention = decoder, config, attention
        self.value_head = torch.nn.Linear(config.hidden_size, 1, dtype=next(decoder.parameters()).dtype)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(self.value_head.weight.shape, generator=generator) * head_std)
            self.value_head.bias.zero_()

    def get_decoder(self) -> torch.nn.Module:
        return self.model

    def forward(self, pack: Pack) -> torch.Tensor:
        """V of the state after each token of ``pack``, each sequence seeing only itself.
        Shape [K], float32 (float64 for a float64 model, ``model.dtype=fp64``)."""
        hidden = packed_forward(self, pack, self.attention)  # [K, H]
        values = self.value_head(hidden).squeeze(-1)
        return values if values.dtype == torch.float64 else values.float()


def load_critic(model_cfg: ModelConfig, critic_cfg: CriticConfig, seed: int, device: torch.device,
                compute_dtype: ComputeDtype | None = None) -> ValueModel:
    """The value model: ``critic.model.path`` (or ``model.path``) loaded as the policy is
    (`packrl.models.loading.load_policy`: float32 master weights, packed attention, gradient
    checkpointing as ``model.gradient_checkpointing``; never LoRA), its LM head dropped.

    Args:
        model_cfg / critic_cfg: the ``model`` and ``critic`` sections.
        seed: ``train.seed`` (the value head's start).

    Raises:
        ValueError: any error of `load_policy` for that path.
    """
    from packrl.models.loading import load_policy

    backbone = replace(model_cfg, path=critic_cfg.model.path or model_cfg.path, lora=replace(model_cfg.lora, rank=0))
    causal_lm, _ = load_policy(backbone, device=device, compute_dtype=compute_dtype)
    critic = ValueModel(causal_lm.get_decoder(), causal_lm.config, model_cfg.packed_attention, seed=seed).to(device)
    return critic.train()


def load_critic_weights(critic: ValueModel, weights: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into ``critic`` (sharding it when FSDP2 wrapped the critic).

    Raises:
        ValueError: the weights do not fit the critic (another model's checkpoint).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    try:
        if isinstance(critic, FSDPModule):
            # torch annotates an invariant dict of the union of every state-dict value: a dict of tensors is one
            set_model_state_dict(critic, cast("dict[str, Any]", weights), options=StateDictOptions(full_state_dict=True))
        else:
            critic.load_state_dict(weights)
    except (RuntimeError, KeyError) as err:
        raise ValueError(f"the checkpoint's critic weights do not fit this critic ({err}); resume with the "
                         "critic.model.path / model.path of the run that wrote it") from err


def _value_before(values: torch.Tensor, pack: Pack) -> torch.Tensor:
    """At each token k, V of the state before it: ``values`` at the position that predicts k
    (`Pack.predictions`: the previous token, or a shared prompt's last one); 0 at sequence starts. Shape [K]."""
    sources, targets = pack.predictions()
    return values.new_zeros(values.shape).index_put((targets,), values[sources])


def _idle_forward(critic: ValueModel) -> torch.Tensor:
    """A one-token forward, for a rank with no sequence left (every rank runs the same forwards)."""
    device = next(critic.parameters()).device
    return critic(pack_sequences([torch.zeros(1, dtype=torch.long)]).to(device))


def compute_values(critic: ValueModel, rollout: RolloutBatch, microbatches: Sequence[Sequence[int]], *,
                   context: Context, forward: PackForward) -> list[tuple[torch.Tensor, float]]:
    """No-grad values of every planned sequence, in plan order.

    Returns:
        ``(values, bootstrap)`` per sequence: V before each response token, Shape [R_i], float32,
        on the CPU; and V after the sequence's last token, a float.
    """
    device = next(critic.parameters()).device
    out: list[tuple[torch.Tensor, float]] = []
    was_training = critic.training
    critic.eval()
    with torch.no_grad(), context():
        for indices in microbatches:
            if not indices:
                _idle_forward(critic)
                continue
            pack = forward.pack(rollout, indices, device)
            values = critic(pack)
            values, before_all = torch.stack([values, _value_before(values, pack)]).float().cpu()  # one copy to the host
            for i, part, before in zip(pack.indices, pack.unpack(values), pack.unpack(before_all)):
                r = len(rollout.responses[i].response_ids)
                out.append((before[len(before) - r:].clone(), float(part[-1])))
    critic.train(was_training)
    return out


def value_loss(vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token (module docstring; verl ``compute_value_loss``).

    Args:
        vpred: the critic's current values. Shape [K], float32, differentiable.
        old_values: the values at rollout time. Shape [K], float32.
        returns: the regression targets. Shape [K], float32.
        cliprange: ``critic.cliprange_value``.

    Returns:
        ``(token_loss, clip_active)``: ``0.5 * max((V - R)^2, (V_clip - R)^2)``, Shape [K] float32,
        and True where the clipped term is the larger (``critic/vf_clipfrac``), Shape [K] bool.
    """
    clipped = old_values + (vpred - old_values).clamp(-cliprange, cliprange)
    unclipped_loss, clipped_loss = (vpred - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def critic_microbatch_loss(critic: ValueModel, pack: Pack, batch: TrainBatch, *, den: LossDenominators, cliprange: float,
                           mode: LossAggMode, totals: StepTotals) -> torch.Tensor:
    """This micro-batch's share of the mini-batch value loss (module docstring), with its metrics
    (``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``) added to ``totals``."""
    assert batch.values is not None and batch.returns is not None, "the critic trains on a batch with values and returns"
    rollout = batch.rollout
    vpred = _value_before(critic(pack), pack)
    mask = scatter_response(pack, rollout, batch.loss_masks, False)
    old = scatter_response(pack, rollout, batch.values, 0.0)
    returns = scatter_response(pack, rollout, batch.returns, 0.0)
    token_loss, clip_active = value_loss(vpred, old, returns, cliprange)
    seq = pack.sequence_ids()
    loss = aggregate_loss(token_loss, mask, mode, den, sequence_ids=seq, sequence_counts=sequence_counts(pack, batch, mask, seq))
    totals.add({"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": den.token_share(clip_active.float(), mask),
                "critic/vpred_mean": den.token_share(vpred.detach(), mask)})
    return loss


@dataclass
class CriticStats:
    """What one rank's critic update leaves: its optimizer steps (`packrl.worker.update.Step`)."""

    steps: list[Step]


def critic_update(critic: ValueModel, batch: TrainBatch, plan: UpdatePlan, *, rank: int, opt: Optimization, context: Context,
                  cliprange: float, mode: LossAggMode, forward: PackForward, parallel: Parallel = Parallel()) -> CriticStats:
    """Rank ``rank``'s part of ``plan`` for the critic (`packrl.worker.update.run_update` with
    `critic_microbatch_loss`)."""
    device = next(critic.parameters()).device
    steps = run_update(critic, plan, rank=rank, loss=_loss_fn(critic, batch, cliprange, mode),
                       pack=lambda indices: forward.pack(batch.rollout, indices, device), idle=partial(_idle_forward, critic),
                       opt=opt, context=context, parallel=parallel)
    return CriticStats(steps)


def critic_microbatches(critic: ValueModel, batch: TrainBatch, microbatches: Sequence[Sequence[int]], *, den: LossDenominators,
                        context: Context, cliprange: float, mode: LossAggMode, forward: PackForward,
                        parallel: Parallel = Parallel()) -> StepTotals:
    """One mini-batch's micro-batches of the critic forward and backward
    (`packrl.worker.update.run_microbatches`); gradients accumulate in ``critic``."""
    device = next(critic.parameters()).device
    return run_microbatches(critic, microbatches, den=den, loss=_loss_fn(critic, batch, cliprange, mode),
                            pack=lambda indices: forward.pack(batch.rollout, indices, device), idle=partial(_idle_forward, critic),
                            context=context, parallel=parallel)


def _loss_fn(critic: ValueModel, batch: TrainBatch, cliprange: float, mode: LossAggMode) -> Any:
    """`critic_microbatch_loss` as the update loop's ``loss(pack, denominators, totals)``."""
    return lambda pack, den, totals: critic_microbatch_loss(critic, pack, batch, den=den, cliprange=cliprange, mode=mode, totals=totals)


def critic_metrics(ranks: Sequence[CriticStats]) -> dict[str, float]:
    """``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean`` (mini-batch values summed
    over micro-batches and ranks, averaged over optimizer steps), ``critic/grad_norm`` and
    ``critic/lr`` (verl's names; `packrl.worker.update.step_metrics`)."""
    return step_metrics([r.steps for r in ranks], "critic")


def critic_optimization(critic: ValueModel, critic_cfg: CriticConfig, train: TrainConfig) -> Optimization:
    """AdamW at ``critic.lr`` (``train.weight_decay``), the actor's warm-up schedule shape, the
    actor's skip rule, and ``critic.grad_clip`` (`packrl.worker.optim.Optimization.build`; the
    ``critic`` and ``train`` sections)."""
    return Optimization.build([p for p in critic.parameters() if p.requires_grad], lr=critic_cfg.lr,
                              weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
                              max_consecutive_skips=train.max_consecutive_skips, grad_clip=critic_cfg.grad_clip,
                              lr_key="critic.lr")


@dataclass
class CriticRole:
    """The critic a worker holds (PPO with a value model, `BatchPlan.has_critic`): its model, its
    optimization and its compiled twin, and what it does: values, its update, its checkpoint state.

    Attributes:
        model: the value model, wrapped by the worker's strategy.
        opt: AdamW at ``critic.lr`` (`critic_optimization`).
        compiled: the compiled twin of its decoder layers (``model.compile``), or None.
        cliprange: ``critic.cliprange_value``.
        loss_agg_mode: ``algorithm.loss_agg_mode``.
        lr: ``critic.lr``, applied again when a checkpoint is restored.
        source: where its backbone came from (``critic.model.path`` or ``model.path``).
    """

    model: ValueModel
    opt: Optimization
    compiled: CompiledLayers | None
    cliprange: float
    loss_agg_mode: LossAggMode
    lr: float
    source: str

    @classmethod
    def build(cls, cfg: RunConfig, strategy: Any, compute_dtype: ComputeDtype, *, compile_layers: bool) -> CriticRole:
        """Load the value model (`load_critic`), wrap it with ``strategy``, then its optimizer and
        (with ``compile_layers``) its compiled twin, in that order (the optimizer sees the wrapped
        parameters)."""
        model = load_critic(cfg.model, cfg.critic, cfg.train.seed, strategy.device, compute_dtype)
        strategy.wrap(model)
        return cls(model, critic_optimization(model, cfg.critic, cfg.train), CompiledLayers(model) if compile_layers else None,
                   cfg.critic.cliprange_value, cfg.algorithm.loss_agg_mode, cfg.critic.lr, cfg.critic.model.path or cfg.model.path)

    def describe(self) -> str:
        """The phrase of the run's model summary."""
        return f"critic: {sum(p.numel() for p in self.model.parameters()):,} parameters from {self.source} (value head starts at 0)"

    def values(self, rollout: RolloutBatch, microbatches: Sequence[Sequence[int]], *, context: Context,
               forward: PackForward) -> list[tuple[torch.Tensor, float]]:
        """`compute_values` of this rank's micro-batches, compiled layers on when there are any."""
        with active(self.compiled):
            return compute_values(self.model, rollout, microbatches, context=context, forward=forward)

    def update(self, batch: TrainBatch, plan: UpdatePlan, *, rank: int, context: Context, forward: PackForward,
               parallel: Parallel) -> CriticStats:
        """`critic_update` of this rank's part of ``plan``."""
        with active(self.compiled):
            return critic_update(self.model, batch, plan, rank=rank, opt=self.opt, context=context, cliprange=self.cliprange,
                                 mode=self.loss_agg_mode, forward=forward, parallel=parallel)

    def state(self, weights: dict[str, torch.Tensor] | None) -> dict:
        """Full weights (``weights``, gathered by the strategy, or this process's), optimizer,
        schedule and skip counter: the contents of `CRITIC_FILE`."""
        return {"weights": self.model.state_dict() if weights is None else weights,
                "optimizer": full_optimizer_state(self.model, self.opt.optimizer),
                "scheduler": self.opt.scheduler.state_dict(), "skips": self.opt.skips.state_dict()}

    def load(self, path: Path) -> None:
        """Restore from ``path``'s `CRITIC_FILE`.

        Raises:
            ValueError: the checkpoint has no critic (a run without one wrote it) or one that does not fit.
        """
        file = path / CRITIC_FILE
        if not file.is_file():
            raise ValueError(f"{path} holds no critic ({CRITIC_FILE}): it was written by a run without one; resume it "
                             "with its own algorithm.adv_estimator / critic.enable, or start a new run")
        state = torch.load(file, map_location="cpu", weights_only=False)
        load_critic_weights(self.model, state["weights"])
        load_optimizer_and_schedule(self.model, self.opt.optimizer, self.opt.scheduler,
                                    {"optimizer": state["optimizer"], "scheduler": state["scheduler"]}, self.lr, file)
        self.opt.skips.load_state_dict(state.get("skips", {}))
