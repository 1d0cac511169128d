"""`UpdateSpec`: what a recipe asks of the policy update, the one value the worker group's update
takes from either recipe.

The update machinery (token-budgeted micro-batches, packing, chunked log-probs, global
denominators, FSDP2 ranks, the optimizer step: `packrl.worker`) is the same for every recipe;
what differs is the loss, its aggregation, the optimizer's settings and how many optimizer steps
a batch gets. RL builds its spec from ``algorithm`` and ``train`` (`UpdateSpec.rl`); `packrl sft`
builds its own from the ``sft`` section (`packrl.trainer.sft.update_spec`), so a supervised run
never passes through the RL rules, and the workers never ask which recipe they serve.
`packrl.config.plan.BatchPlan` carries the spec to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packrl.config.schema import AlgorithmConfig, TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """The actor's AdamW and its schedule (`packrl.worker.optim.Optimization.build`).

    Attributes:
        lr: the learning rate after warm-up.
        weight_decay: AdamW weight decay.
        warmup_steps: optimizer steps of linear warm-up from 0 (0: none).
        grad_clip: the global gradient norm's clip (0: off).
        max_consecutive_skips: non-finite gradient norms in a row that stop the run.
        lr_key: the config key of ``lr``, named in errors (``train.lr``, ``sft.lr``).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    max_consecutive_skips: int = 3
    lr_key: str = "train.lr"

    @classmethod
    def of(cls, train: TrainConfig, *, lr: float | None = None, lr_key: str = "train.lr") -> OptimizerSpec:
        """The ``train`` section's settings, with ``lr`` (named ``lr_key``) in place of ``train.lr`` when given."""
        return cls(lr=train.lr if lr is None else lr, weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
                   grad_clip=train.grad_clip, max_consecutive_skips=train.max_consecutive_skips, lr_key=lr_key)


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSpec:
    """How one update trains the policy.

    Attributes:
        algorithm: the loss: ``policy_loss`` (a name in `packrl.registry.POLICY_LOSSES`) with its
            options (``policy_loss_args``), ``loss_agg_mode``, the KL and entropy weights and the
            clip ranges; what a policy loss receives as ``PolicyLossInputs.cfg``.
        optimizer: AdamW and its schedule (`OptimizerSpec`).
        mini_batch_size: groups (prompts, or traces) per optimizer step.
        num_epochs: passes over each step's batch.
        temperature: the temperature the policy's log-probs are taken at (RL: the sampling
            temperature, so the trainer scores what the engine sampled; supervised: 1).
        loss_metric: the name the aggregated policy loss is logged under (``actor/pg_loss``, ``sft/loss``).
        rl_metrics: log the diagnostics of a ratio-based update: ``actor/pg_clipfrac``,
            ``actor/ppo_kl``, ``actor/kl_loss`` and the per-length ``bucket/*`` (False for a
            supervised objective: no old policy, clip or reference to report on).
    """

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    mini_batch_size: int = 1
    num_epochs: int = 1
    temperature: float = 1.0
    loss_metric: str = "actor/pg_loss"
    rl_metrics: bool = True

    @property
    def policy_loss(self) -> str:
        return self.algorithm.policy_loss

    @property
    def loss_agg_mode(self) -> str:
        return self.algorithm.loss_agg_mode

    @classmethod
    def rl(cls, algorithm: AlgorithmConfig, train: TrainConfig, *, batch_size: int, temperature: float) -> UpdateSpec:
        """RL's update: ``algorithm``'s loss; ``train``'s optimizer (``train.lr``, ``weight_decay``,
        ``warmup_steps``, ``grad_clip``, ``max_consecutive_skips``), mini-batches
        (``train.mini_batch_size``, or ``batch_size``: ``data.batch_size``) and epochs
        (``train.ppo_epochs``); log-probs at the sampling ``temperature`` (``rollout.temperature``)."""
        return cls(algorithm=algorithm, optimizer=OptimizerSpec.of(train), mini_batch_size=train.mini_batch_size or batch_size,
                   num_epochs=train.ppo_epochs, temperature=temperature)
