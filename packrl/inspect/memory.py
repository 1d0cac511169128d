"""Peak memory per device of a run, estimated from configs alone (the model's ``config.json``, never its weights).

Units: bytes unless a name says otherwise. Shapes: ``H`` hidden size · ``I`` intermediate
(MLP) size · ``L`` layers · ``h`` attention heads · ``g`` key/value heads · ``d`` head dim ·
``V`` vocabulary · ``T`` real tokens in one update micro-batch · ``c`` bytes of the compute
dtype (2 for bf16, 4 for fp32, 8 for fp64: ``model.dtype`` resolved for the device,
`packrl.hardware.resolve_dtype`) · ``r = 4`` bytes of the float32 residual stream (parameters
stay float32, so under autocast the residual stream does too; 8 under fp64).

What a run holds (the policy worker's layout, `packrl.worker.policy.PolicyWorker`, under the
strategy `packrl.worker.strategy.weight_layout` names for the config):

- parameters: float32, 4 bytes each (float64, 8, under ``fp64``: every float32 byte count below
  doubles); the reference model (``algorithm.kl_coef > 0`` without
  LoRA) another 4 each; the rollout engine's copy: 2 each in bf16 (``model.dtype=bf16``), 4 each
  in float32 under FSDP2 (a sharded policy cannot generate) or with an engine of its own
  (``rollout.engine=vllm``), none otherwise. While the hf engine generates on the CPU in bf16 it
  also holds its Linear weights (decoder layers and LM head) packed for oneDNN, 2 bytes each
  (`packrl.rollout.packed_linear`).
- trainable parameters (all, or the LoRA adapters): gradients 4 bytes and AdamW's two moments
  8 bytes each (Loshchilov & Hutter 2019), allocated at the first optimizer step.
- the critic of PPO (``critic.enable``, by default with ``adv_estimator=gae``): the policy's
  architecture (its shape is used even when ``critic.model.path`` names another checkpoint),
  float32 weights and AdamW's moments held throughout, 12 bytes per parameter (split D ways
  under FSDP2); its update and value passes run when the actor's do not, and need less than the
  actor's (no LM head), so they add no phase of their own.
- under FSDP2 (``trainer.num_workers = D > 1``): parameters, reference, gradients and moments
  are split D ways; while it computes a rank gathers whole units: the root (embeddings, final
  norm, LM head) and up to two decoder layers (the current one and the prefetched next). LoRA
  adapters are sharded in their decoder layer's unit (`packrl.worker.strategy.FSDP2`): their
  gradients and moments are split D ways too, a gathered layer holds its adapters, and the
  engine's copy holds the merged weights (no adapters).
- with sequence parallelism (``trainer.sequence_parallel_size = S``) the estimate stays per rank:
  ``T`` is the per-rank budget (a pack holds S x T tokens, each rank T of them), weights are
  split over all D ranks, and the all-to-all's buffers (about the q, k, v and output of one layer
  at a time) are not counted.
- activations saved for the backward, per token, counted tensor by tensor for a Llama-style
  decoder layer (RMSNorm, GQA attention with RoPE, gated MLP) under autocast:

  * two RMSNorms keep their float32 input and normalised output: ``4 r H`` (with LoRA the norm
    weights are frozen and only the input is kept: ``2 r H``);
  * bf16 only: autocast's casts of the normalised input to q, k, v, gate and up: ``5 c H``;
  * attention: SDPA's q, k, v inputs ``c (h + 2g) d``, its output and ``o_proj``'s input
    ``2 c h d``;
  * MLP: gate, up, activation and product: ``4 c I``;
  * LoRA: the adapters' rank-wide outputs, about ``2 c rank`` per adapted module.

  For SmolLM2-135M in bf16 this gives 31,488 bytes per token per layer (26,880 + adapters with
  LoRA): the sum of the tensors autograd saves for one layer, counted with
  `torch.autograd.graph.saved_tensors_hooks` (weights excluded), within 3% (a test checks it).
  With ``model.gradient_checkpointing`` a layer keeps only its float32 input (``r H``) and one
  layer's activations exist at a time, during its recomputation.
- bf16 casts of the weights kept for the backward (each matmul saves its bf16 weight): ``c`` x
  the matmul parameters, without gradient checkpointing (with it, one layer's at a time).
- the chunked LM head (`packrl.seqlen.chunked`): about ``2 x logits_chunk_tokens x V`` float32.
- the rollout KV cache: ``2 L g d c`` per token for ``rollout.max_num_seqs`` sequences of
  prompt + response budget.
- with ``model.param_offload`` (FSDP2 on CUDA): the shards of the parameters, reference and
  critic, the gradients and the optimizer states live in host memory (`MemoryEstimate.host`, per
  rank) and count 0 on the device; the gathered units, the engine's copy, activations and the
  gradient of the unit in its backward stay there, and the optimizer steps on the CPU.
- a runtime floor: on CPU the interpreter, torch, transformers, the tokenizer and the data
  (measured 0.55 GiB); on CUDA the context and allocator slack (0.75 GiB, an assumption).

Measured (``bench/bench_memory.py`` on CPU; the same micro-batch on an H200 with
``torch.cuda.max_memory_allocated``): SmolLM2-135M, 1k-16k tokens, plain, gradient checkpointing and
LoRA rank 16, all within 15% (the CPU table is in the README).

The update phase peaks either when the backward starts (activations, weight casts, the LM head
chunk and the LM head's gradient) or during the optimizer step (all gradients, moments, one
parameter's temporaries); the
estimate takes the larger. The log-prob phase and generation hold the optimizer moments (they
live across steps) and one layer's intermediates at a time; generation adds the KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from packrl.config.schema import RolloutConfig, RunConfig
from packrl.hardware import ComputeDtype, resolve_for_device
from packrl.models.model_config import ModelShape
from packrl.rollout.engine import EngineCapabilities, declared_capabilities
from packrl.worker.strategy import weight_layout

GIB = 1 << 30
CPU_RUNTIME_BYTES = int(0.55 * GIB)
CUDA_RUNTIME_BYTES = int(0.75 * GIB)
_RESIDUAL_BYTES = 4
_OFFLOADED = ("parameters", "reference model", "critic (weights + AdamW states)", "gradients",
              "optimizer states (AdamW)")


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int, lora_rank: int = 0) -> int:
    """Bytes one decoder layer keeps per token for the backward, without checkpointing.

    The tensor-by-tensor count is in the module docstring. Returns bytes per token per layer.
    """
    c, r = compute_bytes, max(compute_bytes, _RESIDUAL_BYTES)  # float32 residual stream (float64 under fp64)
    # the names of the module docstring's formulas (``I`` = intermediate size)
    H, I, h, g, d = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim  # noqa: E741
    casts = c if c < r else 0  # autocast casts exist only when the compute dtype is narrower
    norms = (1 if lora_rank else 2) * 2 * r * H  # a frozen norm weight needs no saved normalised output
    attention = c * (h + 2 * g) * d + 2 * c * h * d  # SDPA inputs, its output, o_proj's input
    total = norms + 5 * casts * H + attention + 4 * c * I
    if lora_rank:
        total += 2 * c * lora_rank * shape.num_lora_modules // shape.num_layers  # the adapters' rank-wide outputs
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per device, by part and by phase.

    Attributes:
        device: ``cpu`` or ``cuda``.
        tokens_per_microbatch: ``T`` used for the update phase.
        parts: bytes of each part (names as in the module docstring).
        phases: peak bytes of the ``update``, ``logprob`` and ``generation`` phases.
        host: bytes each rank keeps in host memory instead (``model.param_offload`` on CUDA;
            these parts are 0 in ``parts``), by part; empty otherwise.
    """

    device: str
    tokens_per_microbatch: int
    parts: dict[str, int]
    phases: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    def table(self) -> str:
        """The parts and phases as a readable table, in GiB."""
        lines = [f"memory per device ({self.device}, update micro-batch {self.tokens_per_microbatch:,} tokens)"]
        lines += [f"  {name:<41}{value / GIB:>9.3f} GiB" for name, value in self.parts.items()]
        lines += [f"  peak of phase {name:<27}{value / GIB:>9.3f} GiB" for name, value in self.phases.items()]
        if self.host:
            lines.append("host memory per rank (model.param_offload)")
            lines += [f"  {name:<41}{value / GIB:>9.3f} GiB" for name, value in self.host.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "tokens_per_microbatch": self.tokens_per_microbatch, "parts_bytes": dict(self.parts),
                "phases_bytes": dict(self.phases), "peak_bytes": self.peak_bytes, "host_bytes": dict(self.host)}

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


