"""The parts a policy worker holds, each made by a named builder, and the one-line summary of them
(``model.txt``). `PolicyWorker.setup` calls the builders in the order that matters: the engine
copies the policy's weights before the strategy wraps them, the optimizer sees the wrapped
parameters, compiled twins are made of wrapped layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from packrl.config.grouped_caps import grouped_cap_limits
from packrl.config.schema import ModelConfig, RolloutConfig, RunConfig
from packrl.errors import ConfigError
from packrl.hardware import ComputeDtype
from packrl.models.attention import PackedAttention, supports_shared_prompts
from packrl.models.compile import CompiledLayers
from packrl.models.isolation import PackingCheck
from packrl.models.lora import adapter_config, is_lora, parameter_counts
from packrl.models.modality import modality_of
from packrl.registry import ROLLOUT_ENGINES
from packrl.rollout.engine import (
    DescribedEngine,
    EngineCapabilities,
    EngineContext,
    EngineOptions,
    RolloutEngine,
    WrapperContext,
    check_capabilities,
    declared_capabilities,
    engine_capabilities,
    wrap_engine,
)
from packrl.worker.actor import MicrobatchLoss
from packrl.worker.critic import CriticRole
from packrl.worker.optim import Optimization

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


@dataclass
class WorkerParts:
    """Everything a worker builds at set-up (`PolicyWorker.setup`).

    Attributes:
        model / tokenizer: the policy (a peft model with LoRA), wrapped by the strategy.
        reference: the frozen reference policy (the policy itself under LoRA), or None.
        engine: the rollout engine (wrapped by `MultiTurnEngine` with tools), or None where the
            plan generates nothing (`packrl.config.plan.BatchPlan.generates`).
        capabilities: what the run's rollouts can do (`packrl.capabilities.EngineCapabilities`).
        opt: the actor's optimization (`packrl.worker.optim.Optimization`).
        compiled: compiled decoder layers of the actor and the reference (``model.compile``), None where off.
        loss: how a micro-batch's policy loss is formed.
        critic: the critic role, or None.
        packing: whether a micro-batch may hold several sequences.
        share_prompts / share_phrase: whether packs write a group's prompt once, and why (`shares_prompts`).
        max_context_tokens / rope_factor: the model context (RoPE scaling included) and its factor.
        engine_phrase: how the engine generates, for the summary ("" when it does not say).
    """

    model: Any
    tokenizer: Any
    reference: Any
    engine: Any
    opt: Optimization
    compiled: dict[str, CompiledLayers | None]
    loss: MicrobatchLoss
    critic: CriticRole | None
    packing: PackingCheck
    share_prompts: bool
    share_phrase: str
    max_context_tokens: int
    rope_factor: float
    capabilities: EngineCapabilities
    engine_phrase: str = ""

    def summary(self, model_cfg: ModelConfig, compute_dtype: ComputeDtype, strategy: str) -> str:
        """One line for ``model.txt``; it ends with the shared-prompts phrase. The engine's phrase
        appears where the worker holds an engine (none where the plan generates nothing, as in
        `packrl sft`)."""
        parts = [describe_policy(self.model, model_cfg, self.max_context_tokens), compute_dtype.describe(), strategy,
                 self.packing.describe()]
        parts += [self.engine_phrase] if self.engine is not None and self.engine_phrase else []
        parts += [self.critic.describe()] if self.critic is not None else []
        parts += [f"compiled layers: {'off' if self.compiled['actor'] is None else 'on'}", f"shared prompts: {self.share_phrase}"]
        return "; ".join(parts)


def build_engine(rollout: RolloutConfig, options: EngineOptions, policy: Any, tokenizer: Any, *, max_context_tokens: int,
                 may_share_policy: bool, compute_dtype: ComputeDtype) -> tuple[Any, str, EngineCapabilities]:
    """The configured rollout engine for ``policy`` (``rollout.engine``, wrapped by the registered
    engine wrappers that apply, `packrl.rollout.engine.wrap_engine`: tool loops, thinking
    budgets), its summary phrase and what the run's rollouts can do
    (`packrl.rollout.engine.engine_capabilities`). Before the strategy wraps the policy: an
    engine copies whole weights.

    Args:
        rollout: the ``rollout`` section.
        options: the engine's settings from the run (`EngineOptions.of_sections`; its
            ``max_prompt_tokens`` is ``data.max_prompt_tokens``).

    Raises:
        ValueError: the factory returned an object without the engine contract's methods, or one
            that lacks what its registration declares (`packrl.rollout.engine.check_capabilities`).
    """
    name = rollout.engine
    factory = ROLLOUT_ENGINES.lookup(name)
    engine = factory(EngineContext(policy=policy, tokenizer=tokenizer, options=options, max_context_tokens=max_context_tokens,
                                   may_share_policy=may_share_policy, compute_dtype=compute_dtype))
    if not isinstance(engine, RolloutEngine):
        missing = [m for m in ("generate", "load_weights", "sleep", "wake_up", "close") if not callable(getattr(engine, m, None))]
        raise ValueError(f"rollout.engine={name!r}: its factory returned a {type(engine).__name__} without "
                         f"{', '.join(missing)}; return an object with the methods of packrl.rollout.engine.RolloutEngine")
    check_capabilities(engine, name, declared_capabilities(name))
    phrase = engine.describe() if isinstance(engine, DescribedEngine) else ""
    engine = wrap_engine(engine, WrapperContext(tokenizer, rollout, options.max_prompt_tokens, max_context_tokens))
    return engine, phrase, engine_capabilities(rollout)


def check_modality_run(cfg: RunConfig, model: Any, capabilities: EngineCapabilities, *, has_critic: bool) -> None:
    """Refuse what a multimodal policy cannot run yet, before any step (its modality's
    `packrl.models.modality.Modality.run_problems`, the list preflight reads too), and warn of a
    grouped cap no input of the model reports a load against.

    Raises:
        ConfigError: (a ValueError) with a multimodal model, every problem of that list, each
            with its keys and its fix.
    """
    modality = modality_of(cast("PreTrainedModel", model).config)
    for cap in grouped_cap_limits(cfg.train):
        if modality is None or cap.name not in modality.load_names:
            logger.warning("%s=%d has no effect: the prompts of model.path=%r report no %s (remove the key)",
                           cap.budget_key, cap.cap, cfg.model.path, cap.unit)
    problems = [] if modality is None else modality.run_problems(cfg, engine_modalities=capabilities.modalities,
                                                                   has_critic=has_critic)
    if problems:
        raise ConfigError(problems)


def compiled_layers(model_cfg: ModelConfig, num_workers: int, model: Any, reference: Any) -> dict[str, CompiledLayers | None]:
    """``model.compile`` (``model_cfg``: the ``model`` section; ``num_workers``:
    ``trainer.num_workers``): compiled decoder layers per role (None: that role runs eagerly). Null
    compiles where it can run (`ModelConfig.compile_blocker`) and says so in train.log where it
    cannot; true is refused at config load there. Of wrapped layers."""
    blocker = model_cfg.compile_blocker(num_workers)
    if model_cfg.compile is None and blocker:
        logger.info("model.compile: off, %s", blocker)
    if model_cfg.compile is False or blocker:
        return {"actor": None, "ref": None}
    actor = CompiledLayers(model)
    return {"actor": actor, "ref": None if reference is None else actor if reference is model else CompiledLayers(reference)}


def shares_prompts(wanted: bool | None, model: torch.nn.Module, packing: PackingCheck, *, group_size: int,
                   attention: PackedAttention, sequence_parallel_size: int) -> tuple[bool, str]:
    """``train.share_prompts`` (``wanted``: true, or null = wherever it can run) where it can run:
    packs at all, no sequence parallelism (``sequence_parallel_size``:
    ``trainer.sequence_parallel_size``), and an attention path (``attention``:
    ``model.packed_attention``) that lets a segment see its prompt (`supports_shared_prompts`).
    When it cannot, a warning says why for true, a log line for null. ``group_size``: sequences
    per prompt (`BatchPlan.group_size`: ``rollout.n``, 1 in `packrl sft`).

    Returns:
        ``(on, phrase)``: the phrase (``"on"`` or ``"off (why)"``) ends the run's model summary.
    """
    if wanted is False:
        return False, "off (train.share_prompts=false)"
    why = None
    if not packing.packs:
        why = "this model trains one sequence per micro-batch (its packs are not exact)"
    elif sequence_parallel_size > 1:
        why = "sequence parallelism splits packs across ranks"
    elif (modality := modality_of(cast("PreTrainedModel", model).config)) is not None and modality.shared_prompts_blocker:
        why = modality.shared_prompts_blocker
    elif not supports_shared_prompts(model, attention):
        impl = cast("PreTrainedModel", model).config._attn_implementation  # torch types model.config as Tensor | Module
        why = (f"model.packed_attention={attention} runs {impl!r}, which cannot let a "
               "response see a prompt segment (use varlen on CPU SDPA, or block_mask)")
    if why is not None:
        if wanted:
            logger.warning("train.share_prompts=true has no effect: %s; every sequence is packed whole", why)
        else:
            logger.info("train.share_prompts: off, %s", why)
        return False, f"off ({why})"
    if group_size == 1:
        if wanted:
            logger.warning("train.share_prompts=true with one sequence per prompt: only a prompt that repeats in a micro-batch "
                           "is written once (in RL, set rollout.n > 1 for shared prompts to save tokens)")
        return True, "on (one sequence per prompt: only a prompt that repeats in a micro-batch is written once)"
    return True, "on (a group's prompt once per pack)"


def describe_policy(model: torch.nn.Module, model_cfg: ModelConfig, max_context_tokens: int) -> str:
    """One line on the policy for the start of a run: parameters (trainable of total) and the
    memory features in force, e.g. ``policy: 4,884,480 trainable of 139,399,488 parameters
    (3.50%); LoRA rank 16, alpha 32 on 210 Linear layers; ...``."""
    trainable, total = parameter_counts(model)
    lora = "off (full fine-tuning)"
    if is_lora(model):
        from peft.tuners.lora import LoraLayer

        num_layers = sum(isinstance(module, LoraLayer) for module in model.modules())
        adapter = adapter_config(model)
        lora = f"rank {adapter.r}, alpha {adapter.lora_alpha:g} on {num_layers} Linear layers"
    checkpointing = any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
    rope = model_cfg.rope_scaling
    scaling = "none" if rope.type == "none" else f"{rope.type} x{rope.factor:g}"
    return (f"policy: {trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%); "
            f"LoRA {lora}; gradient checkpointing {'on' if checkpointing else 'off'}; "
            f"activation offload {'on' if model_cfg.activation_offload else 'off'}; RoPE scaling {scaling} "
            f"(model context {max_context_tokens:,} tokens)")
