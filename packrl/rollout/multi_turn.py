"""Multi-turn rollouts with tools, on top of any engine of the engine contract.

Shapes: ``B`` prompts · ``G`` trajectories per prompt · ``P_b`` prompt tokens · ``R_i`` tokens after
the prompt (every assistant turn, tool answer and template token of trajectory i).

A trajectory starts from the prompt ids. Each turn, the engine continues it (one request per
trajectory, ``n = 1``, seed derived from the prompt's seed, the sample and the turn); the turn's
tokens are the policy's (response mask True). A turn that calls tools (`packrl.rollout.tools`)
gets their answers appended as tool messages, rendered by the model's chat template together with
the next assistant header (`packrl.chat.render.ToolRenderer`, which SFT traces render with too);
those tokens, and a turn-closing token the policy did not write, have response mask False and
never count in the loss. The trajectory ends when a turn
calls no tool, a turn is cut by a budget, the engine aborts, or ``max_turns`` turns are done.

Every request asks for ``min(max_tokens_per_turn, context left, trajectory left, response left)``
tokens (`TurnLimits.request`); the response and per-turn limits are capped at the call's
``SamplingParams.max_response_tokens`` (a length curriculum's stage, `TurnLimits.within`). Below 1
the trajectory ends with finish reason ``context`` and the engine is not called. A tool answer
that does not fit the same limits is not appended and the trajectory ends with ``context``. The
trajectory's finish reason is its last turn's, except that a turn cut where the model context
bound is ``context``, and a trajectory whose last turn still calls a tool at ``max_turns`` is
``length``: cut by a budget, so truncated (invariant 7).

Token-exact (invariant 5, turn by turn): every request is the trajectory's ids so far, and the
trainer scores the prompt followed by exactly the ids appended here, so the policy tokens' log-probs
in training are taken in the contexts the engine generated them in.

The rolling window (``rollout.multi_turn.context_policy=rolling``): when the next request would
get less than its budget because of the model context, the oldest complete turns (an assistant
turn, its closing token and the tool answer with the next assistant header) leave the request,
oldest first, until it fits; the prompt (system and first user message, ending with the assistant
header) and the latest turn with its answer always stay, and nothing is cut inside a message. The
request is then ``prompt + response[start:]``; each turn records its ``start``
(`Trajectory.context_starts`) and the trainer scores it in exactly that context
(`packrl.seqlen.stepwise`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from packrl.chat.render import ToolRenderer
from packrl.chat.tool_schemas import renders_tools, template_kwargs
from packrl.registry import ENGINE_WRAPPERS
from packrl.rollout.engine import EngineWrapper, RolloutEngine, SamplingParams, WrapperContext
from packrl.rollout.tools import CALL_CLOSE, ToolCall, parse_tool_calls, run_tool
from packrl.seqlen.prompt_policy import cut_text
from packrl.types import FinishReason, Response, Trajectory

if TYPE_CHECKING:
    from packrl.config.schema import MultiTurnConfig, RolloutConfig

logger = logging.getLogger(__name__)
TRUNCATION_MARKER = "...(truncated)..."
"""Stands where a long tool answer was cut (its tokens count in ``max_tool_response_tokens``)."""
_MAX_CHARS_PER_TOKEN = 64  # a tool answer is cut to this many characters per budget token before it is tokenised


@dataclass(frozen=True)
class TurnLimits:
    """The token limits every turn is held to.

    Attributes:
        max_tokens_per_turn: tokens one assistant turn may generate (``rollout.multi_turn.max_tokens_per_turn``).
        max_response_tokens: tokens after the prompt: turns, tool answers, template (``rollout.max_response_tokens``).
        max_trajectory_tokens: prompt + everything after it (``rollout.multi_turn.max_trajectory_tokens``).
        max_context_tokens: the model context.
    """

    max_tokens_per_turn: int
    max_response_tokens: int
    max_trajectory_tokens: int
    max_context_tokens: int

    def room(self, num_tokens: int, num_prompt_tokens: int, num_window_tokens: int | None = None) -> tuple[int, str]:
        """Tokens a trajectory of ``num_tokens`` may still grow by, and which limit binds
        (``response``, ``trajectory`` or ``context``). ``num_window_tokens``: the tokens the model
        sees (prompt + the turns still in the context under the rolling window); default all."""
        window = num_tokens if num_window_tokens is None else num_window_tokens
        left = {"response": self.max_response_tokens - (num_tokens - num_prompt_tokens),
                "trajectory": self.max_trajectory_tokens - num_tokens, "context": self.max_context_tokens - window}
        binding = min(left, key=lambda k: left[k])
        return left[binding], binding

    def request(self, num_tokens: int, num_prompt_tokens: int, num_window_tokens: int | None = None) -> tuple[int, str]:
        """The next turn's token budget and its binding limit (``turn`` when the per-turn cap binds)."""
        room, binding = self.room(num_tokens, num_prompt_tokens, num_window_tokens)
        return (self.max_tokens_per_turn, "turn") if self.max_tokens_per_turn <= room else (room, binding)

    def within(self, max_response_tokens: int) -> TurnLimits:
        """These limits for one `generate` call whose ``SamplingParams.max_response_tokens`` may be
        smaller (a length curriculum's stage): the response and per-turn limits capped at it, tokens."""
        return replace(self, max_response_tokens=min(self.max_response_tokens, max_response_tokens),
                       max_tokens_per_turn=min(self.max_tokens_per_turn, max_response_tokens))

    def wanted(self, num_tokens: int, num_prompt_tokens: int) -> int:
        """The next turn's budget were the context unlimited (what the rolling window makes room for)."""
        return min(self.max_tokens_per_turn, self.max_response_tokens - (num_tokens - num_prompt_tokens),
                   self.max_trajectory_tokens - num_tokens)


