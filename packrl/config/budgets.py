"""The config's side of the token budgets: `packrl.seqlen.Budgets` built from a `RunConfig`
(`budgets_of`), every broken budget relation as a problem naming its config keys
(`budget_problems`), the budget table of ``RUN_DIR/budgets.txt`` (`budgets_table`), and the length
curriculum read from ``rollout.max_response_tokens_schedule`` (`response_schedule`; the key's own
checks are `packrl.config.curriculum`).

seqlen decides which relation breaks (`packrl.seqlen.Budgets.violations`); this module names the
keys, the values, the limits and the fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from packrl.config.curriculum import SCHEDULE_KEY, schedule_problems
from packrl.errors import ConfigError, ConfigProblem, check_positive
from packrl.seqlen.budgets import Budgets, BudgetViolation, model_context_tokens
from packrl.seqlen.curriculum import ResponseBudgetSchedule

if TYPE_CHECKING:
    from packrl.config.schema import DataConfig, RolloutConfig, RunConfig, TrainerConfig
    from packrl.config.train import TrainConfig
KEYS = {
    "max_prompt_tokens": "data.max_prompt_tokens",
    "max_response_tokens": "rollout.max_response_tokens",
    "max_tokens_per_microbatch": "train.max_tokens_per_microbatch",
    "max_tokens_per_logprob_microbatch": "train.max_tokens_per_logprob_microbatch",
    "max_tokens_per_turn": "rollout.multi_turn.max_tokens_per_turn",
    "max_trajectory_tokens": "rollout.multi_turn.max_trajectory_tokens",
}
"""`Budgets` field -> the config key that sets it."""


def budgets_of(cfg: RunConfig, max_context_tokens: int | None = None, rope_factor: float = 1.0, forced_tokens: int = 1) -> Budgets:
    """The budgets of ``cfg`` (`budgets_of_sections` of its sections)."""
    return budgets_of_sections(cfg.data, cfg.rollout, cfg.train, cfg.trainer, max_context_tokens, rope_factor, forced_tokens)


def budgets_of_sections(data: DataConfig, rollout: RolloutConfig, train: TrainConfig, trainer: TrainerConfig,
                        max_context_tokens: int | None = None, rope_factor: float = 1.0, forced_tokens: int = 1) -> Budgets:
    """The budgets the ``data``, ``rollout``, ``train`` and ``trainer`` sections set;
    ``max_context_tokens`` (RoPE scaling included) when the model config has been read, else None
    (the context relation is then not checked); ``forced_tokens``: the end-of-thinking text's
    tokens when the tokenizer has told (thinking budgets), else 1."""
    mt, r = rollout.multi_turn, rollout
    return Budgets(
        max_prompt_tokens=data.max_prompt_tokens,
        max_response_tokens=rollout.max_response_tokens,
        max_context_tokens=max_context_tokens,
        max_tokens_per_microbatch=train.max_tokens_per_microbatch,
        max_tokens_per_logprob_microbatch=train.max_tokens_per_logprob_microbatch,
        rope_factor=rope_factor,
        sequence_parallel_size=trainer.sequence_parallel_size,
        context_policy=mt.context_policy if mt.enabled else "error",
        multi_turn=(mt.max_turns, mt.max_tokens_per_turn, mt.max_trajectory_tokens, mt.max_tool_response_tokens) if mt.enabled else None,
        response_stages=_response_stages(rollout),
        thinking=(r.think_budget_tokens, forced_tokens, r.answer_budget_tokens or 0) if r.think_budget_tokens is not None else None,
    )


def budgets_of_model(cfg: RunConfig, model_config: Any) -> Budgets:
    """`budgets_of` with the model context read from ``model_config`` (`packrl.seqlen.model_context_tokens`)."""
    context, factor = model_context_tokens(model_config)
    return budgets_of(cfg, context, factor)


MAX_ROPE_FACTOR = 4
"""The largest RoPE factor a fix proposes (``model.rope_scaling``): Qwen2.5 and Qwen3 document
YaRN with factor 4 (32,768 -> 131,072 tokens) as the extension their models support at
inference; past it, a longer-context model is the fix, not a larger factor."""


@dataclass(frozen=True, slots=True)
class PromptRoom:
    """What the model context leaves for a prompt once the response budget is reserved.

    Attributes:
        max_context_tokens: the model context, tokens (``model.rope_scaling`` included).
        max_response_tokens: ``rollout.max_response_tokens`` (the largest stage of a schedule).
    """

    max_context_tokens: int
    max_response_tokens: int

    @property
    def max_prompt_tokens(self) -> int:
        """The largest ``data.max_prompt_tokens`` the context holds: context - response budget."""
        return self.max_context_tokens - self.max_response_tokens

    @classmethod
    def of(cls, rollout: RolloutConfig, max_context_tokens: int | None) -> PromptRoom | None:
        """The room the ``rollout`` section's response budget leaves in a context of
        ``max_context_tokens``; None when the context is unknown."""
        return None if max_context_tokens is None else cls(max_context_tokens, rollout.max_response_tokens)

    def describe(self) -> str:
        return (f"the model context {self.max_context_tokens:,} - rollout.max_response_tokens={self.max_response_tokens:,} "
                f"leaves {self.max_prompt_tokens:,}")


def prompt_budget_fix(needed: int, room: PromptRoom | None) -> str:
    """The fix that gives a ``needed``-token prompt its room, satisfiable within the model context.

    Args:
        needed: the prompt length to make room for, tokens.
        room: what the model context leaves for a prompt; None when the context is unknown.

    Returns:
        ``raise data.max_prompt_tokens to >= needed`` when that fits the context (or the context
        is unknown); otherwise that no prompt budget fits, with what does: filtering or cutting
        the prompts at the largest budget that fits, a smaller response budget when the prompt
        alone fits the context, or a model with a longer context.
    """
    if room is None or needed <= room.max_prompt_tokens:
        within = "" if room is None else f" ({room.describe()})"
        return f"raise data.max_prompt_tokens to >= {needed:,}{within}"
    options = []
    if room.max_prompt_tokens >= 1:
        options.append(f"set data.max_prompt_tokens <= {room.max_prompt_tokens:,} with data.overlong_prompt=filter (drop the "
                       "longer prompts) or left/right/middle (cut them to the budget)")
    if needed < room.max_context_tokens:
        options.append(f"lower rollout.max_response_tokens to <= {room.max_context_tokens - needed:,} to make room")
    options.append(f"use a model whose context holds {needed + room.max_response_tokens:,} tokens")
    return f"no data.max_prompt_tokens fits a {needed:,}-token prompt ({room.describe()}): " + ", or ".join(options)


def _response_stages(rollout: RolloutConfig) -> tuple[tuple[int, int], ...]:
    """The curriculum's stages; () without one, or while it is malformed (its own problems say how)."""
    raw = rollout.max_response_tokens_schedule
    if raw is None or schedule_problems(raw, rollout.max_response_tokens):
        return ()
    return tuple((start, budget) for start, budget in raw)


