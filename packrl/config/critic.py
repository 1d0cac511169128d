"""The critic's config section (PPO with a value model, `packrl.worker.critic`); its relations to
the rest of the run are the rule `packrl.config.relations.critic`."""

from __future__ import annotations

from dataclasses import dataclass, field

from packrl.errors import ConfigProblem, check_positive


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
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be > 0",
                                         f"set {prefix}.{name} to a positive number"))
        if self.warmup_steps < 0:
            out.append(ConfigProblem(f"{prefix}.warmup_steps", self.warmup_steps, "must be >= 0", f"set {prefix}.warmup_steps=0"))
        if self.grad_clip < 0:
            out.append(ConfigProblem(f"{prefix}.grad_clip", self.grad_clip, "must be >= 0 (0 = no clip)", f"set {prefix}.grad_clip=1.0"))
        return out
