"""The `rollout.multi_turn` section: tools, turn and trajectory budgets, tool answers and the context policy.

Part of the typed run configuration (`packrl.config.schema.RunConfig`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from packrl.errors import ConfigProblem, check_positive

ContextPolicy = Literal["error", "end", "rolling"]
TruncationSide = Literal["left", "right", "middle"]
ToolSchemas = Literal["template", "none"]


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


def wraps_engine(rollout: Any) -> bool:
    """Multi-turn rollouts wrap the engine (`packrl.capabilities.MULTI_TURN_WRAPPER`): tools are set.
    ``rollout``: the `packrl.config.schema.RolloutConfig` section."""
    return bool(rollout.multi_turn.enabled)
