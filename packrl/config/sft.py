"""The supervised fine-tuning section (`packrl sft`, `packrl.trainer.sft`): chat traces trained
with the RL update's budgets, packing, chunked log-probs and micro-batching, under a token-mean
negative log-likelihood over the assistant's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from packrl.errors import ConfigProblem, check_positive

CHAR_COUNT_TRACES = "task:char_count_traces"
"""The built-in traces of `task:char_count` (`packrl.data.char_count_traces`), in `sft.trace_style`."""
TraceStyle = Literal["concise", "verbose", "thinking"]
"""How `task:char_count_traces` writes its worked answers (`packrl.data.char_count.worked_answer`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SftConfig:
    train_files: list[str] = field(default_factory=list)
    """Chat traces: jsonl, json or parquet files whose rows hold `messages` (a list of
    `{role, content}`: system and user messages, then assistant turns with the tool messages
    between them), `task:tool_traces` (calculator traces of this config's `task:arithmetic`,
    as `packrl data tool-traces` writes them), or `task:char_count_traces` (worked answers to this
    config's `task:char_count` questions in `sft.trace_style`)."""

    total_steps: int = 0
    """Optimizer steps of `packrl sft` (each on `batch_size` traces, drawn in epochs)."""

    batch_size: int = 16
    """Traces per optimizer step: one mini-batch, whose token-mean loss is exact however it is
    split into micro-batches (`train.max_tokens_per_microbatch`) and ranks."""

    lr: float = 1.0e-5
    """AdamW learning rate of `packrl sft` (`train.warmup_steps`, `train.weight_decay` and
    `train.grad_clip` apply as in RL)."""

    num_rows: int = 512
    """Traces `task:tool_traces` and `task:char_count_traces` generate (from `data.arithmetic`
    or `data.char_count` with `train.seed`; never a validation question)."""

    trace_style: TraceStyle = "concise"
    """Worked answers of `task:char_count_traces`: `concise` (one line per letter with the running
    count, then `#### N`: the shortest correct answer), `verbose` (each line restated, filler
    lines, an opening and a closing line: about 3x the concise tokens, to start RL from a policy
    that says more than it needs) or `thinking` (the concise lines inside `<think>` ... `</think>`,
    then `#### N`)."""

    redundancy: float = 1.0
    """Chance that each redundant line of a `verbose` trace of `task:char_count_traces` is written
    (the opening, each restatement, each filler, the closing; drawn per line, reproducibly from
    `train.seed`); the worked lines and the final count always are. Below 1 the start is verbose
    but not always equally so: its samples of one question differ in length by redundant lines,
    not only by mistakes, which is the spread a length objective selects on (reasoning models vary
    their verbosity the same way). 1 (default): every redundant line."""

    max_prompt_tokens: int | None = None
    """Prompt budget of a trace (tokens: the system and user messages rendered with the chat
    template and the generation prompt, as RL renders its prompts). A trace whose prompt is longer
    is filtered out, never cut. null (default): `data.max_prompt_tokens`, the RL prompt budget."""

    max_response_tokens: int | None = None
    """Budget of what follows the prompt in a trace (tokens: the assistant turns with their closing
    tokens, the tool messages and assistant headers between them). A longer trace is filtered out,
    never cut. null (default): `rollout.max_response_tokens`, the RL response budget, so a trace is
    kept when RL could have generated it."""

    def trace_budgets(self, max_prompt_tokens: int, max_response_tokens: int) -> tuple[int, int]:
        """``(prompt, response)`` token budgets of a trace: ``sft.max_prompt_tokens`` and
        ``sft.max_response_tokens``, each null one replaced by the RL budget given
        (``data.max_prompt_tokens``, ``rollout.max_response_tokens``)."""
        return (self.max_prompt_tokens if self.max_prompt_tokens is not None else max_prompt_tokens,
                self.max_response_tokens if self.max_response_tokens is not None else max_response_tokens)

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.batch_size", self.batch_size) + check_positive(f"{prefix}.num_rows", self.num_rows)
        for name in ("max_prompt_tokens", "max_response_tokens"):
            if getattr(self, name) is not None:
                out += check_positive(f"{prefix}.{name}", getattr(self, name))
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 0:
            out.append(ConfigProblem(f"{prefix}.total_steps", self.total_steps, "must be an integer >= 0", f"set {prefix}.total_steps=50"))
        if not 0 < self.lr < 1:
            out.append(ConfigProblem(f"{prefix}.lr", self.lr, "must be in (0, 1)", f"set {prefix}.lr=1e-5"))
        if self.trace_style != "concise" and CHAR_COUNT_TRACES not in self.train_files:
            out.append(ConfigProblem(f"{prefix}.trace_style", self.trace_style,
                                     f"has no effect: {prefix}.train_files={self.train_files} has no {CHAR_COUNT_TRACES}",
                                     f"add {CHAR_COUNT_TRACES} to {prefix}.train_files or set {prefix}.trace_style=concise (the default)",
                                     keys=(f"{prefix}.trace_style", f"{prefix}.train_files")))
        if not 0 <= self.redundancy <= 1:
            out.append(ConfigProblem(f"{prefix}.redundancy", self.redundancy, "must be in [0, 1]", f"set {prefix}.redundancy=0.85"))
        elif self.redundancy < 1 and (self.trace_style != "verbose" or CHAR_COUNT_TRACES not in self.train_files):
            out.append(ConfigProblem(f"{prefix}.redundancy", self.redundancy,
                                     f"has no effect: only the verbose {CHAR_COUNT_TRACES} have redundant lines "
                                     f"({prefix}.trace_style={self.trace_style}, {prefix}.train_files={self.train_files})",
                                     f"set {prefix}.redundancy=1, or train {CHAR_COUNT_TRACES} with {prefix}.trace_style=verbose",
                                     keys=(f"{prefix}.redundancy", f"{prefix}.trace_style", f"{prefix}.train_files")))
        return out
