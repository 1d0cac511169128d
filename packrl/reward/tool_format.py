"""The tool-call format reward, the ``tool_format`` reward-shaping part
(``reward.shaping.tool_format.weight``, `packrl.reward.shaping`): shaping that rewards calling the
run's tools well, added to the task reward of multi-turn responses.

A policy that never writes a call gives GRPO nothing to reinforce; a small reward for the call's
form makes the first calls worth repeating (the format rewards of DeepSeek-R1, arXiv 2501.12948,
section 2.2.2, and of verl's and prime-rl's multi-turn recipes, where users add one to the task
reward). With weight ``w``, a response's format reward is the sum of three terms, each reported as
its own metric (``reward/tool_format/<term>/mean``, mean over the batch; the sum is
``reward/tool_format/mean``):

- ``call``: ``+w/2`` when the response holds at least one well-formed call (valid JSON naming an
  allowed tool, `packrl.rollout.tools.parse_tool_calls`);
- ``answer_used``: ``+w/2`` when the response ends with an answer turn (no call) whose text
  contains the answer of one of its successful calls, as the policy saw it;
- ``malformed``: ``-w`` when the response holds a malformed call.

The sum lies in ``[-w, w]``. It goes into the reward (`packrl.types.ScoredBatch.rewards`, from which
advantages are computed); the task score (``ScoredBatch.scores``, validation accuracy) is left as
it is. A single-turn response scores 0 in every part. Counts come from the trajectory the rollout
built (`packrl.types.Trajectory`), so the reward sees exactly the calls the tools answered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from packrl.errors import ConfigProblem
from packrl.registry import REWARD_SHAPING
from packrl.types import Response, Trajectory

if TYPE_CHECKING:
    from packrl.config.schema import RewardConfig, RolloutConfig
    from packrl.reward.shaping import ShapingInputs, ShapingOutput

PARTS = ("call", "answer_used", "malformed")
"""The format reward's terms; metric ``reward/tool_format/<term>/mean``."""
KEY = "reward.shaping.tool_format"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolFormatOptions:
    """The ``tool_format`` part's knob."""

    weight: float = 0.2
    """``w``: +w/2 for a well-formed call, +w/2 for a final answer that uses a tool's answer, -w for
    a malformed call (finite, > 0)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        if 0 < self.weight < math.inf:
            return []
        return [ConfigProblem(f"{prefix}.weight", self.weight, "must be a finite number > 0 (a malformed call already scores -w)",
                              f"set {prefix}.weight=0.2, or {prefix}=null (off)")]


@REWARD_SHAPING.register("tool_format", options=ToolFormatOptions)
def tool_format(inputs: ShapingInputs) -> ShapingOutput:
    """The format reward of every response (`format_parts`), its terms reported by name."""
    from packrl.reward.shaping import ShapingOutput

    terms = format_parts(inputs.rollout.responses, inputs.tokenizer, inputs.options.weight)
    return ShapingOutput(sum(terms.values()), terms)  # type: ignore[arg-type]


def config_problems(reward: RewardConfig, rollout: RolloutConfig) -> list[ConfigProblem]:
    """The format reward scores tool calls: without tools it would add nothing (the part's check,
    with the ``reward`` and ``rollout`` sections)."""
    if rollout.multi_turn.enabled:
        return []
    return [ConfigProblem(KEY, reward.shaping.get("tool_format"), "has no effect: multi-turn is off "
                          "(rollout.multi_turn.tools is empty), so no response holds a tool call",
                          f"name a tool in rollout.multi_turn.tools (e.g. [calculator]) or set {KEY}=null",
                          keys=(KEY, "rollout.multi_turn.tools"))]


def format_parts(responses: Sequence[Response], tokenizer: Any, weight: float) -> dict[str, torch.Tensor]:
    """Each part of the format reward per response (module docstring).

    Args:
        responses: the ``N`` responses of a rollout.
        tokenizer: the policy's tokenizer (decodes each response's last turn, special tokens skipped).
        weight: ``reward.shaping.tool_format.weight`` (``w``), > 0.

    Returns:
        ``<term>`` -> Shape [N], float32: ``w/2`` or 0 for ``call`` and ``answer_used``,
        ``-w`` or 0 for ``malformed``.
    """
    last = [r.policy_segments()[-1] if r.trajectory is not None and r.policy_segments() else () for r in responses]
    texts = tokenizer.batch_decode([list(ids) for ids in last], skip_special_tokens=True)
    rows = [_parts(r.trajectory, text, weight) for r, text in zip(responses, texts)]
    return {name: torch.tensor([row[k] for row in rows], dtype=torch.float32) for k, name in enumerate(PARTS)}


def _parts(t: Trajectory | None, last_text: str, weight: float) -> tuple[float, float, float]:
    if t is None:
        return 0.0, 0.0, 0.0
    answers = [a.strip() for a in t.tool_answers if a.strip()]
    call = weight / 2 if t.num_tool_calls > t.num_malformed_calls else 0.0
    used = weight / 2 if t.ended_by == "answer" and any(a in last_text for a in answers) else 0.0
    return call, used, -weight if t.num_malformed_calls else 0.0
