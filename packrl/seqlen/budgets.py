"""Token budgets: every limit a prompt, a response, the model and a micro-batch have, in one place.

The relations checked here are the ones that otherwise fail hours into a run: a prompt plus a
response that the model context cannot hold, and a micro-batch budget smaller than the longest
sequence the rollout may produce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from packrl.errors import ConfigError, ConfigProblem, check_positive
from packrl.seqlen.curriculum import KEY as SCHEDULE_KEY
from packrl.seqlen.curriculum import ResponseBudgetSchedule, schedule_problems

if TYPE_CHECKING:
    from packrl.config.schema import RunConfig

# RoPE types whose factor stretches the context beyond `max_position_embeddings` (or beyond
# `original_max_position_embeddings` where given). `llama3` and `longrope` configs already state
# the extended length in `max_position_embeddings`.
_STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def model_context_tokens(model_config: Any) -> tuple[int, float]:
    """The model context in tokens and the RoPE factor applied to get it.

    Args:
        model_config: a `transformers.PretrainedConfig` or the dict of a ``config.json``.

    Returns:
        ``(max_context_tokens, rope_factor)``: ``max_position_embeddings`` (or the RoPE
        ``original_max_position_embeddings``) times the factor of a ``linear``, ``dynamic`` or
        ``yarn`` RoPE scaling; factor 1.0 without scaling.

    Raises:
        ValueError: the config has no positive integer ``max_position_embeddings``.
    """
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
class Budgets:
    """Every token budget of a run and the checks between them. All values are in tokens.

    Attributes:
        max_prompt_tokens: prompt budget (``data.max_prompt_tokens``).
        max_response_tokens: response budget (``rollout.max_response_tokens``).
        max_context_tokens: model context including RoPE scaling; None when not yet known
            (config-only checks), which skips the context relation.
        max_tokens_per_microbatch: update micro-batch cap (``train.max_tokens_per_microbatch``).
        max_tokens_per_logprob_microbatch: log-prob micro-batch cap
            (``train.max_tokens_per_logprob_microbatch``).
        rope_factor: the RoPE scaling factor included in ``max_context_tokens`` (for the plan).
        sequence_parallel_size: ranks that split one pack (``trainer.sequence_parallel_size``):
            the micro-batch budgets are per rank, so a pack may hold this many times as many tokens.
        context_policy: ``rollout.multi_turn.context_policy`` of a multi-turn run (``error``
            otherwise). Under ``end`` (trajectories that reach the model context end there) and
            ``rolling`` (the oldest turns leave the context; each turn is trained with its own
            context) prompt + response may exceed the context, and the longest sequence the
            model ever sees is the context.
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
    max_tool_response_tokens)`` as set in ``rollout.multi_turn`` (None = the default: the
    response budget, prompt + response); None when multi-turn is off."""
    response_stages: tuple[tuple[int, int], ...] = ()
    """A length curriculum's stages ``((first_step, max_response_tokens), ...)``
    (``rollout.max_response_tokens_schedule``; `packrl.seqlen.curriculum`); () = none. The
    context and micro-batch relations are checked for every stage, each problem naming its stage;
    ``max_response_tokens`` is the largest stage."""

    @classmethod
    def from_config(cls, cfg: RunConfig, max_context_tokens: int | None, rope_factor: float = 1.0) -> Budgets:
        return cls(
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_response_tokens,
            max_context_tokens=max_context_tokens,
            max_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch,
            max_tokens_per_logprob_microbatch=cfg.train.max_tokens_per_logprob_microbatch,
            rope_factor=rope_factor,
            sequence_parallel_size=cfg.trainer.sequence_parallel_size,
            context_policy=cfg.rollout.multi_turn.context_policy if cfg.rollout.multi_turn.enabled else "error",
            multi_turn=_multi_turn(cfg),
            response_stages=_response_stages(cfg),
        )

    @classmethod
    def from_model_config(cls, cfg: RunConfig, model_config: Any) -> Budgets:
        """Budgets with the model context read from ``model_config`` (see `model_context_tokens`)."""
        context, factor = model_context_tokens(model_config)
        return cls.from_config(cfg, context, factor)

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

    def problems(self) -> list[ConfigProblem]:
        """Every broken budget or relation, each with its dotted key, value, limit and fix."""
        out: list[ConfigProblem] = []
        for key, value in self._keyed_values():
            out += check_positive(key, value)
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            out.append(ConfigProblem("model.path", self.max_context_tokens, "model context must be >= 1 token",
                                     "fix max_position_embeddings in the model's config.json"))
        if out:
            return out
        return self._stage_problems() + self._multi_turn_problems()

    def _stage_problems(self) -> list[ConfigProblem]:
        """The context and micro-batch relations for the response budget, or for every stage of a
        length curriculum, each problem then naming its stage and ``rollout.max_response_tokens_schedule``."""
        if not self.response_stages:
            return self._relation_problems()
        schedule = ResponseBudgetSchedule(self.response_stages)
        out = []
        for i, (start, budget) in enumerate(self.response_stages):
            for p in replace(self, max_response_tokens=budget, response_stages=())._relation_problems():
                key, value = (SCHEDULE_KEY, [start, budget]) if p.key == "rollout.max_response_tokens" else (p.key, p.value)
                out.append(ConfigProblem(
                    key, value, f"in {schedule.label(i)}, whose budget stands for rollout.max_response_tokens: {p.message}",
                    f"{p.fix} (stage {i + 1}'s budget is {SCHEDULE_KEY}[{i}][1]; the largest stage is rollout.max_response_tokens)",
                    keys=tuple(dict.fromkeys((key, SCHEDULE_KEY, *p.involved_keys)))))
        return out

    def _relation_problems(self) -> list[ConfigProblem]:
        """Prompt + response against the model context, and the micro-batch budgets against the longest sequence."""
        out: list[ConfigProblem] = []
        seq = self.max_sequence_tokens
        if self.max_context_tokens is not None and seq > self.max_context_tokens and not self.context_bounded:
            out.append(ConfigProblem(
                "rollout.max_response_tokens", self.max_response_tokens,
                f"data.max_prompt_tokens + rollout.max_response_tokens = {seq:,} > model context {self.max_context_tokens:,}",
                f"lower data.max_prompt_tokens or rollout.max_response_tokens so their sum is <= {self.max_context_tokens:,}, "
                "or use a model with a longer context" + (" (or let trajectories end at the context or drop "
                                                           "their oldest turns: rollout.multi_turn.context_policy=end|rolling)" if self.multi_turn else ""),
                keys=("rollout.max_response_tokens", "data.max_prompt_tokens"),
            ))
        size = max(1, self.sequence_parallel_size)
        longest = f"the longest possible sequence data.max_prompt_tokens + rollout.max_response_tokens = {seq:,}"
        if seq < self.max_prompt_tokens + self.max_response_tokens:
            longest = f"the longest possible sequence, the model context (rollout.multi_turn.context_policy={self.context_policy}) = {seq:,}"
        for key, value in self._keyed_values()[2:]:
            if value * size >= seq or (self.context_bounded and self.max_context_tokens is None):
                continue  # bounded by a context not read yet: checked when the model's config is (before step 1)
            if size > 1:
                message = f"x trainer.sequence_parallel_size={size} = {value * size:,} is smaller than {longest}"
                fix = f"raise {key} to >= {-(-seq // size):,} or lower the prompt/response budgets"
            else:
                message = f"smaller than {longest}"
                fix = (f"raise {key} to >= {seq:,} or lower the prompt/response budgets (or split each pack over ranks "
                       "with trainer.sequence_parallel_size)")
            out.append(ConfigProblem(key, value, message, fix, keys=(key, "data.max_prompt_tokens", "rollout.max_response_tokens")))
        return out

    def _multi_turn_problems(self) -> list[ConfigProblem]:
        """Multi-turn budgets that another budget makes pointless."""
        if self.multi_turn is None:
            return []
        _, per_turn, trajectory, _ = self.multi_turn
        key, response, total = "rollout.multi_turn", self.max_response_tokens, self.max_prompt_tokens + self.max_response_tokens
        out = []
        if per_turn is not None and per_turn > response:
            out.append(ConfigProblem(f"{key}.max_tokens_per_turn", per_turn,
                                     f"exceeds rollout.max_response_tokens={response:,}, which caps every turn anyway",
                                     f"set {key}.max_tokens_per_turn <= {response:,} or raise rollout.max_response_tokens",
                                     keys=(f"{key}.max_tokens_per_turn", "rollout.max_response_tokens")))
        if trajectory is not None and trajectory > total:
            out.append(ConfigProblem(f"{key}.max_trajectory_tokens", trajectory,
                                     f"exceeds data.max_prompt_tokens + rollout.max_response_tokens = {total:,}, which caps a trajectory anyway",
                                     f"set {key}.max_trajectory_tokens <= {total:,} or raise rollout.max_response_tokens",
                                     keys=(f"{key}.max_trajectory_tokens", "rollout.max_response_tokens", "data.max_prompt_tokens")))
        return out

    def validate(self) -> Budgets:
        """Return self, or raise `ConfigError` (a ValueError) listing every problem."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    def plan(self) -> str:
        """The budgets as a readable table, one budget a line, with the key that sets it."""
        seq = self.max_sequence_tokens
        context = "unknown (model config not read)"
        if self.max_context_tokens is not None:
            context = f"{self.max_context_tokens:>9,}  (RoPE factor {self.rope_factor:g})"
        rows = [
            ("prompt", "data.max_prompt_tokens", f"{self.max_prompt_tokens:>9,}"),
            ("response", "rollout.max_response_tokens", f"{self.max_response_tokens:>9,}" + ("  (the largest stage)" if self.response_stages else "")),
            ("sequence", "prompt + response" + (", at most the context" if self.context_bounded else ""), f"{seq:>9,}"),
            ("model context", "model config", context),
            ("update micro-batch", "train.max_tokens_per_microbatch", self._pack_row(self.max_tokens_per_microbatch, self.pack_tokens)),
            ("log-prob micro-batch", "train.max_tokens_per_logprob_microbatch",
             self._pack_row(self.max_tokens_per_logprob_microbatch, self.logprob_pack_tokens)),
        ]
        if self.response_stages:
            rows.insert(2, ("response by step", SCHEDULE_KEY, f"{'':>9}  {ResponseBudgetSchedule(self.response_stages).describe()}"))
        if self.multi_turn is not None:
            turns, per_turn, trajectory, tool = self.multi_turn
            trajectory = min(trajectory or self.max_prompt_tokens + self.max_response_tokens, seq)
            rows += [("turns", "rollout.multi_turn.max_turns", f"{turns:>9,}"),
                     ("assistant turn", "rollout.multi_turn.max_tokens_per_turn", f"{per_turn or self.max_response_tokens:>9,}"),
                     ("trajectory", "rollout.multi_turn.max_trajectory_tokens", f"{trajectory:>9,}  (prompt + turns + tool answers)"),
                     ("tool answer", "rollout.multi_turn.max_tool_response_tokens", f"{tool:>9,}")]
        lines = ["token budgets"] + [f"  {name:<22}{key:<42}{value}" for name, key, value in rows]
        problems = self.problems()
        unchecked = " (prompt + response <= model context not checked)" if self.max_context_tokens is None else ""
        lines += [f"  PROBLEM: {p}" for p in problems] or [f"  all relations hold{unchecked}"]
        return "\n".join(lines)

    def _pack_row(self, per_rank: int, per_pack: int) -> str:
        holds = f"holds {per_pack // max(self.max_sequence_tokens, 1)} x the longest sequence"
        if self.sequence_parallel_size <= 1:
            return f"{per_rank:>9,}  ({holds})"
        return f"{per_rank:>9,}  per rank; {per_pack:,} per pack over {self.sequence_parallel_size} sequence-parallel ranks ({holds})"

    def _keyed_values(self) -> list[tuple[str, int]]:
        return [
            ("data.max_prompt_tokens", self.max_prompt_tokens),
            ("rollout.max_response_tokens", self.max_response_tokens),
            ("train.max_tokens_per_microbatch", self.max_tokens_per_microbatch),
            ("train.max_tokens_per_logprob_microbatch", self.max_tokens_per_logprob_microbatch),
        ]

    def __str__(self) -> str:
        return self.plan()


def _response_stages(cfg: RunConfig) -> tuple[tuple[int, int], ...]:
    """The curriculum's stages; () without one, or while it is malformed (its own problems say how)."""
    raw = cfg.rollout.max_response_tokens_schedule
    if raw is None or schedule_problems(raw, cfg.rollout.max_response_tokens):
        return ()
    return tuple((start, budget) for start, budget in raw)


def _multi_turn(cfg: RunConfig) -> tuple[int, int | None, int | None, int] | None:
    mt = cfg.rollout.multi_turn
    if not mt.enabled:
        return None
    return (mt.max_turns, mt.max_tokens_per_turn, mt.max_trajectory_tokens, mt.max_tool_response_tokens)
