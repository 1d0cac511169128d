"""The `task:char_count` reward (`reward.name=char_count`): the worked lines, not only the count.

A `task:char_count` row states its reference worked answer as its ground truth (one line per
letter of the word, ``"r - yes (1)"``, then ``#### N``; `packrl.data.char_count`). The `gsm8k`
reward reads only the final ``#### N``, so a bare ``#### 1`` is right whenever the count is 1 and
a length objective can be met by guessing. This reward reads a response in one of two ways
(``reward.char_count.reading``):

- ``strict`` (default): right only when the response's worked lines (lines of the form
  ``<letter> - yes|no (<count>)``) are exactly the reference's, in order, each with the right
  verdict and running count, and its last ``#### N`` is the right count. Other lines (restatements,
  fillers, an opening or closing sentence) may stay; a missing, extra, repeated or wrong worked
  line fails. The shortest right response is then the concise worked answer, and a length
  objective can only remove redundancy.
- ``lenient``: the last ``#### N`` alone, as `gsm8k` reads it.

    response                                        strict   lenient   (reference: "b - no (0)\\nr - yes (1)\\n#### 1")
    "b - no (0)\\nr - yes (1)\\n#### 1"              1.0      1.0
    "b - no (0)\\nb is not r.\\nr - yes (1)\\n#### 1" 1.0      1.0       (a restatement may stay)
    "#### 1"                                        0.0*     1.0       (* format_score: a count, no lines)
    "r - yes (1)\\n#### 1"                           0.0*     1.0       (a line missing)

A right response scores 1.0; one with a final count that is not right under the reading scores
``reward.format_score``; one without a final ``#### N`` scores 0.0. ``correct_score`` is 1.0.
"""

from __future__ import annotations

import re

from packrl.config.schema import RewardConfig
from packrl.reward.registry import register_reward

WORKED_LINE = re.compile(r"^\s*([a-z]) - (yes|no) \((\d+)\)\s*$", re.MULTILINE)
"""A worked line, ``"r - yes (1)"``: the letter, the verdict and the running count."""
_FINAL = re.compile(r"####\s*(-?\d+)")


def worked_lines(text: str) -> list[tuple[str, str, int]]:
    """The worked lines of ``text`` in order, each ``(letter, "yes" | "no", running count)``."""
    return [(letter, verdict, int(count)) for letter, verdict, count in WORKED_LINE.findall(text)]


def final_count(text: str) -> str | None:
    """The number after the last ``####`` of ``text``, or None."""
    found = _FINAL.findall(text)
    return found[-1] if found else None


def ground_truth_problem(ground_truth: str) -> str | None:
    """Why ``ground_truth`` is not a reference worked answer this reward can read, or None: it
    needs at least one worked line and a final ``#### N`` that equals the last line's count."""
    lines, count = worked_lines(ground_truth), final_count(ground_truth)
    if not lines or count is None:
        return (f"ground truth {ground_truth[:60]!r} is not a worked answer (one '<letter> - yes|no (<count>)' line per "
                "letter, then '#### N'), which task:char_count rows state in reward_model.ground_truth")
    if int(count) != lines[-1][2]:
        return f"ground truth {ground_truth[:60]!r} ends in #### {count}, not its last line's count {lines[-1][2]}"
    return None


def reads_right(response_text: str, ground_truth: str, reading: str) -> bool:
    """Whether ``response_text`` is right under ``reading`` (``strict`` or ``lenient``, module
    docstring) against the reference worked answer ``ground_truth`` (`ground_truth_problem` is None)."""
    reference, answer = worked_lines(ground_truth), final_count(response_text)
    if not reference or answer is None or int(answer) != reference[-1][2]:
        return False
    return reading == "lenient" or worked_lines(response_text) == reference


@register_reward("char_count", correct_score=1.0, ground_truth_problem=ground_truth_problem)
def char_count_reward(response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
    """1.0 for a right response under ``reward.char_count.reading``, ``reward.format_score`` for one
    with a final count that is not right, 0.0 for one without a final ``#### N`` (module docstring).
    ``data_source`` is not used."""
    if final_count(response_text) is None:
        return 0.0
    return 1.0 if reads_right(response_text, ground_truth, cfg.char_count.reading) else float(cfg.format_score)
