"""GSM8K rule reward: the extraction and score table of `packrl.reward.gsm8k`."""

from __future__ import annotations

import pytest

from packrl.config.schema import RewardConfig
from packrl.reward import SOLUTION_CLIP_CHARS, answers_match, extract_answer, gsm8k_reward

STRICT = RewardConfig(extraction="strict")
FLEXIBLE = RewardConfig(extraction="flexible")


@pytest.mark.parametrize(
    "response, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("#### 1,234", "1234", "1234"),
        ("#### $18", "18", "18"),
        ("####$ 18.50", "18.50", "18.50"),
        ("it costs $1,000,000 in total", None, "1000000"),
        ("#### -5", "-5", "-5"),
        ("2 - 9 = -7 so\n####-7.", "-7", "-7"),
        ("#### 3 then I changed my mind #### 4 and 9", "4", "9"),
        ("The answer is 18.", None, "18"),
        ("no number at all.", None, None),
        ("#### no number", None, None),
        ("... .", None, None),
        ("#### .5", ".5", ".5"),
    ],
)
def test_extraction(response, strict, flexible):
    assert extract_answer(response, "strict") == strict
    assert extract_answer(response, "flexible") == flexible


@pytest.mark.parametrize(
    "answer, truth, equal",
    [("18", "18", True), ("18.0", "18", True), ("18.", "18", True), ("1,000", "1000", True), ("$5", "5", True),
     ("-3", "-3.00", True), (".5", "0.5", True), ("17", "18", False), ("-18", "18", False), ("x", "x", True), ("x", "18", False)],
)
def test_numeric_comparison(answer, truth, equal):
    assert answers_match(answer, truth) is equal


@pytest.mark.parametrize(
    "response, truth, cfg, score",
    [
        ("so 18 eggs. #### 18", "18", STRICT, 1.0),
        ("#### 18.0", "18", STRICT, 1.0),  # verl's string equality would give format_score
        ("#### 1,018", "1018", STRICT, 1.0),
        ("#### -4", "-4", STRICT, 1.0),
        ("#### 17", "18", STRICT, 0.0),
        ("#### 17", "18", RewardConfig(format_score=0.1), 0.1),
        ("the answer is 18", "18", STRICT, 0.0),
        ("the answer is 18", "18", FLEXIBLE, 1.0),
        ("the answer is 17", "18", RewardConfig(extraction="flexible", format_score=0.2), 0.2),
        ("no answer", "18", RewardConfig(format_score=0.5), 0.0),
        ("", "18", FLEXIBLE, 0.0),
    ],
)
def test_score(response, truth, cfg, score):
    assert gsm8k_reward(response, truth, data_source="openai/gsm8k", cfg=cfg) == score


def test_only_the_last_300_characters_are_searched():
    padding = "x" * SOLUTION_CLIP_CHARS
    early = "#### 18\n" + padding
    assert gsm8k_reward(early, "18", data_source="openai/gsm8k", cfg=STRICT) == 0.0
    assert gsm8k_reward(early, "18", data_source="openai/gsm8k", cfg=FLEXIBLE) == 0.0
    late = padding + "\n#### 18"
    assert gsm8k_reward(late, "18", data_source="openai/gsm8k", cfg=STRICT) == 1.0


def test_unknown_extraction():
    with pytest.raises(ValueError, match="reward.extraction='loose'"):
        extract_answer("#### 1", "loose")