_ENDED_BY_LIMIT = {"turn": "turn_tokens", "response": "response_tokens", "trajectory": "trajectory_tokens", "context": "context"}


@dataclass
class _State:
    """One trajectory being built."""

    seed: int
    num_prompt_tokens: int
    ids: list[int]
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[str, int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    ended_by: str = ""
    binding: str = "turn"
    num_tool_calls: int = 0
    num_malformed_calls: int = 0
    num_tool_errors: int = 0
    tool_answers: list[str] = field(default_factory=list)
    context_start: int = 0
    """Response offset where the context resumes after the prompt (the rolling window's start)."""
    turn_starts: list[int] = field(default_factory=list)
    context_starts: list[int] = field(default_factory=list)

    @property
    def num_response_tokens(self) -> int:
        return len(self.ids) - self.num_prompt_tokens

    @property
    def num_window_tokens(self) -> int:
        """Tokens of the context the model sees: the prompt and the response from `context_start`."""
        return len(self.ids) - self.context_start

    def window(self) -> list[int]:
        """The next request: the prompt and the response from `context_start`."""
        return self.ids[: self.num_prompt_tokens] + self.ids[self.num_prompt_tokens + self.context_start:]

    def add(self, role: str, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        if not ids:
            return
        self.ids += ids
        self.mask += [role == "assistant"] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.segments.append((role, len(ids)))

    def end(self, finish_reason: FinishReason, ended_by: str) -> None:
        self.finish_reason, self.ended_by = finish_reason, ended_by

    def response(self, with_logprobs: bool) -> Response:
        trajectory = Trajectory(segments=tuple(self.segments), num_tool_calls=self.num_tool_calls,
                                num_malformed_calls=self.num_malformed_calls, num_tool_errors=self.num_tool_errors,
                                ended_by=self.ended_by, context_starts=tuple(self.context_starts) if any(self.context_starts) else (),
                                tool_answers=tuple(self.tool_answers))
        n = self.num_prompt_tokens
        assert self.finish_reason is not None, "every trajectory ends before it is returned"
        return Response(tuple(self.ids[n:]), self.finish_reason,
                        tuple(self.logprobs) if with_logprobs else None, tuple(self.mask), trajectory=trajectory)


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The seed of one request: a function of the prompt's seed, the sample index and the turn
    alone, so a trajectory does not depend on its batch or worker."""
    digest = hashlib.blake2b(f"{seed}/{sample}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


class MultiTurnEngine(EngineWrapper):
    """An engine of the contract whose responses are whole tool-using trajectories.

    Args:
        engine: any `RolloutEngine`; it serves every turn.
        tokenizer: the policy's tokenizer (decodes turns; renders tool messages).
        tools: the tool names this run allows (``rollout.multi_turn.tools``).
        max_turns: assistant turns per trajectory (``rollout.multi_turn.max_turns``).
        limits: the token limits (`TurnLimits`).
        max_tool_response_tokens: a tool answer's content is cut to this many tokens.
        truncation_side: which side of a long tool answer is cut (``left`` drops the start,
            ``right`` the end, ``middle`` the middle), as for prompts.
        renderer: the chat template's rendering of tool messages (`ToolRenderer`).
        tool_timeout_s: seconds a tool may take before its call is answered with an error (None: no limit).
        rolling: drop the oldest complete turns from the context when the next request would not
            get its budget (``rollout.multi_turn.context_policy=rolling``; `Trajectory.context_starts`).
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, tools: Sequence[str], max_turns: int, limits: TurnLimits,
                 max_tool_response_tokens: int, truncation_side: str, renderer: ToolRenderer, tool_timeout_s: float | None = None,
                 rolling: bool = False):
        super().__init__(engine)
        self.tokenizer, self.tools, self.tool_timeout_s = tokenizer, frozenset(tools), tool_timeout_s
        self.rolling = rolling
        self.max_turns, self.limits, self.renderer = max_turns, limits, renderer
        self.max_tool_response_tokens, self.truncation_side = max_tool_response_tokens, truncation_side

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[list[Response]]:
        """``[B][G]`` trajectories (see the module docstring); the contract of `RolloutEngine.generate`."""
        states = [_State(seed=turn_seed(seed, g, 0), num_prompt_tokens=len(p), ids=list(p))
                  for p, seed in zip(prompt_ids, seeds) for g in range(params.n)]
        limits = self.limits.within(params.max_response_tokens)
        for turn in range(1, self.max_turns + 1):
            requests: dict[int, list[_State]] = {}
            for state in (s for s in states if s.finish_reason is None):
                if self.rolling:
                    self._slide(state, limits)
                budget, state.binding = limits.request(len(state.ids), state.num_prompt_tokens, state.num_window_tokens)
                if budget < 1:
                    state.end("context", _ENDED_BY_LIMIT[state.binding])
                else:
                    requests.setdefault(budget, []).append(state)
            if not requests:
                break
            for budget, group in sorted(requests.items()):
                turn_params = replace(params, n=1, max_response_tokens=budget)
                out = self.engine.generate([s.window() for s in group], turn_params, [turn_seed(s.seed, 0, turn) for s in group])
                for state, responses in zip(group, out):
                    self._after_turn(state, responses[0], turn, limits)
        return [[s.response(params.return_logprobs) for s in states[b * params.n:(b + 1) * params.n]] for b in range(len(prompt_ids))]

    def _slide(self, state: _State, limits: TurnLimits) -> None:
        """The rolling window: drop the oldest complete turns (an assistant turn with the tool
        answer after it) until the next request gets the budget an unlimited context would give
        it. The prompt and the latest turn with its answer always stay; a turn is never cut."""
        wanted = limits.wanted(len(state.ids), state.num_prompt_tokens)
        for start in state.turn_starts[1:]:  # where each earlier turn's round ends: the next turn starts there
            if limits.max_context_tokens - state.num_window_tokens >= wanted:
                return
            state.context_start = max(state.context_start, start)

    def _after_turn(self, state: _State, turn: Response, index: int, limits: TurnLimits) -> None:
        if turn.response_ids:
            state.turn_starts.append(state.num_response_tokens)
            state.context_starts.append(state.context_start)
        state.add("assistant", turn.response_ids, turn.rollout_logprobs)
        if turn.finish_reason in ("length", "context"):
            reason = "context" if state.binding == "context" else turn.finish_reason
            state.end(reason, _ENDED_BY_LIMIT[state.binding] if turn.finish_reason == "length" else "context")
            return
        if turn.finish_reason == "abort":
            state.end("abort", "abort")
            return
        calls = parse_tool_calls(self.tokenizer.decode(list(turn.response_ids), skip_special_tokens=True), self.tools)
        if not calls:
            state.end(turn.finish_reason, "answer")
            return
        if index == self.max_turns:
            state.end("length", "max_turns")
            return
        self._answer(state, turn, calls, limits)

    def _answer(self, state: _State, turn: Response, calls: list[ToolCall], limits: TurnLimits) -> None:
        close = self.renderer.close
        closing = () if tuple(turn.response_ids[-len(close):]) == close else close  # ended on a stop string: close it
        contents, answered = [], []
        for call in calls:
            answer, failed = run_tool(call, self.tool_timeout_s)
            state.num_tool_calls += 1
            state.num_malformed_calls += call.error is not None
            state.num_tool_errors += failed and call.error is None
            contents.append(self._cut(answer))
            if not failed:
                answered.append(contents[-1])
        ids = self.renderer.after_close(contents)
        # under the rolling window the next request must hold the prompt and this turn's round at least
        window = state.num_prompt_tokens + state.num_response_tokens - state.turn_starts[-1] if self.rolling else None
        room, binding = limits.room(len(state.ids), state.num_prompt_tokens, window)
        if len(closing) + len(ids) >= room:  # the close, the answer and at least one token of the next turn must fit
            state.end("context", _ENDED_BY_LIMIT[binding])
            return
        state.add("template", closing)
        state.add("tool", ids)
        state.tool_answers += answered

    def _cut(self, answer: str) -> str:
        """``answer`` within ``max_tool_response_tokens`` tokens: a longer one loses its start
        (``left``), end (``right``) or middle, and `TRUNCATION_MARKER` stands where text was
        removed, its tokens inside the budget. A very long answer is first cut by characters, so
        its cost does not grow with its size."""
        budget = self.max_tool_response_tokens
        span = budget * _MAX_CHARS_PER_TOKEN
        long = len(answer) > 2 * span
        if long:
            answer = {"left": answer[-2 * span:], "right": answer[:2 * span]}.get(self.truncation_side, answer[:span] + answer[-span:])
        ids = self.tokenizer(answer, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if len(ids) <= budget and not long:
            return answer
        keep = max(0, budget - len(self.tokenizer(TRUNCATION_MARKER, add_special_tokens=False)["input_ids"]))
        decode = self.tokenizer.decode
        if self.truncation_side == "left":
            return TRUNCATION_MARKER + cut_text(ids, keep, "left", decode)
        if self.truncation_side == "right":
            return cut_text(ids, keep, "right", decode) + TRUNCATION_MARKER
        head, tail = keep - keep // 2, keep // 2
        return cut_text(ids, head, "right", decode) + TRUNCATION_MARKER + cut_text(ids, tail, "left", decode)


@ENGINE_WRAPPERS.register("multi_turn")
def multi_turn_wrapper(engine: RolloutEngine, context: WrapperContext) -> MultiTurnEngine:
    """The registered wrapper (`packrl.capabilities.MULTI_TURN_WRAPPER`): `multi_turn_engine` of the
    run's ``rollout.multi_turn`` section and budgets."""
    rollout = context.rollout
    return multi_turn_engine(engine, context.tokenizer, rollout.multi_turn, max_prompt_tokens=context.max_prompt_tokens,
                             max_response_tokens=rollout.max_response_tokens, max_context_tokens=context.max_context_tokens)


def preflight_notes(rollout: RolloutConfig) -> list[str]:
    """With tools but without ``</tool_call>`` in ``rollout.stop``, a turn runs on after its call."""
    if CALL_CLOSE in rollout.stop:
        return []
    return [f"rollout.multi_turn.tools is set but rollout.stop does not hold {CALL_CLOSE!r}: a turn goes on after its tool "
            f"call until EOS or its budget, and its calls run only then; add rollout.stop=['{CALL_CLOSE}'] to answer each "
            "call as soon as it is written"]


def multi_turn_engine(engine: RolloutEngine, tokenizer: Any, mt: MultiTurnConfig, *, max_prompt_tokens: int,
                      max_response_tokens: int, max_context_tokens: int) -> MultiTurnEngine:
    """``engine`` serving the multi-turn rollouts the section ``rollout.multi_turn`` describes.

    Args:
        mt: the `MultiTurnConfig` section; its unset per-turn and trajectory limits default to
            ``max_response_tokens`` and ``max_prompt_tokens + max_response_tokens`` (tokens).
        max_context_tokens: the model's context (tokens), which no trajectory may outgrow.

    Raises:
        ValueError: the chat template cannot render tool messages token-exactly (`ToolRenderer`).
    """
    response = max_response_tokens
    limits = TurnLimits(max_tokens_per_turn=mt.max_tokens_per_turn or response, max_response_tokens=response,
                        max_trajectory_tokens=mt.max_trajectory_tokens or max_prompt_tokens + response,
                        max_context_tokens=max_context_tokens)
    kwargs = template_kwargs(mt)
    if kwargs and not renders_tools(tokenizer, kwargs):
        logger.warning("the chat template ignores tools=, so the tools' JSON schemas (rollout.multi_turn.tool_schemas=template) "
                       "do not reach the policy: the prompt (data.system_prompt / data.instruction) must describe the call "
                       "format; set rollout.multi_turn.tool_schemas=none to silence this")
    renderer = ToolRenderer(tokenizer, mt.tool_role, kwargs)
    return MultiTurnEngine(engine, tokenizer, tools=mt.tools, max_turns=mt.max_turns, limits=limits,
                           max_tool_response_tokens=mt.max_tool_response_tokens,
                           truncation_side=mt.tool_response_truncation_side, renderer=renderer, tool_timeout_s=mt.tool_timeout_s,
                           rolling=mt.context_policy == "rolling")
