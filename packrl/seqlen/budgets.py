"""Token budgets: every limit a prompt, a response, the model and a micro-batch have, as one
value of integers, and the relations between them.

The relations are the ones that otherwise fail hours into a run: a prompt plus a response that
the model context cannot hold, and a micro-batch budget smaller than the longest sequence the
rollout may produce. `Budgets.violations` finds them; `packrl.config.budgets` builds the value
from a config and turns each violation into a problem naming its config keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

# RoPE types whose factor stretches the context beyond `max_position_embeddings` (or beyond
# `original_max_position_embeddings` where given). `llama3` and `longrope` configs already state
# the extended length in `max_position_embeddings`.
_STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def model_context_tokens(model_config: Any) -> tuple[int, float]:
    """The model context in tokens and the RoPE factor applied to get it.

    Args:
        model_config: a `transformers.PretrainedConfig` or the dict of a ``config.json`` (a
            vision-language model's: its ``text_config``'s context).

    Returns:
        ``(max_context_tokens, rope_factor)``: ``max_position_embeddings`` (or the RoPE
        ``original_max_position_embeddings``) times the factor of a ``linear``, ``dynamic`` or
        ``yarn`` RoPE scaling; factor 1.0 without scaling.

    Raises:
        ValueError: the config has no positive integer ``max_position_embeddings``.
    """
    text = _get(model_config, "text_config")
    if text is not None and _get(model_config, "max_position_embeddings") is None:
        model_config = text  # a vision-language model: its language model's context
    max_pos = _get(model_config, "max_position_embeddings")
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise ValueError(
            f"model config has max_position_embeddings={max_pos!r}, not a positive integer; packrl needs it "
            "to know the model context. Add it to the model's config.json or pick another model.path"
        )
    rope = _get(model_config, "rope_scaling") or _get(model_config, "rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    factor = float(rope.get("factor") or 1.0)
    if rope_type not in _STRETCHING_ROPE_TYPES or factor <= 1.0:
        return max_pos, 1.0
    base = rope.get("original_max_position_embeddings") or max_pos
    return int(base * factor), factor


@dataclass(frozen=True, slots=True)
class BudgetViolation:
    """One relation between budgets that does not hold.

    Attributes:
        kind: ``context`` (prompt + response > model context), ``microbatch`` (a micro-batch budget
            x the sequence-parallel ranks < the longest sequence), ``per_turn`` (a turn's budget >
            the response budget, which caps it anyway), ``trajectory`` (a trajectory's budget >
            prompt + response), ``thinking`` (thinking + forced end-of-thinking + answer budgets >
            the response budget).
        budget: the `Budgets` field at fault (``max_response_tokens``,
            ``max_tokens_per_microbatch``, ``max_tokens_per_logprob_microbatch``,
            ``max_tokens_per_turn``, ``max_trajectory_tokens``, ``think_budget_tokens``).
        value: its value, tokens.
        limit: the bound it breaks, tokens (the context, the longest sequence, ...).
        stage: the 0-based length-curriculum stage it breaks in (`response_stages`); None without stages.
    """

    kind: Literal["context", "microbatch", "per_turn", "trajectory", "thinking"]
    budget: str
    value: int
    limit: int
    stage: int | None = None


@dataclass(frozen=True, slots=True)
class Budgets:
    """Every token budget of a run. All values are in tokens.

    Attributes:
        max_prompt_tokens: prompt budget.
        max_response_tokens: response budget (the largest stage of a length curriculum).
        max_context_tokens: model context including RoPE scaling; None when not yet known
            (config-only checks), which skips the context relation.
        max_tokens_per_microbatch: update micro-batch cap, per rank.
        max_tokens_per_logprob_microbatch: log-prob micro-batch cap, per rank.
        rope_factor: the RoPE scaling factor included in ``max_context_tokens`` (for the plan).
        sequence_parallel_size: ranks that split one pack: the micro-batch budgets are per rank,
            so a pack may hold this many times as many tokens.
        context_policy: a multi-turn run's context policy (``error`` otherwise). Under ``end``
            (trajectories that reach the model context end there) and ``rolling`` (the oldest
            turns leave the context; each turn is trained with its own context) prompt +
            response may exceed the context, and the longest sequence the model ever sees is the
            context.
    """

    max_prompt_tokens: int
    max_response_tokens: int
    max_context_tokens: int | None
    max_tokens_per_microbatch: int
    max_tokens_per_logprob_microbatch: int
    rope_factor: float = 1.0
    sequence_parallel_size: int = 1
    context_policy: str = "error"
    multi_turn: tuple[int, int | None, int | None, int] | None = None
    """Multi-turn budgets ``(max_turns, max_tokens_per_turn, max_trajectory_tokens,
    max_tool_response_tokens)`` (None = the default: the response budget, prompt + response);
    None when multi-turn is off."""
    thinking: tuple[int, int, int] | None = None
    """Thinking budgets ``(think_budget_tokens, forced end-of-thinking tokens, answer_budget_tokens)``
    (the forced count is 1 until the tokenizer says); think + forced + answer must fit the
    response budget of every stage. None when thinking budgets are off."""
    response_stages: tuple[tuple[int, int], ...] = ()
    """A length curriculum's stages ``((first_step, max_response_tokens), ...)``
    (`packrl.seqlen.curriculum`); () = none. The context and micro-batch relations hold for every
    stage; ``max_response_tokens`` is the largest stage."""

    @property
    def context_bounded(self) -> bool:
        """True when prompt + response may exceed the model context (``context_policy`` ``end`` or ``rolling``)."""
        return self.context_policy in ("end", "rolling")

    @property
    def max_sequence_tokens(self) -> int:
        """The longest possible sequence: prompt budget + response budget (at most the model
        context when `context_bounded`)."""
        total = self.max_prompt_tokens + self.max_response_tokens
        return min(total, self.max_context_tokens) if self.context_bounded and self.max_context_tokens else total

    @property
    def pack_tokens(self) -> int:
        """Tokens one update micro-batch (pack) may hold: the per-rank budget x the ranks that split it."""
        return self.max_tokens_per_microbatch * max(1, self.sequence_parallel_size)

    @property
    def logprob_pack_tokens(self) -> int:
        """The same for a log-prob micro-batch."""
        return self.max_tokens_per_logprob_microbatch * max(1, self.sequence_parallel_size)

    def violations(self) -> list[BudgetViolation]:
        """Every relation that does not hold, for the response budget or for every stage of a
        length curriculum (then with its ``stage``), then the multi-turn budgets. Assumes
        positive budgets."""
        if not self.response_stages:
            out = self._relations()
        else:
            out = [replace(v, stage=i) for i, (_, budget) in enumerate(self.response_stages)
                   for v in replace(self, max_response_tokens=budget, response_stages=())._relations()]
        return out + self._multi_turn_violations()

    def _relations(self) -> list[BudgetViolation]:
        """Prompt + response against the model context, and the micro-batch budgets against the longest sequence."""
        out: list[BudgetViolation] = []
        seq = self.max_sequence_tokens
        if self.max_context_tokens is not None and seq > self.max_context_tokens and not self.context_bounded:
            out.append(BudgetViolation("context", "max_response_tokens", self.max_response_tokens, self.max_context_tokens))
        size = max(1, self.sequence_parallel_size)
        for name in ("max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch"):
            value = getattr(self, name)
            if value * size >= seq or (self.context_bounded and self.max_context_tokens is None):
                continue  # bounded by a context not read yet: checked when the model's config is (before step 1)
            out.append(BudgetViolation("microbatch", name, value, seq))
        if self.thinking is not None and sum(self.thinking) > self.max_response_tokens:
            out.append(BudgetViolation("thinking", "think_budget_tokens", sum(self.thinking), self.max_response_tokens))
        return out

    def _multi_turn_violations(self) -> list[BudgetViolation]:
        """Multi-turn budgets that another budget makes pointless."""
        if self.multi_turn is None:
            return []
        _, per_turn, trajectory, _ = self.multi_turn
        total = self.max_prompt_tokens + self.max_response_tokens
        out = []
        if per_turn is not None and per_turn > self.max_response_tokens:
            out.append(BudgetViolation("per_turn", "max_tokens_per_turn", per_turn, self.max_response_tokens))
        if trajectory is not None and trajectory > total:
            out.append(BudgetViolation("trajectory", "max_trajectory_tokens", trajectory, total))
        return out