def response_schedule(rollout: RolloutConfig) -> ResponseBudgetSchedule:
    """The schedule of ``rollout.max_response_tokens_schedule``, or one stage of
    ``rollout.max_response_tokens`` when it is null.

    Raises:
        ValueError: the schedule is malformed (a loaded config has been checked already).
    """
    raw = rollout.max_response_tokens_schedule
    if not raw:
        return ResponseBudgetSchedule.constant(rollout.max_response_tokens)
    return ResponseBudgetSchedule(tuple((int(s), int(b)) for s, b in raw))


def budget_problems(budgets: Budgets) -> list[ConfigProblem]:
    """Every broken budget or relation, each with its dotted key, value, limit and fix."""
    out: list[ConfigProblem] = []
    for name in ("max_prompt_tokens", "max_response_tokens", "max_tokens_per_microbatch", "max_tokens_per_logprob_microbatch"):
        out += check_positive(KEYS[name], getattr(budgets, name))
    if budgets.max_context_tokens is not None and budgets.max_context_tokens < 1:
        out.append(ConfigProblem("model.path", budgets.max_context_tokens, "model context must be >= 1 token",
                                 "fix max_position_embeddings in the model's config.json"))
    if out:
        return out
    return [_problem(budgets, v) for v in budgets.violations()]


