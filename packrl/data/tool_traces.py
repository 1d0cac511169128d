"""``task:tool_traces`` (registered in `packrl.registry.TASKS`): SFT traces of `task:arithmetic`
problems answered with one call of the ``calculator`` tool, as ``packrl data tool-traces`` writes
them.

Each trace is the RL prompt of a training question (``data.system_prompt``, the question and
``data.instruction``, as `packrl.data.examples.to_example` builds it for ``packrl train``), the
assistant's call with the problem's expression, the tool's exact answer and the final answer after
``####``. `packrl.data.traces.render_traces` renders them as it renders every trace, tool messages
as a multi-turn rollout appends them.
"""

from __future__ import annotations

import json
from typing import Any

from packrl.config.schema import DataConfig
from packrl.data.examples import to_example
from packrl.data.task_sources import TaskRequest
from packrl.data.tasks import arithmetic_rows, num_arithmetic_problems, split_rows
from packrl.registry import TASKS, TOOLS


def tool_trace_rows(data: DataConfig, num_rows: int, seed: int) -> list[dict[str, Any]]:
    """``num_rows`` (``sft.num_rows``) calculator traces of `task:arithmetic` problems
    (``data.arithmetic``, ``seed`` = ``train.seed``; never a validation question): the request as
    RL's prompts hold it (``data.system_prompt``, ``data.instruction``), one call with the
    problem's expression, the registered ``calculator``'s exact answer, and the final answer after
    ``####``. Each row: ``{"messages": [...]}``.

    Raises:
        ValueError: more rows than ``data.arithmetic`` has distinct problems.
    """
    calculator = TOOLS.lookup("calculator")
    arith = data.arithmetic
    args = (arith.digits, arith.num_operands, arith.operators)
    space = num_arithmetic_problems(*args)
    if num_rows > space:
        raise ValueError(f"sft.num_rows={num_rows:,} is more than the {space:,} distinct problems of data.arithmetic "
                         f"(digits={arith.digits}, num_operands={arith.num_operands}, operators={arith.operators!r}): every "
                         "trace past them repeats one; lower sft.num_rows or raise data.arithmetic.digits")
    val = [r["question"] for r in split_rows(arith, seed, "val")]
    out = []
    for k, row in enumerate(arithmetic_rows(num_rows, *args, seed, exclude=val)):
        example = to_example(row, row=k, instruction=data.instruction, system_prompt=data.system_prompt)
        assert not isinstance(example, str), "task:arithmetic rows are well-formed"
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        answer = calculator({"expression": expression})
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        out.append({"messages": [*example.chat, {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                                 {"role": "tool", "content": answer},
                                 {"role": "assistant", "content": f"{expression} = {answer}\n#### {answer}"}]})
    return out


@TASKS.register("tool_traces")
def tool_traces_task(request: TaskRequest) -> list[dict[str, Any]]:
    """``task:tool_traces``: `tool_trace_rows` of the request's ``data`` section, ``sft.num_rows`` and seed."""
    assert request.sft is not None, "a task that makes traces is read with the sft section"
    return tool_trace_rows(request.data, request.sft.num_rows, request.seed)
