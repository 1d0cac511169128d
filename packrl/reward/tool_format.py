"""The tool-call format reward (``reward.format_weight``): shaping that rewards calling the run's
tools well, added to the task reward of multi-turn responses.

A policy that never writes a call gives GRPO nothing to reinforce; a small reward for the call's
form makes the first calls worth repeating (the format rewards of DeepSeek-R1, arXiv 2501.12948,
section 2.2.2, and of verl's and prime-rl's multi-turn recipes, where users add one to the task
reward). With weight ``w``, a response's format reward is the sum of three parts, each reported as
its own metric (``reward/format/<part>``, mean over the batch):

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

from collections.abc import Sequence
from typing import Any

import torch

from packrl.types import Response, Trajectory

PARTS = ("call", "answer_used", "malformed")
"""The format reward's parts; metric ``reward/format/<part>``."""


def format_parts(responses: Sequence[Response], tokenizer: Any, weight: float) -> dict[str, torch.Tensor]:
    """Each part of the format reward per response (module docstring).

    Args:
        responses: the ``N`` responses of a rollout.
        tokenizer: the policy's tokenizer (decodes each response's last turn, special tokens skipped).
        weight: ``reward.format_weight`` (``w``), >= 0.

    Returns:
        ``format/<part>`` -> Shape [N], float32: ``w/2`` or 0 for ``call`` and ``answer_used``,
        ``-w`` or 0 for ``malformed``.
    """
    last = [r.policy_segments()[-1] if r.trajectory is not None and r.policy_segments() else () for r in responses]
    texts = tokenizer.batch_decode([list(ids) for ids in last], skip_special_tokens=True)
    rows = [_parts(r.trajectory, text, weight) for r, text in zip(responses, texts)]
    return {f"format/{name}": torch.tensor([row[k] for row in rows], dtype=torch.float32) for k, name in enumerate(PARTS)}


def _parts(t: Trajectory | None, last_text: str, weight: float) -> tuple[float, float, float]:
    if t is None:
        return 0.0, 0.0, 0.0
    answers = [a.strip() for a in t.tool_answers if a.strip()]
    call = weight / 2 if t.num_tool_calls > t.num_malformed_calls else 0.0
    used = weight / 2 if t.ended_by == "answer" and any(a in last_text for a in answers) else 0.0
    return call, used, -weight if t.num_malformed_calls else 0.0
