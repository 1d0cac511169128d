"""The char_count reward: the strict reading needs every worked line of the reference in order and
the right count (other lines may stay), the lenient one the count alone; the ground-truth check
stops a run on data without reference worked answers before the model loads."""

from __future__ import annotations

import pytest

from packrl.config import load_config
from packrl.config.schema import CharCountConfig, CharCountRewardConfig, RewardConfig
from packrl.data.char_count import char_count_rows, parse_question, worked_answer
from packrl.data.dataset import PromptDataset
from packrl.reward import char_count_reward, gsm8k_reward
from packrl.reward.char_count import ground_truth_problem, reads_right
from packrl.reward.registry import reward_info
from packrl.reward.score import check_ground_truths

REFERENCE = "b - no (0)\nr - yes (1)\nr - yes (2)\n#### 2"
STRICT, LENIENT = RewardConfig(name="char_count", format_score=0.1), RewardConfig(
    name="char_count", format_score=0.1, char_count=CharCountRewardConfig(reading="lenient"))


@pytest.mark.parametrize(("response", "strict", "lenient"), [
    (REFERENCE, 1.0, 1.0),
    ("I will check each letter.\nb - no (0)\nb is not r; still 0.\nr - yes (1)\nFine.\n  r - yes (2)  \nSo twice.\n#### 2", 1.0, 1.0),
    ("#### 2", 0.1, 1.0),  # a bare count: no worked lines
    ("b - no (0)\nr - yes (2)\n#### 2", 0.1, 1.0),  # a line missing
    ("b - no (0)\nr - yes (1)\nr - yes (1)\n#### 2", 0.1, 1.0),  # a wrong running count
    ("r - yes (1)\nb - no (0)\nr - yes (2)\n#### 2", 0.1, 1.0),  # out of order
    ("b - no (0)\nr - yes (1)\nr - yes (2)\nr - yes (2)\n#### 2", 0.1, 1.0),  # a worked line repeated
    ("b - no (0)\nr - yes (1)\nr - yes (2)\n#### 3", 0.1, 0.1),  # every line right, the count wrong
    ("b - no (0)\nr - yes (1)\nr - yes (2)\n", 0.0, 0.0),  # no final count
    ("", 0.0, 0.0),
])
def test_the_two_readings(response, strict, lenient):
    assert char_count_reward(response, REFERENCE, data_source="x", cfg=STRICT) == strict
    assert char_count_reward(response, REFERENCE, data_source="x", cfg=LENIENT) == lenient
    assert reward_info("char_count").correct_score == 1.0


def test_every_style_of_every_row_reads_right_and_a_dropped_line_fails():
    for row in char_count_rows(300, CharCountConfig(min_letters=5, max_letters=12), seed=9):
        truth = row["reward_model"]["ground_truth"]
        assert ground_truth_problem(truth) is None
        word, letter = parse_question(row["question"])
        for style in ("concise", "verbose", "thinking"):
            text = worked_answer(word, letter, style)
            assert reads_right(text, truth, "strict") and reads_right(text, truth, "lenient")
            assert gsm8k_reward(text, truth, data_source="x", cfg=RewardConfig()) == 1.0  # gsm8k reads the final count
            lines = text.split("\n")
            first = next(k for k, line in enumerate(lines) if " - " in line)
            assert not reads_right("\n".join(lines[:first] + lines[first + 1:]), truth, "strict")


@pytest.mark.parametrize(("truth", "message"), [
    ("72", "is not a worked answer"),
    ("a - yes (1)\n#### 2", "ends in #### 2, not its last line's count 1"),
])
def test_a_ground_truth_that_is_not_a_worked_answer_is_named(truth, message):
    assert message in ground_truth_problem(truth)


def test_a_run_on_data_without_worked_answers_is_refused_before_the_model_loads(tmp_path, smollm_tokenizer):
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"question": "What is 2 + {k}?", "answer": "#### {k + 2}"}}\n' for k in range(8)))
    cfg = load_config("char_count", [f"data.train_files=[{tmp_path / 'rows.jsonl'}]"])
    train = PromptDataset.build(cfg.data.train_files, smollm_tokenizer, cfg.data, seed=0, split="train", key="data.train_files")
    with pytest.raises(ValueError, match=r"reward.name='char_count' cannot read the ground truth of 8 of 8 rows of data.train_files"):
        check_ground_truths(cfg.reward, train, "data.train_files")
    check_ground_truths(RewardConfig(), train, "data.train_files")  # gsm8k reads any ground truth
    val = PromptDataset.build(["task:char_count"], smollm_tokenizer, cfg.data, seed=0, split="val", key="data.val_files")
    check_ground_truths(cfg.reward, val, "data.val_files")


def test_a_gsm8k_row_may_state_its_ground_truth_and_a_malformed_one_is_a_bad_row():
    from packrl.data.examples import to_example

    row = {"question": "q?", "answer": "#### 1", "reward_model": {"ground_truth": "a - yes (1)\n#### 1"}}
    assert to_example(row, row=0, instruction="", system_prompt=None).ground_truth == "a - yes (1)\n#### 1"
    assert "must be a non-empty string" in to_example({**row, "reward_model": {"ground_truth": 3}}, row=0, instruction="",
                                                      system_prompt=None)
