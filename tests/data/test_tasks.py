"""task:arithmetic: deterministic, correct answers, operators respected, validation apart from training."""

from __future__ import annotations

import re

import pytest

from packrl.config.schema import ArithmeticConfig, DataConfig
from packrl.data import VAL_SEED_OFFSET, arithmetic_rows, load_rows

_QUESTION = re.compile(r"What is ([0-9+\-* ]+)\?")


def _check_row(row: dict) -> int:
    """Evaluate the question independently; every step of the worked solution must agree."""
    expression = _QUESTION.fullmatch(row["question"]).group(1)
    value = eval(expression)  # digits, + - * and spaces only (checked by the regex)
    worked, final = row["answer"].split("\n#### ")
    assert int(final) == value
    steps = worked.split(" = ")
    assert steps[0] == expression
    assert all(eval(step) == value for step in steps), worked
    return value


@pytest.mark.parametrize(
    "digits, num_operands, operators",
    [(1, 2, "+"), (1, 3, "+-*"), (2, 4, "-*"), (3, 2, "*"), (1, 1, "+"), (2, 5, "+-")],
)
def test_every_answer_is_correct(digits, num_operands, operators):
    rows = arithmetic_rows(300, digits, num_operands, operators, seed=7)
    assert len(rows) == 300
    for row in rows:
        assert set(row) == {"question", "answer"}
        _check_row(row)
        used = set(re.findall(r" ([+\-*]) ", row["question"]))
        assert used <= set(operators)
        operands = [int(x) for x in re.findall(r"\d+", row["question"])]
        assert len(operands) == num_operands and all(0 <= x < 10**digits for x in operands)


def test_deterministic_for_a_seed():
    assert arithmetic_rows(50, 2, 3, "+-*", seed=3) == arithmetic_rows(50, 2, 3, "+-*", seed=3)
    assert arithmetic_rows(50, 2, 3, "+-*", seed=3) != arithmetic_rows(50, 2, 3, "+-*", seed=4)


def test_subtraction_gives_negative_integer_answers():
    values = [_check_row(r) for r in arithmetic_rows(200, 1, 2, "-", seed=0)]
    assert min(values) < 0 and max(values) > 0
    assert any(r["answer"].endswith("#### -" + str(-v)) for r, v in zip(arithmetic_rows(200, 1, 2, "-", seed=0), values) if v < 0)


def test_worked_solution_follows_precedence():
    rows = arithmetic_rows(500, 1, 3, "+*", seed=1)
    row = next(r for r in rows if re.fullmatch(r"What is \d \+ \d \* \d\?", r["question"]))
    a, b, c = map(int, re.findall(r"\d", row["question"]))
    assert row["answer"] == f"{a} + {b} * {c} = {a} + {b * c} = {a + b * c}\n#### {a + b * c}"


def test_rows_are_distinct_while_the_space_allows():
    rows = arithmetic_rows(500, 2, 2, "+", seed=0)  # 10,000 problems
    assert len({r["question"] for r in rows}) == 500
    small = arithmetic_rows(150, 1, 2, "+", seed=0)  # only 100 problems: every one, then repeats
    assert len(small) == 150 and len({r["question"] for r in small}) == 100


def test_exclude_is_respected():
    train = arithmetic_rows(100, 2, 2, "+", seed=0)
    other = arithmetic_rows(100, 2, 2, "+", seed=1, exclude=[r["question"] for r in train])
    assert not {r["question"] for r in train} & {r["question"] for r in other}


def test_validation_split_uses_its_own_seed_and_no_training_row():
    cfg = ArithmeticConfig(num_rows=300, digits=2, num_operands=2, operators="+-")
    train = load_rows("task:arithmetic", data=DataConfig(arithmetic=cfg), seed=5, split="train")
    val = load_rows("task:arithmetic", data=DataConfig(arithmetic=cfg), seed=5, split="val")
    assert train == arithmetic_rows(300, 2, 2, "+-", seed=5)
    assert len(val) == 300
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    exclude = [r["question"] for r in train]
    assert val == arithmetic_rows(300, 2, 2, "+-", seed=5 + VAL_SEED_OFFSET, exclude=exclude)


def test_validation_of_a_tiny_space_keeps_each_question_once():
    cfg = ArithmeticConfig(num_rows=2000, digits=1, num_operands=2, operators="+")  # the default: 100 problems
    val = load_rows("task:arithmetic", data=DataConfig(arithmetic=cfg), seed=0, split="val")
    assert len(val) == len({r["question"] for r in val}) <= 100


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_rows=0), "data.arithmetic.num_rows"),
        (dict(digits=0), "data.arithmetic.digits"),
        (dict(num_operands=-1), "data.arithmetic.num_operands"),
        (dict(operators="/"), "data.arithmetic.operators"),
        (dict(operators=""), "data.arithmetic.operators"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = dict(num_rows=5, digits=1, num_operands=2, operators="+", seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        arithmetic_rows(**args)
