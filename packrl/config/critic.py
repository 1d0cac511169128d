"""The critic's config section (PPO with a value model, `packrl.worker.critic`) and its relations
to the rest of the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from packrl.errors import ConfigProblem, check_positive

if TYPE_CHECKING:
    from packrl.config.schema import RunConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticModelConfig:
    path: str | None = None
    """Where the critic's backbone comes from (any form of `model.path`); null = the policy's
    checkpoint (verl's `critic.model.path`, default the actor's). A scalar value head is added."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticConfig:
    """The value model of PPO with a critic (`packrl.worker.critic`); built when `enable` says so."""

    enable: bool | None = None
    """Train a critic; null = exactly when `algorithm.adv_estimator=gae` (as verl decides `use_critic`)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The critic's model (`critic.model.path`)."""

    lr: float = 1.0e-5
    """The critic's AdamW learning rate (verl `critic.optim.lr`, default 1e-5)."""

    warmup_steps: int = 0
    """Steps at the start during which only the critic trains; the actor's first update is at step
    `warmup_steps + 1` (verl `trainer.critic_warmup`)."""

    cliprange_value: float = 0.5
    """Value clipping: a prediction may move at most this far from the rollout-time value before
    its loss is clipped (verl `critic.cliprange_value`, default 0.5)."""

    max_tokens_per_microbatch: int | None = None
    """Token budget of one critic update micro-batch (packed and planned exactly as the actor's);
    null = `train.max_tokens_per_microbatch`. Its forward pass for values uses
    `train.max_tokens_per_logprob_microbatch`."""

    grad_clip: float = 1.0
    """Gradient-norm clip of the critic's optimizer step (verl `critic.grad_clip`, default 1.0)."""

    def enabled(self, adv_estimator: str) -> bool:
        return self.enable if self.enable is not None else adv_estimator == "gae"

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        if self.max_tokens_per_microbatch is not None:
            out += check_positive(f"{prefix}.max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        for name in ("lr", "cliprange_value"):
            if getattr(self, name) <= 0:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be > 0", f"set {prefix}.{name} to a positive number"))
        if self.warmup_steps < 0:
            out.append(ConfigProblem(f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0", f"set {prefix}.warmup_steps=0"))
        if self.grad_clip < 0:
            out.append(ConfigProblem(f"{prefix}.grad_clip", self.grad_clip, "must be >= 0 (0 = no clip)", f"set {prefix}.grad_clip=1.0"))
        return out


def critic_problems(cfg: RunConfig) -> list[ConfigProblem]:
    """A critic the run cannot use, or critic settings without a critic."""
    critic, estimator = cfg.critic, cfg.algorithm.adv_estimator
    if estimator == "gae" and critic.enable is False:
        return [ConfigProblem("critic.enable", False, "algorithm.adv_estimator=gae needs the critic's values",
                              "set critic.enable=true (or null), or choose another algorithm.adv_estimator", keys=("critic.enable", "algorithm.adv_estimator"))]
    if not critic.enabled(estimator):
        default = CriticConfig()
        changed = [f.name for f in dataclasses.fields(critic) if f.name != "enable" and getattr(critic, f.name) != getattr(default, f.name)]
        keys = ["model.path" if name == "model" else name for name in changed]
        out = [ConfigProblem(f"critic.{key}", critic.model.path if key == "model.path" else getattr(critic, key),
                             "has no effect: this run has no critic",
                             f"set algorithm.adv_estimator=gae (or critic.enable=true), or remove critic.{key}") for key in keys]
        for name in ("gamma", "lam"):  # the built-in outcome estimators read neither
            if estimator in ("grpo", "rloo") and getattr(cfg.algorithm, name) != 1.0:
                out.append(ConfigProblem(f"algorithm.{name}", getattr(cfg.algorithm, name), f"has no effect with "
                                         f"algorithm.adv_estimator={estimator} (GAE reads it)",
                                         f"set algorithm.adv_estimator=gae or remove algorithm.{name}"))
        return out
    out = []
    if cfg.trainer.sequence_parallel_size > 1:
        out.append(ConfigProblem("critic.enable", True, "the critic does not run under sequence parallelism yet",
                                 "set trainer.sequence_parallel_size=1 for PPO with a critic", keys=("critic.enable", "trainer.sequence_parallel_size")))
    budget = critic.max_tokens_per_microbatch
    if budget is not None and budget >= 1 and cfg.rollout.multi_turn.context_policy not in ("end", "rolling"):
        longest = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
        if budget < longest:
            out.append(ConfigProblem("critic.max_tokens_per_microbatch", budget, f"is smaller than the longest possible sequence "
                                     f"data.max_prompt_tokens + rollout.max_response_tokens = {longest:,}",
                                     f"raise critic.max_tokens_per_microbatch to >= {longest:,} or leave it null (train.max_tokens_per_microbatch)"))
    if cfg.critic.warmup_steps >= cfg.train.total_steps:
        out.append(ConfigProblem("critic.warmup_steps", critic.warmup_steps, f"leaves no step of train.total_steps={cfg.train.total_steps} "
                                 "for the actor", "lower critic.warmup_steps or raise train.total_steps"))
    return out
