"""``task:char_count_traces`` (registered in `packrl.registry.TASKS`): SFT traces of
`task:char_count` in ``sft.trace_style``.

Each trace is the RL prompt of a training question (``data.system_prompt``, the question and
``data.instruction``, as `packrl.data.examples.to_example` builds it for ``packrl train``) and one
assistant turn: the worked answer in the chosen style (`packrl.data.char_count.worked_answer`:
``concise``, ``verbose`` or ``thinking``). `packrl.data.traces.render_traces` renders them as it
renders every trace, so the prompt ids are the ones RL gives that question.
"""

from __future__ import annotations

import random
from typing import Any

from packrl.config.schema import DataConfig
from packrl.config.sft import SftConfig
from packrl.data.char_count import char_count_rows, parse_question, split_rows, worked_answer
from packrl.data.examples import to_example
from packrl.data.task_sources import TaskRequest
from packrl.registry import TASKS


def char_count_trace_rows(data: DataConfig, sft: SftConfig, seed: int) -> list[dict[str, Any]]:
    """``sft.num_rows`` traces of `task:char_count` questions drawn as the training split draws
    them (``data.char_count``, ``seed`` = ``train.seed``; the first ones are the training rows of
    RL) without any validation question, answered in ``sft.trace_style`` (a verbose one writing each
    redundant line with the chance ``sft.redundancy``, drawn with ``seed``).

    Returns:
        One ``{"messages": [system?, user, assistant]}`` per trace.

    Raises:
        ValueError: ``data.char_count`` fails its checks (`char_count_rows`).
    """
    val = [r["question"] for r in split_rows(data.char_count, seed, "val")]
    out, draw = [], random.Random(f"redundancy:{seed}")
    for k, row in enumerate(char_count_rows(sft.num_rows, data.char_count, seed, exclude=val)):
        example = to_example(row, row=k, instruction=data.instruction, system_prompt=data.system_prompt)
        assert not isinstance(example, str), "task:char_count rows are well-formed"
        answer = worked_answer(*parse_question(row["question"]), sft.trace_style, redundancy=sft.redundancy, draw=draw)
        out.append({"messages": [*example.chat, {"role": "assistant", "content": answer}]})
    return out


@TASKS.register("char_count_traces")
def char_count_traces_task(request: TaskRequest) -> list[dict[str, Any]]:
    """``task:char_count_traces``: `char_count_trace_rows` of the request's ``data`` and ``sft`` sections and seed."""
    assert request.sft is not None, "a task that makes traces is read with the sft section"
    return char_count_trace_rows(request.data, request.sft, request.seed)