def validate_budgets(budgets: Budgets) -> Budgets:
    """Return ``budgets``, or raise `ConfigError` (a ValueError) listing every problem."""
    problems = budget_problems(budgets)
    if problems:
        raise ConfigError(problems)
    return budgets


def _problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    """The keyed problem of one violation; a curriculum stage's names the stage and the schedule key."""
    if v.stage is not None:
        staged = replace(budgets, max_response_tokens=budgets.response_stages[v.stage][1], response_stages=())
        p = _problem(staged, replace(v, stage=None))
        schedule = ResponseBudgetSchedule(budgets.response_stages)
        start, budget = budgets.response_stages[v.stage]
        key, value = (SCHEDULE_KEY, [start, budget]) if p.key == KEYS["max_response_tokens"] else (p.key, p.value)
        return ConfigProblem(
            key, value, f"in {schedule.label(v.stage)}, whose budget stands for rollout.max_response_tokens: {p.message}",
            f"{p.fix} (stage {v.stage + 1}'s budget is {SCHEDULE_KEY}[{v.stage}][1]; the largest stage is rollout.max_response_tokens)",
            keys=tuple(dict.fromkeys((key, SCHEDULE_KEY, *p.involved_keys))))
    return {"context": _context_problem, "microbatch": _microbatch_problem, "per_turn": _per_turn_problem,
            "trajectory": _trajectory_problem, "thinking": _thinking_problem}[v.kind](budgets, v)


def _context_problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    rolling = (" (or let trajectories end at the context or drop their oldest turns: "
               "rollout.multi_turn.context_policy=end|rolling)" if budgets.multi_turn else "")
    return ConfigProblem(
        "rollout.max_response_tokens", v.value,
        f"data.max_prompt_tokens + rollout.max_response_tokens = {budgets.max_sequence_tokens:,} > model context {v.limit:,}",
        f"lower data.max_prompt_tokens or rollout.max_response_tokens so their sum is <= {v.limit:,}, "
        "or use a model with a longer context" + rolling,
        keys=("rollout.max_response_tokens", "data.max_prompt_tokens"),
    )


def _microbatch_problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    key, seq, size = KEYS[v.budget], v.limit, max(1, budgets.sequence_parallel_size)
    longest = f"the longest possible sequence data.max_prompt_tokens + rollout.max_response_tokens = {seq:,}"
    if seq < budgets.max_prompt_tokens + budgets.max_response_tokens:
        longest = f"the longest possible sequence, the model context (rollout.multi_turn.context_policy={budgets.context_policy}) = {seq:,}"
    if size > 1:
        message = f"x trainer.sequence_parallel_size={size} = {v.value * size:,} is smaller than {longest}"
        fix = f"raise {key} to >= {-(-seq // size):,} or lower the prompt/response budgets"
    else:
        message = f"smaller than {longest}"
        fix = (f"raise {key} to >= {seq:,} or lower the prompt/response budgets (or split each pack over ranks "
               "with trainer.sequence_parallel_size)")
    context = budgets.max_context_tokens
    if context is not None and seq > context:  # the sum itself breaks the context: a budget that large can never be needed
        fix = (f"first fit data.max_prompt_tokens + rollout.max_response_tokens into the model context {context:,} (the "
               f"rollout.max_response_tokens problem), then raise {key} to >= their sum"
               + (f" / trainer.sequence_parallel_size={size}" if size > 1 else "") + f" ({-(-context // size):,} always suffices)")
    return ConfigProblem(key, v.value, message, fix, keys=(key, "data.max_prompt_tokens", "rollout.max_response_tokens"))


def _per_turn_problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    key = KEYS[v.budget]
    return ConfigProblem(key, v.value, f"exceeds rollout.max_response_tokens={v.limit:,}, which caps every turn anyway",
                         f"set {key} <= {v.limit:,} or raise rollout.max_response_tokens",
                         keys=(key, "rollout.max_response_tokens"))


