"""GSM8K rule reward (`reward.name=gsm8k`), verl's semantics with numeric comparison.

As verl's ``gsm8k.compute_score``: only the last 300 characters of the response are searched
(an answer earlier in a long response scores 0); `strict` takes the last ``#### <number>``,
`flexible` the last number anywhere; ``,`` and ``$`` are removed. No answer scores 0.0, a
correct one 1.0, a found but wrong one ``reward.format_score``.

One difference: verl compares strings, so ``"18.0"`` or ``"18."`` is wrong against ``"18"``;
here two numbers are compared as exact decimals (``Fraction``), so they are equal. Text that is
not a number falls back to string equality. A number needs at least one digit, so verl's
exclusion of the matches ``""`` and ``"."`` in `flexible` holds by construction.

    response (last 300 chars)      strict    flexible   score against "18"
    "so 18 eggs. #### 18"          "18"      "18"       1.0
    "#### 18.0"                    "18.0"    "18.0"     1.0 (verl: format_score)
    "#### $1,018"                  "1018"    "1018"     format_score
    "the answer is 18."            None      "18"       strict 0.0, flexible 1.0
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from packrl.config.schema import RewardConfig
from packrl.reward.registry import register_reward

SOLUTION_CLIP_CHARS = 300
"""Only this many trailing characters of a response are searched (verl's `_SOLUTION_CLIP_CHARS`)."""

_NUM = r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUM + ")")
_FLEXIBLE = re.compile(_NUM)


def extract_answer(response_text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer in the last `SOLUTION_CLIP_CHARS` characters of a response, or None.

    Args:
        response_text: decoded response.
        method: ``strict`` (the last ``#### <number>``) or ``flexible`` (the last number).

    Returns:
        The number as text with ``,`` and ``$`` removed (``"-1234.5"``), or None when none is found.

    Raises:
        ValueError: an unknown ``method``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"reward.extraction={method!r} is not one of strict, flexible")
    tail = response_text[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
    else:
        matches = _FLEXIBLE.findall(tail)
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip().replace(",", "").replace("$", ""))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, ground_truth: str) -> bool:
    """True when ``answer`` equals ``ground_truth``: as exact numbers when both are numbers
    (``"18.0" == "18"``, ``"1,000" == "1000"``), else as stripped strings."""
    a, b = _as_number(answer), _as_number(ground_truth)
    if a is not None and b is not None:
        return a == b
    return answer.strip() == ground_truth.strip()


@register_reward("gsm8k", correct_score=1.0)
def gsm8k_reward(response_text: str, ground_truth: str, *, data_source: str, cfg: RewardConfig) -> float:
    """1.0 for the right final answer, ``cfg.format_score`` for a wrong one, 0.0 for none.

    ``cfg.extraction`` picks the method (see `extract_answer`); a ground truth that is a worked
    answer is compared by its final answer (`final_answer`); ``data_source`` is not used.
    """
    answer = extract_answer(response_text, cfg.extraction)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, final_answer(ground_truth)) else float(cfg.format_score)


def final_answer(ground_truth: str) -> str:
    """The final answer of a ground truth: the text after its last ``####`` when it is a worked
    answer in GSM8K's format (``task:char_count`` rows state their reference worked answer), else
    the whole text."""
    return ground_truth.rsplit("####", 1)[-1].strip() if "####" in ground_truth else ground_truth
