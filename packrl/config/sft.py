"""The supervised fine-tuning section (`packrl sft`, `packrl.trainer.sft`): chat traces trained
with the RL update's budgets, packing, chunked log-probs and micro-batching, under a token-mean
negative log-likelihood over the assistant's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from packrl.errors import ConfigProblem, check_positive


@dataclass(frozen=True, kw_only=True, slots=True)
class SftConfig:
    train_files: list[str] = field(default_factory=list)
    """Chat traces: jsonl, json or parquet files whose rows hold `messages` (a list of
    `{role, content}`: system and user messages, then assistant turns with the tool messages
    between them), or `task:tool_traces` (calculator traces of this config's `task:arithmetic`,
    as `packrl data tool-traces` writes them)."""

    total_steps: int = 0
    """Optimizer steps of `packrl sft` (each on `batch_size` traces, drawn in epochs)."""

    batch_size: int = 16
    """Traces per optimizer step: one mini-batch, whose token-mean loss is exact however it is
    split into micro-batches (`train.max_tokens_per_microbatch`) and ranks."""

    lr: float = 1.0e-5
    """AdamW learning rate of `packrl sft` (`train.warmup_steps`, `train.weight_decay` and
    `train.grad_clip` apply as in RL)."""

    num_rows: int = 512
    """Traces `task:tool_traces` generates (from `data.arithmetic` with `train.seed`)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.batch_size", self.batch_size) + check_positive(f"{prefix}.num_rows", self.num_rows)
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 0:
            out.append(ConfigProblem(f"{prefix}.total_steps", self.total_steps, "must be an integer >= 0", f"set {prefix}.total_steps=50"))
        if not 0 < self.lr < 1:
            out.append(ConfigProblem(f"{prefix}.lr", self.lr, "must be in (0, 1)", f"set {prefix}.lr=1e-5"))
        return out