def _trajectory_problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    key = KEYS[v.budget]
    return ConfigProblem(key, v.value, f"exceeds data.max_prompt_tokens + rollout.max_response_tokens = {v.limit:,}, which caps a "
                         "trajectory anyway", f"set {key} <= {v.limit:,} or raise rollout.max_response_tokens",
                         keys=(key, "rollout.max_response_tokens", "data.max_prompt_tokens"))


def _thinking_problem(budgets: Budgets, v: BudgetViolation) -> ConfigProblem:
    assert budgets.thinking is not None
    think, forced, answer = budgets.thinking
    return ConfigProblem("rollout.think_budget_tokens", think,
                         f"+ the forced end-of-thinking text ({forced} token(s)) + rollout.answer_budget_tokens={answer:,} = {v.value:,} > "
                         f"rollout.max_response_tokens={v.limit:,}: a forced answer would be cut by the response budget",
                         f"lower rollout.think_budget_tokens or rollout.answer_budget_tokens, or raise rollout.max_response_tokens "
                         f"to >= {v.value:,}",
                         keys=("rollout.think_budget_tokens", "rollout.answer_budget_tokens", "rollout.max_response_tokens"))


def budgets_table(budgets: Budgets) -> str:
    """The budgets as a readable table, one budget a line, with the key that sets it, then the
    problems (or "all relations hold")."""
    b, seq = budgets, budgets.max_sequence_tokens
    context = "unknown (model config not read)"
    if b.max_context_tokens is not None:
        context = f"{b.max_context_tokens:>9,}  (RoPE factor {b.rope_factor:g})"
    rows = [
        ("prompt", KEYS["max_prompt_tokens"], f"{b.max_prompt_tokens:>9,}"),
        ("response", KEYS["max_response_tokens"], f"{b.max_response_tokens:>9,}" + ("  (the largest stage)" if b.response_stages else "")),
        ("sequence", "prompt + response" + (", at most the context" if b.context_bounded else ""), f"{seq:>9,}"),
        ("model context", "model config", context),
        ("update micro-batch", KEYS["max_tokens_per_microbatch"], _pack_row(b, b.max_tokens_per_microbatch, b.pack_tokens)),
        ("log-prob micro-batch", KEYS["max_tokens_per_logprob_microbatch"],
         _pack_row(b, b.max_tokens_per_logprob_microbatch, b.logprob_pack_tokens)),
    ]
    if b.response_stages:
        rows.insert(2, ("response by step", SCHEDULE_KEY, f"{'':>9}  {ResponseBudgetSchedule(b.response_stages).describe()}"))
    if b.multi_turn is not None:
        turns, per_turn, trajectory, tool = b.multi_turn
        trajectory = min(trajectory or b.max_prompt_tokens + b.max_response_tokens, seq)
        rows += [("turns", "rollout.multi_turn.max_turns", f"{turns:>9,}"),
                 ("assistant turn", KEYS["max_tokens_per_turn"], f"{per_turn or b.max_response_tokens:>9,}"),
                 ("trajectory", KEYS["max_trajectory_tokens"], f"{trajectory:>9,}  (prompt + turns + tool answers)"),
                 ("tool answer", "rollout.multi_turn.max_tool_response_tokens", f"{tool:>9,}")]
    lines = ["token budgets"] + [f"  {name:<22}{key:<42}{value}" for name, key, value in rows]
    unchecked = " (prompt + response <= model context not checked)" if b.max_context_tokens is None else ""
    lines += [f"  PROBLEM: {p}" for p in budget_problems(b)] or [f"  all relations hold{unchecked}"]
    return "\n".join(lines)


def _pack_row(budgets: Budgets, per_rank: int, per_pack: int) -> str:
    holds = f"holds {per_pack // max(budgets.max_sequence_tokens, 1)} x the longest sequence"
    if budgets.sequence_parallel_size <= 1:
        return f"{per_rank:>9,}  ({holds})"
    return f"{per_rank:>9,}  per rank; {per_pack:,} per pack over {budgets.sequence_parallel_size} sequence-parallel ranks ({holds})"
