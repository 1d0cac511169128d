"""Thinking budgets (``rollout.think_budget_tokens``, ``answer_budget_tokens``, ``end_of_thinking``):
a response is a thinking segment, then the end-of-thinking text, then an answer, each with a budget
of its own. After Elastic Reasoning (Xu et al. 2025, arXiv 2505.05315: budget-constrained rollout,
the end-of-thinking token appended when thinking runs out) and s1's budget forcing (Muennighoff et
al. 2025, arXiv 2501.19393).

Shapes: ``B`` prompts · ``G`` responses per prompt.

`ThinkingEngine` wraps any engine of the contract with two calls per step:

1. thinking: each response generates up to ``think_budget_tokens``, stopping at the end-of-thinking
   text (a stop string of this call) as well as at the step's own stops and EOS;
2. the answer: a response whose thinking ended with the end-of-thinking text continues from there;
   one whose thinking ran out of budget gets the end-of-thinking tokens appended and continues;
   each continues by at most ``answer_budget_tokens`` (the call's grant,
   `packrl.rollout.engine.SamplingParams.continuation`), drawing as its own sample of its prompt's
   seed (`packrl.rollout.engine.single_sample_seed`; the HF engine keys its noise by position, so an
   answer after a natural end draws what one uninterrupted call would have).

The appended tokens were not sampled by the policy: ``response_mask`` is False there, so they are
out of the loss, the importance ratios and the in-reward KL, and `packrl.types.Response.forced_span`
says where they are (counted as ``seqlen/forced_tokens``). Truncation contract: a response's
finish reason is its answer's (``eos``, ``stop``; ``length`` when the answer filled its budget, a
truncated response), or its thinking's when thinking ended the response (EOS or a stop string
before the end-of-thinking text, or the model context). A forced end is not truncation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from packrl.config.schema import ModelConfig, RolloutConfig
from packrl.errors import ConfigProblem, KeyedValueError
from packrl.registry import ENGINE_WRAPPERS
from packrl.rollout.engine import EngineWrapper, RolloutEngine, SamplingParams, WrapperContext, single_sample_seed
from packrl.types import Response

THINK_CLOSE = "</think>"
"""The end-of-thinking text of the chat templates that write one (Qwen3, DeepSeek-R1)."""


def end_of_thinking_ids(tokenizer: Any, text: str | None) -> tuple[str, tuple[int, ...]]:
    """The end-of-thinking text (``rollout.end_of_thinking``, or the chat template's ``</think>``)
    and its token ids.

    Raises:
        KeyedValueError (a ValueError) about ``rollout.end_of_thinking``: no text is set and the
            chat template writes none; or the tokenizer cannot encode it (no ids, or ids that
            decode to other text).
    """
    if text is None:
        template = tokenizer.chat_template or ""
        if THINK_CLOSE not in template:
            raise KeyedValueError("rollout.end_of_thinking", "rollout.end_of_thinking=null and the chat template writes no "
                                  "</think>: packrl cannot tell where thinking ends",
                                  "set rollout.end_of_thinking to the text that ends it (e.g. '</think>')")
        text = THINK_CLOSE
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    decoded = tokenizer.decode(list(ids), skip_special_tokens=False)
    if not ids or decoded != text:
        raise KeyedValueError("rollout.end_of_thinking", f"rollout.end_of_thinking={text!r}: the tokenizer encodes it as "
                              f"{list(ids)}, which decodes to {decoded!r}",
                              "set rollout.end_of_thinking to text it round-trips (e.g. '</think>')")
    return text, ids


def check_thinking(tokenizer: Any, rollout: RolloutConfig) -> tuple[str, tuple[int, ...]]:
    """The end-of-thinking text and ids of the ``rollout`` section's thinking budgets, checked with
    the policy's tokenizer: set-up (`thinking_engine`) and preflight call this one check.

    Raises:
        KeyedValueError (a ValueError): the end-of-thinking text cannot be found or encoded
            (`end_of_thinking_ids`), or think + its tokens + answer exceed
            ``rollout.max_response_tokens`` (the exact count of the relation `packrl.config.budgets`
            checks at load with one forced token).
    """
    assert rollout.think_budget_tokens is not None and rollout.answer_budget_tokens is not None, "checked at config load"
    text, ids = end_of_thinking_ids(tokenizer, rollout.end_of_thinking)
    total = rollout.think_budget_tokens + len(ids) + rollout.answer_budget_tokens
    if total > rollout.max_response_tokens:
        think, answer = rollout.think_budget_tokens, rollout.answer_budget_tokens
        raise KeyedValueError("rollout.think_budget_tokens",
                              f"rollout.think_budget_tokens={think} + the end-of-thinking text {text!r} ({len(ids)} tokens) + "
                              f"rollout.answer_budget_tokens={answer} = {total} > rollout.max_response_tokens="
                              f"{rollout.max_response_tokens}: a forced answer would be cut",
                              f"lower a budget or raise rollout.max_response_tokens to >= {total}")
    return text, ids


class ThinkingEngine(EngineWrapper):
    """An engine of the contract whose responses think, then answer, each within its budget.

    Args:
        engine: the engine that generates (``hf``, ``vllm`` or a registered one).
        tokenizer: the policy's tokenizer (finds the end-of-thinking text in a response).
        think_budget_tokens / answer_budget_tokens: the two budgets, tokens.
        end_text / end_ids: the end-of-thinking text and its ids (`end_of_thinking_ids`).
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, think_budget_tokens: int, answer_budget_tokens: int,
                 end_text: str, end_ids: Sequence[int]) -> None:
        super().__init__(engine)
        self.tokenizer = tokenizer
        self.think, self.answer = think_budget_tokens, answer_budget_tokens
        self.end_text, self.end_ids = end_text, tuple(end_ids)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[list[Response]]:
        """``[B][G]`` responses (`packrl.rollout.engine.RolloutEngine.generate`), each a thinking
        segment, the end-of-thinking text and an answer (module docstring)."""
        thinking = dataclasses.replace(params, max_response_tokens=min(self.think, params.max_response_tokens),
                                       stop=(*params.stop, self.end_text))
        groups = self.engine.generate(prompt_ids, thinking, seeds)
        pending: list[tuple[int, int, Response, bool]] = []  # (prompt, sample, thinking, forced)
        for b, group in enumerate(groups):
            for g, response in enumerate(group):
                ended = response.finish_reason == "stop" and self._ends_thinking(response)
                if ended or response.finish_reason == "length":
                    pending.append((b, g, response, not ended))
        if not pending:
            return groups
        prompts = [tuple(prompt_ids[b]) + r.response_ids + (self.end_ids if forced else ()) for b, _, r, forced in pending]
        room = [params.max_response_tokens - len(p) + len(prompt_ids[b]) for p, (b, _, _, _) in zip(prompts, pending)]
        calls: dict[int, list[int]] = {}  # grant -> pending indices: one call per distinct answer grant
        for k, left in enumerate(room):
            calls.setdefault(max(1, min(self.answer, left)), []).append(k)
        out = [list(group) for group in groups]
        for grant, members in sorted(calls.items()):
            answers = self.engine.generate([prompts[k] for k in members], params.continuation(grant),
                                           [single_sample_seed(seeds[pending[k][0]], pending[k][1]) for k in members])
            for k, answer in zip(members, answers):
                b, g, response, forced = pending[k]
                out[b][g] = self._joined(response, answer[0], forced)
        return out

    def _ends_thinking(self, response: Response) -> bool:
        text = self.tokenizer.decode(list(response.response_ids), skip_special_tokens=False)
        return text.rstrip().endswith(self.end_text)

    def _joined(self, thinking: Response, answer: Response, forced: bool) -> Response:
        """Thinking + (the forced end-of-thinking tokens) + the answer, as one response."""
        appended = self.end_ids if forced else ()
        ids = thinking.response_ids + appended + answer.response_ids
        mask = (*_mask(thinking), *(False,) * len(appended), *_mask(answer))
        logprobs = None
        if thinking.rollout_logprobs is not None and answer.rollout_logprobs is not None:
            logprobs = (*thinking.rollout_logprobs, *(0.0,) * len(appended), *answer.rollout_logprobs)  # forced: not sampled
        start = len(thinking.response_ids)
        return Response(ids, answer.finish_reason, rollout_logprobs=logprobs, response_mask=mask,
                        forced_span=(start, start + len(appended)) if forced else None)


