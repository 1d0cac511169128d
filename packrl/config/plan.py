"""`BatchPlan`: every size and switch a run derives from its config, computed once.

The config holds what the user wrote; values that follow from it (a ``None`` that means "the
batch size", the loss constant that defaults to the response budget, whether a reference model
exists, whether the old log-probs need their own forward) are derived here, once, and read from
here by the controller and the workers. They are never written back into the config. The plan is
written to ``RUN_DIR/budgets.txt`` with the token budgets.

The plan carries the recipe's `packrl.config.update_spec.UpdateSpec` (the loss, the optimizer, the
mini-batches and epochs) to every worker: RL's plan is `BatchPlan.from_config`, a recipe that
trains on given sequences builds `BatchPlan.supervised` from its own spec (`packrl sft`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packrl.config.grouped_caps import grouped_cap_limits
from packrl.config.rollout_modes import mode_info
from packrl.config.schema import RunConfig
from packrl.config.update_spec import UpdateSpec
from packrl.hardware import ComputeDtype, Host, resolve_dtype
from packrl.registry import FILTERS, POLICY_LOSSES
from packrl.seqlen.microbatch import CapLimit
from packrl.seqlen.update_plan import PassPlanner


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """Sizes per step.

    Attributes:
        num_prompts: prompts per step, B (``data.batch_size``).
        group_size: responses per prompt, G (``rollout.n``).
        update: the recipe's update (`UpdateSpec`: loss, optimizer, mini-batches, epochs);
            ``mini_batch_prompts``, ``num_epochs`` and ``loss_agg_mode`` read it.
        num_ranks: ranks (``trainer.num_workers``).
        sequence_parallel_size: ranks that split each pack (``trainer.sequence_parallel_size``).
        loss_scale_factor: the constant C of ``seq-mean-token-sum-norm`` in tokens
            (``algorithm.loss_scale_factor``, or ``rollout.max_response_tokens``: under a length
            curriculum the largest stage, so C stays one constant for the whole run).
        has_reference: a reference policy is loaded and scored (``algorithm.kl_coef > 0``).
        needs_old_logprobs: the old log-probs get their own forward. Not when the update is
            on-policy (one optimizer step per rollout: pi_old is the policy being updated, whose
            detached log-probs the loss uses, as TRL does with ``num_iterations=1``) unless
            in-reward KL, the rollout mismatch metrics (``rollout.return_logprobs``), rollout
            correction, the entropy filter (its entropy) or a policy loss that declares it reads
            them (`packrl.capabilities.LossInfo.reads_old_logprobs`: Clip-Cov's and KL-Cov's token
            selection) read them.
        has_critic: a value model is trained (``critic.enable``, by default with ``adv_estimator=gae``).
        return_logprobs: the engine returns its log-probs of the sampled tokens
            (``rollout.return_logprobs``, or ``algorithm.rollout_correction``, which reads them).
        adv_estimator: ``algorithm.adv_estimator`` (what a critic's values feed).
        old_logprobs_reason: the settings that make the update off-policy or read the old
            log-probs ("" when ``needs_old_logprobs`` is False).
        compute_dtype: ``model.dtype`` resolved for the machine (`packrl.hardware.resolve_dtype`:
            ``auto`` becomes bf16 or fp32), with the reason and any warning.
        max_tokens_per_microbatch: the actor's update budget per rank (``train.max_tokens_per_microbatch``).
        max_tokens_per_logprob_microbatch: the no-grad passes' budget per rank
            (``train.max_tokens_per_logprob_microbatch``; log-probs and values).
        critic_tokens_per_microbatch: the critic's update budget per rank
            (``critic.max_tokens_per_microbatch``, or the actor's).
        balance_microbatches: ``train.balance_microbatches``.
        grouped_caps: the micro-batch budgets beyond tokens, per rank, every pass
            (`packrl.config.grouped_caps.grouped_cap_limits`; empty: none).
        max_response_tokens: ``rollout.max_response_tokens`` (the largest curriculum stage).
        critic_warmup_steps: steps at the start in which only the critic trains (``critic.warmup_steps``).
        generates: the workers hold a rollout engine (``rollout.engine``); False for a recipe
            that trains on given sequences.
    """

    num_prompts: int
    group_size: int
    update: UpdateSpec
    num_ranks: int
    sequence_parallel_size: int
    loss_scale_factor: int
    has_reference: bool
    needs_old_logprobs: bool
    has_critic: bool = False
    return_logprobs: bool = False
    adv_estimator: str = "grpo"
    old_logprobs_reason: str = ""
    compute_dtype: ComputeDtype = ComputeDtype("fp32", "fp32", "as set")
    max_tokens_per_microbatch: int = 2048
    max_tokens_per_logprob_microbatch: int = 4096
    critic_tokens_per_microbatch: int = 2048
    balance_microbatches: bool = True
    grouped_caps: tuple[CapLimit, ...] = ()
    max_response_tokens: int = 512
    critic_warmup_steps: int = 0
    generates: bool = True

    @classmethod
    def from_config(cls, cfg: RunConfig, host: Host | None = None) -> BatchPlan:
        """RL's plan of ``cfg`` on ``host`` (default: this machine, read only when ``model.dtype`` is
        ``auto`` or ``bf16``; the controller decides for every rank)."""
        update = UpdateSpec.rl(cfg.algorithm, cfg.train, batch_size=cfg.data.batch_size, temperature=cfg.rollout.temperature)
        mini, algo = update.mini_batch_size, cfg.algorithm
        partial = mode_info(cfg.trainer.rollout_mode).carries_groups  # carried tokens are weighted by pi_old / pi_behaviour
        return_logprobs = cfg.rollout.return_logprobs or algo.rollout_correction.enabled or partial
        loss_reads_old = POLICY_LOSSES.info(algo.policy_loss).reads_old_logprobs
        reasons = [reason for applies, reason in (
            (cfg.train.ppo_epochs != 1, f"train.ppo_epochs={cfg.train.ppo_epochs}"),
            (mini != cfg.data.batch_size, f"train.mini_batch_size={mini} < data.batch_size={cfg.data.batch_size}"),
            (algo.kl_in_reward, "algorithm.kl_in_reward"),
            (cfg.rollout.return_logprobs or algo.rollout_correction.enabled, "rollout.return_logprobs or algorithm.rollout_correction"),
            *((True, f"algorithm.filters.{name} reads their entropy") for name in algo.filter_parts()
              if FILTERS.info(name).reads_old_entropy),
            (loss_reads_old, f"algorithm.policy_loss={algo.policy_loss} reads them"),
        ) if applies]
        has_critic = cfg.critic.enabled(algo.adv_estimator)
        return cls(
            num_prompts=cfg.data.batch_size,
            group_size=cfg.rollout.n,
            update=update,
            loss_scale_factor=algo.loss_scale_factor or cfg.rollout.max_response_tokens,
            has_reference=algo.kl_coef > 0,
            needs_old_logprobs=bool(reasons),
            has_critic=has_critic,
            return_logprobs=return_logprobs,
            adv_estimator=algo.adv_estimator,
            old_logprobs_reason="; ".join(reasons),
            critic_tokens_per_microbatch=cfg.critic.max_tokens_per_microbatch or cfg.train.max_tokens_per_microbatch,
            max_response_tokens=cfg.rollout.max_response_tokens,
            critic_warmup_steps=cfg.critic.warmup_steps if has_critic else 0,
            **_shared(cfg, host),
        )

    @classmethod
    def supervised(cls, cfg: RunConfig, update: UpdateSpec, *, max_response_tokens: int, host: Host | None = None) -> BatchPlan:
        """The plan of a recipe that trains on given sequences (`packrl sft`): ``update.mini_batch_size``
        sequences per step, each a group of its own, one mini-batch; no engine, reference, critic or
        old log-prob forward. The shared budgets (``train.max_tokens_per_*``,
        ``train.balance_microbatches``, the ranks of ``trainer.*``, ``model.dtype``) are RL's.

        Args:
            max_response_tokens: the longest part after the prompt a sequence may have (the loss
                constant of ``seq-mean-token-sum-norm`` when ``update.algorithm`` asks for it).
        """
        return cls(
            num_prompts=update.mini_batch_size, group_size=1, update=update,
            loss_scale_factor=update.algorithm.loss_scale_factor or max_response_tokens,
            has_reference=False, needs_old_logprobs=False, adv_estimator="",
            critic_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch, max_response_tokens=max_response_tokens,
            generates=False, **_shared(cfg, host),
        )

    @property
    def mini_batch_prompts(self) -> int:
        """Prompts (groups) per optimizer step (``train.mini_batch_size``, or B)."""
        return self.update.mini_batch_size

    @property
    def num_epochs(self) -> int:
        """Passes over each step's batch (``train.ppo_epochs``)."""
        return self.update.num_epochs

    @property
    def loss_agg_mode(self) -> str:
        """``algorithm.loss_agg_mode`` (whether ``loss_scale_factor`` is used)."""
        return self.update.loss_agg_mode

    def planner(self, *, packed: bool, share_prompts: bool) -> PassPlanner:
        """The controller's planner of every pass (`packrl.seqlen.update_plan.PassPlanner`), given
        what the workers found at set-up: whether packs are exact for the model (``packed``) and
        whether packs write a group's prompt once (``share_prompts``)."""
        return PassPlanner(
            num_ranks=self.data_parallel_size, sequence_parallel_size=self.sequence_parallel_size,
            logprob_tokens=self.max_tokens_per_logprob_microbatch, update_tokens=self.max_tokens_per_microbatch,
            critic_tokens=self.critic_tokens_per_microbatch, balance=self.balance_microbatches, packed=packed,
            share_prompts=share_prompts, mini_batch_prompts=self.mini_batch_prompts, num_epochs=self.num_epochs,
            loss_scale_factor=self.loss_scale_factor, caps=self.grouped_caps,
        )

    @property
    def num_sequences(self) -> int:
        """Sequences per step, N = B x G."""
        return self.num_prompts * self.group_size

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks: groups of `sequence_parallel_size` ranks that each take a share of a batch."""
        return self.num_ranks // self.sequence_parallel_size

    @property
    def num_minibatches(self) -> int:
        """Optimizer steps per epoch."""
        return -(-self.num_prompts // self.mini_batch_prompts)

    def summary(self) -> str:
        """The plan as a readable table, one value a line."""
        rows = [
            ("sequences per step", f"{self.num_sequences} ({self.num_prompts} prompts x {self.group_size} responses)"),
            ("optimizer steps per step", f"{self.num_epochs * self.num_minibatches} ({self.num_epochs} epoch(s) x "
                                         f"{self.num_minibatches} mini-batch(es) of {self.mini_batch_prompts} prompts)"),
            ("data-parallel ranks", str(self.data_parallel_size)),
            ("sequence-parallel ranks", f"{self.sequence_parallel_size} per data-parallel rank (each pack split over them)"
             if self.sequence_parallel_size > 1 else "1 (off)"),
            ("loss scale factor", f"{self.loss_scale_factor:,} tokens (the C of loss_agg_mode=seq-mean-token-sum-norm)"
             if self.loss_agg_mode == "seq-mean-token-sum-norm" else f"not used (loss_agg_mode={self.loss_agg_mode})"),
            ("reference policy", "yes" if self.has_reference else "no (algorithm.kl_coef=0)"),
            ("old log-prob forward", f"yes ({self.old_logprobs_reason})" if self.needs_old_logprobs
             else "no (on-policy: the update's own detached log-probs)"),
            ("critic", f"yes (a value model; advantages: algorithm.adv_estimator={self.adv_estimator})" if self.has_critic else "no"),
            ("compute dtype", f"{self.compute_dtype.name} (model.dtype={self.compute_dtype.requested}: {self.compute_dtype.reason})"),
        ]
        rows += [(cap.unit, f"<= {cap.cap:,} per micro-batch per rank, every pass ({cap.budget_key})") for cap in self.grouped_caps]
        warning = [f"  warning: {self.compute_dtype.warning}"] if self.compute_dtype.warning else []
        return "\n".join(["batch plan"] + [f"  {name:<26}{value}" for name, value in rows] + warning)


def _shared(cfg: RunConfig, host: Host | None) -> dict[str, Any]:
    """The plan's fields every recipe reads from the shared sections: ranks, compute dtype and the
    micro-batch budgets."""
    return {
        "num_ranks": cfg.trainer.num_workers,
        "sequence_parallel_size": cfg.trainer.sequence_parallel_size,
        "compute_dtype": resolve_dtype(cfg.model.dtype, host),
        "max_tokens_per_microbatch": cfg.train.max_tokens_per_microbatch,
        "max_tokens_per_logprob_microbatch": cfg.train.max_tokens_per_logprob_microbatch,
        "balance_microbatches": cfg.train.balance_microbatches,
        "grouped_caps": grouped_cap_limits(cfg.train),
    }