def estimate_memory(cfg: RunConfig, shape: ModelShape, *, device: str = "cpu", tokens_per_microbatch: int | None = None,
                    compute_dtype: ComputeDtype | None = None) -> MemoryEstimate:
    """Peak memory per device of ``cfg`` on a model of ``shape`` (see the module docstring).

    Args:
        cfg: the run config (LoRA, checkpointing, budgets, batch sizes).
        shape: `ModelShape.from_config` of the model.
        device: ``cpu`` (process RSS) or ``cuda`` (device memory).
        tokens_per_microbatch: ``T``; default ``train.max_tokens_per_microbatch``.
        compute_dtype: ``model.dtype`` resolved for the device; default resolved here
            (`packrl.hardware.resolve_for_device`: this machine's facts, or a bf16 CUDA device).

    Returns:
        `MemoryEstimate` with every part in bytes.
    """
    m = cfg.model
    T = tokens_per_microbatch or cfg.train.max_tokens_per_microbatch
    compute = compute_dtype or resolve_for_device(m.dtype, device)
    c, p = compute.num_bytes, compute.param_bytes
    lora = m.lora.rank > 0
    trainable = shape.num_lora_params if lora else shape.num_params
    per_layer = activation_bytes_per_token_layer(shape, c, m.lora.rank)
    if m.gradient_checkpointing:
        activations = T * (shape.num_layers * _RESIDUAL_BYTES * shape.hidden_size + per_layer)
    else:
        activations = T * shape.num_layers * per_layer
    outside_layers = T * (3 * max(c, _RESIDUAL_BYTES) + c) * shape.hidden_size  # embedding, final norm, its cast
    weight_casts = 0 if c >= 4 else (c * shape.num_matmul_params // (shape.num_layers if m.gradient_checkpointing else 1))
    layout = weight_layout(cfg.trainer.num_workers, m.param_offload)
    shards = layout.num_shards
    engine = declared_capabilities(cfg.rollout.engine)
    engine_copy = 2 if c == 2 else (c if layout.engine_copy_always or not engine.shares_policy_weights else 0)
    layer_params = (shape.num_matmul_params + (shape.num_lora_params if lora else 0)) // shape.num_layers  # with its adapters
    parts = {
        "runtime": CPU_RUNTIME_BYTES if device == "cpu" else CUDA_RUNTIME_BYTES,
        "parameters": p * shape.num_params // shards,
        "reference model": p * shape.num_params // shards if cfg.algorithm.kl_coef > 0 and not lora else 0,
        "critic (weights + AdamW states)": 3 * p * shape.num_params // shards if cfg.critic.enabled(cfg.algorithm.adv_estimator) else 0,
        "rollout engine copy": engine_copy * shape.num_params,
        "gathered parameters (FSDP2)": p * (shape.num_params - shape.num_matmul_params + 2 * layer_params) if layout.gathers_layers else 0,
        "gradients": p * trainable // shards,
        "optimizer states (AdamW)": 2 * p * trainable // shards,
        "activations": activations + outside_layers,
        "weight casts for the backward": weight_casts,
        "logits chunk": 2 * max(c, 4) * min(cfg.train.logits_chunk_tokens, T) * shape.vocab_size,
        "rollout KV cache": _kv_cache_bytes(cfg.rollout, cfg.data.max_prompt_tokens, shape, c),
        "packed rollout weights (CPU generation)": _packed_bytes(engine, shape, device, c),
    }
    host = {}
    if layout.params_on_host and device == "cuda":
        host = {k: parts[k] for k in _OFFLOADED}
        parts |= dict.fromkeys(_OFFLOADED, 0)
    held = parts["runtime"] + parts["parameters"] + parts["reference model"] + parts["rollout engine copy"]
    held += parts["critic (weights + AdamW states)"]
    held += parts["gathered parameters (FSDP2)"]
    # Gradients fill in while the backward frees activations: at its peak (its start) only the LM
    # head's gradient exists; all gradients together are counted in the optimizer step.
    first_grads = p * min(shape.largest_param, trainable)
    backward = parts["activations"] + parts["weight casts for the backward"] + parts["logits chunk"] + first_grads
    # AdamW's temporaries: on CUDA its foreach path holds about one more float32 copy of the
    # trainable parameters; on CPU the per-parameter loop holds two of the largest parameter.
    temporaries = p * trainable if device == "cuda" else 2 * p * min(shape.largest_param, trainable)
    if host:  # the optimizer steps on the CPU, on the offloaded shards
        host["optimizer step temporaries"] = p * trainable // shards
        temporaries = 0
    optimizer_step = parts["gradients"] + parts["optimizer states (AdamW)"] + temporaries
    states = parts["optimizer states (AdamW)"]
    # No-grad forwards keep one layer's intermediates at a time; prefill likewise, over the
    # generation batch's prompts; decoding adds its logits and sampling buffers.
    logprob = states + cfg.train.max_tokens_per_logprob_microbatch * per_layer + parts["logits chunk"] // 2
    prefill = cfg.rollout.max_num_seqs * cfg.data.max_prompt_tokens * per_layer
    generation = states + parts["rollout KV cache"] + prefill + 3 * max(c, 4) * cfg.rollout.max_num_seqs * shape.vocab_size
    generation += parts["packed rollout weights (CPU generation)"]
    phases = {"update": held + max(backward, optimizer_step), "logprob": held + logprob, "generation": held + generation}
    return MemoryEstimate(device, T, parts, phases, host)


def _packed_bytes(engine: EngineCapabilities, shape: ModelShape, device: str, compute_bytes: int) -> int:
    """An engine's packed 2-byte Linear and LM head weights while it generates on the CPU (an
    engine that declares ``packs_cpu_weights``, the hf engine; 0 elsewhere)."""
    if device != "cpu" or compute_bytes != 2 or not engine.packs_cpu_weights:
        return 0
    return 2 * (shape.num_matmul_params + shape.vocab_size * shape.hidden_size)


def _kv_cache_bytes(rollout: RolloutConfig, max_prompt_tokens: int, shape: ModelShape, compute_bytes: int) -> int:
    """The rollout engine's KV cache: ``rollout.max_num_seqs`` sequences of ``data.max_prompt_tokens
    + rollout.max_response_tokens`` tokens."""
    tokens = rollout.max_num_seqs * (max_prompt_tokens + rollout.max_response_tokens)
    return shape.kv_bytes_per_token(compute_bytes) * tokens


def max_fitting_tokens(cfg: RunConfig, shape: ModelShape, device_memory_bytes: int, *, device: str = "cpu", step: int = 256,
                       compute_dtype: ComputeDtype | None = None) -> int:
    """The largest ``train.max_tokens_per_microbatch`` (a multiple of ``step`` tokens) whose
    update phase fits ``device_memory_bytes``; 0 when even ``step`` tokens do not fit."""
    compute = compute_dtype or resolve_for_device(cfg.model.dtype, device)
    lo, hi = 0, 1
    while (estimate_memory(cfg, shape, device=device, tokens_per_microbatch=hi * step, compute_dtype=compute).phases["update"]
           <= device_memory_bytes):
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        estimate = estimate_memory(cfg, shape, device=device, tokens_per_microbatch=mid * step, compute_dtype=compute)
        fits = estimate.phases["update"] <= device_memory_bytes
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo * step