def thinking_engine(engine: RolloutEngine, tokenizer: Any, rollout: RolloutConfig) -> ThinkingEngine:
    """``engine`` under the thinking budgets of the ``rollout`` section (`ThinkingEngine`).

    Raises:
        KeyedValueError (a ValueError): as `check_thinking`.
    """
    text, ids = check_thinking(tokenizer, rollout)
    assert rollout.think_budget_tokens is not None and rollout.answer_budget_tokens is not None, "checked at config load"
    return ThinkingEngine(engine, tokenizer, think_budget_tokens=rollout.think_budget_tokens,
                          answer_budget_tokens=rollout.answer_budget_tokens, end_text=text, end_ids=ids)


@ENGINE_WRAPPERS.register("thinking")
def thinking_wrapper(engine: RolloutEngine, context: WrapperContext) -> ThinkingEngine:
    """The registered wrapper (`packrl.capabilities.THINKING_WRAPPER`): `thinking_engine`."""
    return thinking_engine(engine, context.tokenizer, context.rollout)


def preflight_problems(model: ModelConfig, rollout: RolloutConfig) -> list[ConfigProblem]:
    """The thinking budgets checked with the policy's tokenizer, as set-up checks them
    (`check_thinking`: the end-of-thinking text found and round-tripped, think + its exact tokens +
    answer within the response budget); a tokenizer that does not load is the model checks' to say."""
    from packrl.models.loading import load_policy_tokenizer

    try:
        check_thinking(load_policy_tokenizer(model), rollout)
    except KeyedValueError as err:
        return [err.problem(getattr(rollout, err.key.removeprefix("rollout.")))]
    except ValueError:  # the tokenizer itself: said by train and by the model checks
        return []
    return []


def _mask(response: Response) -> tuple[bool, ...]:
    return tuple(response.response_mask) if response.response_mask is not None else (True,) * len(response.response_ids)
