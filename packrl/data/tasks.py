"""The built-in task `task:arithmetic` (registered in `packrl.registry.TASKS`; no download).

A row is a GSM8K-format dict ``{"question": str, "answer": str}``: the question is a plain
expression (``"What is 3 + 4 * 2?"``), the answer a one-line worked solution that applies one
operation per step with the usual precedence (``*`` before ``+``/``-``, then left to right),
ending in ``#### <integer>``::

    question                      answer
    "What is 3 + 5?"              "3 + 5 = 8\\n#### 8"
    "What is 3 + 4 * 2?"          "3 + 4 * 2 = 3 + 8 = 11\\n#### 11"
    "What is 2 - 9?"              "2 - 9 = -7\\n#### -7"

Plain expressions rather than word problems keep the task easy for a small (135M) instruct
model and the prompt short: 53 tokens with SmolLM2's chat template and the default instruction.

Rows are drawn from ``random.Random(seed)``, distinct while the space of problems allows. The
validation split uses ``seed + VAL_SEED_OFFSET`` and excludes every training question, so the
two splits share no row unless the space is too small to hold both (then a warning is logged).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection

from packrl.config.tasks import VAL_SEED_OFFSET, ArithmeticConfig
from packrl.data.task_sources import TaskRequest
from packrl.registry import TASKS

logger = logging.getLogger("packrl.data")

__all__ = ["VAL_SEED_OFFSET", "arithmetic_rows", "arithmetic_task", "num_arithmetic_problems", "split_rows"]

_OPERATORS = "+-*"
_DRAWS_PER_ROW = 20  # rejection-sampling cap: a space too small to fill the rows stops after this many draws per row


def _solve(operands: list[int], ops: list[str]) -> tuple[int, str]:
    """The value of the expression and its worked solution, one operation per step."""
    nums, rest = list(operands), list(ops)
    steps = [_render(nums, rest)]
    while rest:
        i = rest.index("*") if "*" in rest else 0
        a, b, op = nums[i], nums[i + 1], rest[i]
        nums[i : i + 2] = [a * b if op == "*" else a + b if op == "+" else a - b]
        del rest[i]
        steps.append(_render(nums, rest))
    return nums[0], " = ".join(steps)


def _render(nums: list[int], ops: list[str]) -> str:
    parts = [str(nums[0])]
    for op, n in zip(ops, nums[1:]):
        parts.append(f"{op} {n}")
    return " ".join(parts)


def _draw(rng: random.Random, high: int, num_operands: int, ops: list[str]) -> dict[str, str]:
    operands = [rng.randrange(high) for _ in range(num_operands)]
    chosen = [rng.choice(ops) for _ in range(num_operands - 1)]
    value, worked = _solve(operands, chosen)
    return {"question": f"What is {_render(operands, chosen)}?", "answer": f"{worked}\n#### {value}"}


def num_arithmetic_problems(digits: int, num_operands: int, operators: str) -> int:
    """How many distinct questions `_draw` can make: every operand in ``0 .. 10**digits - 1`` and
    every operator between them."""
    return (10**digits) ** num_operands * len(set(operators)) ** (num_operands - 1)


def _check_args(num_rows: int, digits: int, num_operands: int, operators: str) -> None:
    for name, value in (("num_rows", num_rows), ("digits", digits), ("num_operands", num_operands)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"data.arithmetic.{name}={value!r} must be a positive integer; set data.arithmetic.{name}=1 or more")
    bad = sorted(set(operators) - set(_OPERATORS))
    if not operators or bad:
        raise ValueError(
            f"data.arithmetic.operators={operators!r} must be a non-empty string of + - * (unknown: {bad}); "
            "set data.arithmetic.operators=+-"
        )


def arithmetic_rows(
    num_rows: int,
    digits: int,
    num_operands: int,
    operators: str,
    seed: int,
    *,
    exclude: Collection[str] = (),
) -> list[dict[str, str]]:
    """Generate `task:arithmetic` rows in GSM8K format.

    Args:
        num_rows: rows to return.
        digits: digits per operand; operands are drawn uniformly from ``0 .. 10**digits - 1``.
        num_operands: operands per problem (1 gives ``"What is 7?"``).
        operators: operators to draw from, a string over ``+-*``; results may be negative.
        seed: seeds the draw; the same arguments always give the same rows.
        exclude: questions not to generate while other questions remain (the validation split
            passes the training questions).

    Returns:
        ``num_rows`` dicts ``{"question": str, "answer": str}``; the answer ends in ``#### <int>``.
        Rows are distinct while the space of problems allows; a smaller space repeats rows.

    Raises:
        ValueError: a non-positive count or an operator outside ``+-*``.
    """
    _check_args(num_rows, digits, num_operands, operators)
    rng = random.Random(seed)
    ops = list(dict.fromkeys(operators))  # dedupe, keep the given order so the draw is stable
    high = 10**digits
    excluded = set(exclude)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    for _ in range(_DRAWS_PER_ROW * num_rows + 1000):
        if len(rows) == num_rows:
            return rows
        row = _draw(rng, high, num_operands, ops)
        if row["question"] not in seen and row["question"] not in excluded:
            seen.add(row["question"])
            rows.append(row)
    return _fill(rows, num_rows, rng, lambda: _draw(rng, high, num_operands, ops))


def _fill(rows: list[dict[str, str]], num_rows: int, rng: random.Random, draw) -> list[dict[str, str]]:
    """Complete ``rows`` with repeats when the space of problems ran out of fresh questions."""
    distinct = list(rows)
    if distinct:
        logger.info(
            "task:arithmetic has only %d distinct problems left for these settings; %d rows repeat "
            "(raise data.arithmetic.digits or data.arithmetic.num_operands for more)", len(distinct), num_rows - len(distinct),
        )
        rows.extend(dict(rng.choice(distinct)) for _ in range(num_rows - len(distinct)))
    else:
        logger.warning(
            "task:arithmetic: every problem of these settings is excluded (the training split holds them all), "
            "so these rows repeat training rows; raise data.arithmetic.digits or data.arithmetic.num_operands"
        )
        rows.extend(draw() for _ in range(num_rows))
    return rows


def split_rows(cfg: ArithmeticConfig, seed: int, split: str, key: str = "data.val_files") -> list[dict[str, str]]:
    """The ``data.arithmetic.num_rows`` rows of ``split``: ``train`` from ``seed``; ``val`` from
    ``seed + VAL_SEED_OFFSET`` without any training question, each question once (``key`` names the
    source in the log line that says how many were kept).

    Raises:
        ValueError: ``cfg`` fails `arithmetic_rows`' checks.
    """
    args = (cfg.num_rows, cfg.digits, cfg.num_operands, cfg.operators)
    if split == "train":
        return arithmetic_rows(*args, seed)
    train_questions = [r["question"] for r in arithmetic_rows(*args, seed)]
    rows = arithmetic_rows(*args, seed + VAL_SEED_OFFSET, exclude=train_questions)
    # a repeated validation row adds cost, not information: keep each question once
    distinct = list({r["question"]: r for r in rows}.values())
    if len(distinct) < len(rows):
        logger.info("%s: task:arithmetic validation keeps %d distinct of %d rows", key, len(distinct), len(rows))
    return distinct


@TASKS.register("arithmetic")
def arithmetic_task(request: TaskRequest) -> list[dict[str, str]]:
    """``task:arithmetic``: `split_rows` of ``data.arithmetic`` (``request.options``) for the request's split and seed."""
    return split_rows(request.options, request.seed, request.split, request.key)
