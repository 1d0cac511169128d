"""The typed run configuration: one frozen dataclass per stage under `RunConfig`.

Each field is documented by the string literal under it: meaning, unit, scope and why the
default. Options are `Literal` types; the loader (`packrl.config.load`) checks every value
against these annotations and reports all problems at once. Derived values (token budgets
with the model context, micro-batch counts) are computed into `packrl.seqlen.Budgets` and
never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from packrl.config.problems import ConfigProblem, check_positive

OverlongPrompt = Literal["filter", "left", "right", "middle", "error"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PackedAttention = Literal["varlen", "block_mask", "position_ids"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """HF model directory, hub id, `.gguf` file, or a packrl alias. Its `config.json` gives the
    model context (`max_position_embeddings`, times any RoPE scaling factor)."""

    packed_attention: PackedAttention = "varlen"
    """How packed sequences are kept apart in attention (see `packrl.models.attention`):
    `varlen` runs attention per sequence (flash-attn varlen on CUDA, per-sequence SDPA on CPU),
    cost sum(L_i^2); `block_mask` passes an explicit block-diagonal causal mask, cost K^2 per
    pack; `position_ids` lets transformers build that mask from restarting position ids."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if not self.path.strip():
            return [ConfigProblem(f"{prefix}.path", self.path, "is empty", "set model.path to a model dir, hub id or .gguf file")]
        return []


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    max_prompt_tokens: int = 512
    """Prompt budget in tokens, after the chat template and the generation prompt. Every prompt
    the engine receives has at most this many tokens."""

    overlong_prompt: OverlongPrompt = "filter"
    """What to do with a prompt over `data.max_prompt_tokens`: `filter` drops the row (counted);
    `left`/`right`/`middle` shorten the last user message's content (left drops its start,
    right its end, middle its centre), never the system message or the generation prompt;
    `error` stops before training and names the rows. Default `filter`: no silent content change."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return check_positive(f"{prefix}.max_prompt_tokens", self.max_prompt_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    n: int = 8
    """Responses sampled per prompt (the group size G)."""

    max_response_tokens: int = 512
    """Response budget in tokens per response. A response that reaches it ends with finish
    reason `length`."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return check_positive(f"{prefix}.n", self.n) + check_positive(
            f"{prefix}.max_response_tokens", self.max_response_tokens
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    max_tokens_per_microbatch: int = 8192
    """Hard cap on real (non-pad) tokens in one update micro-batch (forward + backward), per
    device. Must hold the longest possible sequence, `max_prompt_tokens + max_response_tokens`."""

    max_tokens_per_logprob_microbatch: int = 16384
    """Hard cap on real tokens in one no-grad log-prob micro-batch (old and reference log-probs),
    per device. No activations are kept for backward, so it can be larger than the update budget."""

    logits_chunk_tokens: int = 1024
    """Tokens per chunk when computing log-probs and entropy from hidden states: logits never
    exceed `logits_chunk_tokens x vocab` floats, forward or backward."""

    balance_microbatches: bool = True
    """Balance micro-batches by the cost model `a*L + L^2` (same micro-batch count, flatter
    step time). False keeps the first-fit-decreasing packing as is."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out: list[ConfigProblem] = []
        for name in ("max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch", "logits_chunk_tokens"):
            out += check_positive(f"{prefix}.{name}", getattr(self, name))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses become one scalar per mini-batch (meanings as verl's `loss_agg_mode`):
    `token-mean` = sum / loss tokens; `seq-mean-token-sum` = sum / sequences;
    `seq-mean-token-mean` = mean over sequences of each sequence's token mean (original GRPO);
    `seq-mean-token-sum-norm` = sum / (sequences x `algorithm.loss_scale_factor`) (Dr. GRPO).
    Denominators are global over the mini-batch, so micro-batching and ranks never change it."""

    loss_scale_factor: int | None = None
    """Constant token normaliser of `seq-mean-token-sum-norm`. None uses
    `rollout.max_response_tokens`, a constant; verl's default (the padded response width)
    changes with batching."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if self.loss_scale_factor is None:
            return []
        return check_positive(f"{prefix}.loss_scale_factor", self.loss_scale_factor)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)

    def problems(self) -> list[ConfigProblem]:
        """Field checks of every section, then the relations among budgets (without the model
        context, which needs the model config: see `packrl.seqlen.Budgets`)."""
        from packrl.seqlen.budgets import Budgets

        out: list[ConfigProblem] = []
        for name in ("model", "data", "rollout", "train", "algorithm"):
            out += getattr(self, name).problems(name)
        out += Budgets.from_config(self, max_context_tokens=None).problems()
        return out
