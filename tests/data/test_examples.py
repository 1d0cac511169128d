"""to_example: the two row schemas, ground-truth cleaning, and a specific reason for each bad row."""

from __future__ import annotations

import numpy as np
import pytest

from packrl.data import ARITHMETIC_SOURCE, BadRow, Example, clean_number, to_example

INSTR = "Answer after ####."


def _ex(raw, system=None, source="openai/gsm8k"):
    return to_example(raw, row=3, instruction=INSTR, system_prompt=system, data_source=source)


def _verl(**over):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 1 + 1? Think."}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 9},
    }
    row.update(over)
    return row


@pytest.mark.parametrize(
    "text, expected",
    [(" 72 ", "72"), ("1,234", "1234"), ("$-3.50", "-3.50"), ("$ 5", "5"), (".5", ".5"), ("72 apples", None), ("", None), ("inf", None),
     ("1e999", None), ("1e3", "1e3")],
)
def test_clean_number(text, expected):
    assert clean_number(text) == expected


def test_gsm8k_row():
    ex = _ex({"question": "How many?", "answer": "3 + 4 = 7\n#### 1,007"})
    assert ex == Example(chat=[{"role": "user", "content": f"How many? {INSTR}"}], ground_truth="1007", data_source="openai/gsm8k", row=3)


def test_gsm8k_row_with_system_prompt_and_task_source():
    ex = _ex({"question": "What is 2 - 5?", "answer": "2 - 5 = -3\n#### -3"}, system="Be brief.", source=ARITHMETIC_SOURCE)
    assert ex.chat == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is 2 - 5? {INSTR}"}]
    assert (ex.ground_truth, ex.data_source) == ("-3", ARITHMETIC_SOURCE)


def test_gsm8k_takes_the_text_after_the_last_marker_and_its_own_data_source():
    ex = _ex({"question": "q", "answer": "#### 5 then #### $12", "data_source": "mine"})
    assert (ex.ground_truth, ex.data_source) == ("12", "mine")


def test_verl_row_is_read_as_is():
    ex = _ex(_verl(), system="Be brief.")
    assert ex.chat == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1? Think."}]
    assert (ex.ground_truth, ex.data_source, ex.extra_info) == ("2", "openai/gsm8k", {"index": 9})


def test_verl_row_keeps_its_own_system_message_and_gets_no_instruction():
    chat = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Q?"}]
    assert _ex(_verl(prompt=chat), system="Other.").chat == chat


def test_verl_prompt_as_numpy_array_with_null_struct_fields():
    prompt = np.array([{"role": "user", "content": "Q?", "tool_calls": None}], dtype=object)
    ex = _ex(_verl(prompt=prompt, reward_model={"ground_truth": 7}))
    assert ex.chat == [{"role": "user", "content": "Q?"}]
    assert ex.ground_truth == "7"


def test_verl_ground_truth_may_be_text():
    assert _ex(_verl(reward_model={"ground_truth": "\\frac{1}{2}"})).ground_truth == "\\frac{1}{2}"


@pytest.mark.parametrize(
    "raw, reason",
    [
        (BadRow("line 4: invalid JSON (x)"), "line 4: invalid JSON (x)"),
        ([1, 2], "row is of type list, not an object"),
        ("text", "row is of type str, not an object"),
        ({"foo": 1}, "neither GSM8K fields (question, answer) nor verl fields (prompt, reward_model); fields: foo"),
        ({"question": "q"}, "missing field 'answer'"),
        ({"answer": "#### 1"}, "missing field 'question'"),
        ({"question": 5, "answer": "#### 1"}, "field 'question' is of type int, expected a string"),
        ({"question": "q", "answer": 7}, "field 'answer' is of type int, expected a string"),
        ({"question": "  ", "answer": "#### 1"}, "empty question"),
        ({"question": "q", "answer": "#### seven"}, "non-numeric answer: 'seven'"),
        ({"question": "q", "answer": "no marker here"}, "non-numeric answer: 'no marker here'"),
        ({"reward_model": {"ground_truth": "1"}}, "missing field 'prompt' (verl schema)"),
        (_verl(prompt="Q?"), "field 'prompt' is of type str, expected a list of chat messages"),
        (_verl(prompt=[]), "field 'prompt' is an empty list"),
        (_verl(prompt=["Q?"]), "prompt[0] is of type str, expected a message object"),
        (_verl(prompt=[{"role": "user"}]), "prompt[0].content is missing, expected a string"),
        (_verl(prompt=[{"role": "user", "content": ["a"]}]), "prompt[0].content[0] is str, expected a part {type: text | image}"),
        (_verl(prompt=[{"role": "user", "content": [{"type": "video"}]}]),
         "prompt[0].content[0] has type 'video'; packrl reads text and image parts"),
        (_verl(reward_model=None), "missing field 'reward_model'"),
        (_verl(reward_model="2"), "field 'reward_model' is of type str, expected an object"),
        (_verl(reward_model={"style": "rule"}), "field 'reward_model.ground_truth' is missing"),
        (_verl(reward_model={"ground_truth": ["2"]}), "field 'reward_model.ground_truth' is of type list, expected a string or number"),
        (_verl(reward_model={"ground_truth": " "}), "empty field 'reward_model.ground_truth'"),
        (_verl(data_source=None), "missing field 'data_source'"),
        (_verl(data_source=3), "field 'data_source' is 3, expected a non-empty string"),
    ],
)
def test_bad_rows_have_a_specific_reason(raw, reason):
    assert _ex(raw) == reason


def test_lone_surrogates_and_non_finite_truths_are_rejected():
    assert _ex({"question": "lone \ud800", "answer": "#### 1"}) == "field 'question' is not valid Unicode (lone surrogate at character 5)"
    assert _ex({"question": "q", "answer": "#### 1e999"}) == "non-numeric answer: '1e999'"
    message = [{"role": "user", "content": "x\udc00"}]
    assert _ex(_verl(prompt=message)) == "prompt[0].content is not valid Unicode (lone surrogate at character 1)"
    for truth in (float("nan"), float("inf")):
        assert _ex(_verl(reward_model={"ground_truth": truth})).endswith("not a finite number")
