"""The ``task:`` sources: rows made by registered tasks (`packrl.registry.TASKS`), not read from a file.

A source ``task:<name>`` names a task: a function ``TaskRequest -> rows`` registered under
``name``, with what it declares about itself (`packrl.config.tasks.TaskInfo`: whether it makes
prompts or SFT traces, where its options are). Its rows are read as a file's rows are: prompts by
`packrl.data.examples.to_example` (GSM8K's ``question``/``answer`` or verl's schema; a row without
its own ``data_source`` gets ``packrl/<name>``), traces by `packrl.data.traces.render_traces`
(rows of ``messages``), each row in the accounting. The built-in tasks:

    task                 makes     options           module
    arithmetic           prompts   data.arithmetic   packrl.data.tasks
    char_count           prompts   data.char_count   packrl.data.char_count
    shapes               prompts   data.shapes       packrl.data.shapes (images)
    tool_traces          traces    data.arithmetic   packrl.data.tool_traces (calculator calls)
    char_count_traces    traces    data.char_count   packrl.data.char_count_traces

A task of your own is one file named in ``trainer.plugins``::

    @dataclass(frozen=True)
    class SumsOptions:
        num_rows: int = 100

    @TASKS.register("sums", options=SumsOptions)
    def sums(request: TaskRequest) -> list[dict]:
        rng = random.Random(request.split_seed)
        pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(request.options.num_rows)]
        return [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in pairs]

then ``data.train_files=[task:sums] data.task_args.sums.num_rows=500``: the options are checked at
config load against ``SumsOptions`` (unknown keys with the nearest, types, its ``problems(prefix)``
when it has one), as every registered part's are.

No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from packrl.config.load import build_options
from packrl.config.schema import DataConfig
from packrl.config.sft import SftConfig
from packrl.config.tasks import TASK_PREFIX, VAL_SEED_OFFSET, TaskMakes, task_info, task_source_problem
from packrl.errors import ConfigError
from packrl.registry import TASKS

ARGS_KEY = "data.task_args"
"""Where a plugin task's own options are: ``data.task_args.<name>.<knob>`` (`packrl.registry.TASKS.args_key`)."""


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """What a task reads to make the rows of one source.

    Attributes:
        options: its options (`TaskInfo.options_key`: a built-in's section of ``data``, such as
            ``data.arithmetic``; a plugin's ``data.task_args.<name>`` built against the options
            dataclass it registered with), or None when it takes none.
        data: the ``data`` section (``data.instruction`` and ``data.system_prompt`` for traces
            rendered as RL renders its prompts).
        seed: ``train.seed``.
        split: ``train`` or ``val`` (a traces task is read for ``train`` only).
        key: the config key naming the source, for messages (``data.train_files``).
        sft: the ``sft`` section for a task that makes traces (``sft.num_rows``,
            ``sft.trace_style``, ...); None for one that makes prompts.
    """

    options: Any
    data: DataConfig
    seed: int
    split: str = "train"
    key: str = "data.train_files"
    sft: SftConfig | None = None

    @property
    def split_seed(self) -> int:
        """``seed`` for ``train``, ``seed + VAL_SEED_OFFSET`` for ``val``: the built-in tasks'
        convention, so the two splits draw apart (`packrl.config.tasks.VAL_SEED_OFFSET`)."""
        return self.seed if self.split == "train" else self.seed + VAL_SEED_OFFSET


TaskFn = Callable[[TaskRequest], Sequence[Any]]
"""A registered task: the rows of one source (dicts as a file's rows; traces: ``{"messages": [...]}``)."""


def read_task(source: str, data: DataConfig, *, seed: int, split: str, key: str, makes: TaskMakes = "prompts",
              sft: SftConfig | None = None) -> list[Any]:
    """The rows of the source ``task:<name>``, made by the registered task ``name``.

    Args:
        source: ``task:<name>``.
        data: the ``data`` section (the task's options, unless it reads ``data.task_args``, are a section of it).
        seed: ``train.seed``. split: ``train`` or ``val``. key: the config key naming the source (messages).
        makes: what the caller reads: ``prompts`` (``data.*_files``) or ``traces`` (``sft.train_files``).
        sft: the ``sft`` section, for a task that makes traces.

    Returns:
        The rows in the task's order.

    Raises:
        ValueError: no task ``name`` is registered, or it makes the other kind (the message names
            the nearest registered task and where the other kind belongs); its options fail their
            checks (`task_options`); the task's own errors (an options value it cannot draw from).
    """
    problem = task_source_problem(source, makes)
    if problem is not None:
        raise ValueError(f"{key}: {source!r} {problem[0]}; {problem[1]}")
    name = source.removeprefix(TASK_PREFIX)
    request = TaskRequest(options=task_options(name, data), data=data, seed=seed, split=split, key=key, sft=sft)
    return list(TASKS[name](request))


def task_options(name: str, data: DataConfig) -> Any:
    """The options the registered task ``name`` reads (`packrl.config.tasks.TaskInfo.options_key`):
    a section of ``data`` as the config holds it, or the mapping ``data.task_args.<task>`` built
    against the options dataclass that task registered with (its defaults where unset; None when
    it registered none).

    Raises:
        ConfigError: the mapping does not fit the options (unknown keys, types, their own checks);
            a config that loaded was checked already.
    """
    key = task_info(name).options_key or f"{ARGS_KEY}.{name}"
    if not key.startswith(f"{ARGS_KEY}."):
        section: Any = data
        for part in key.removeprefix("data.").split("."):
            section = getattr(section, part)
        return section
    owner = key.removeprefix(f"{ARGS_KEY}.")
    cls = TASKS.options_class(owner)
    if cls is None:
        return None
    options, problems = build_options(cls, dict(data.task_args.get(owner) or {}), f"{key}.")
    if problems:
        raise ConfigError(problems)
    return options


def task_data_source(source: str) -> str:
    """The ``data_source`` of a ``task:<name>`` row without its own: ``packrl/<name>`` (the
    built-in tasks' rows carry the same: ``packrl/arithmetic``, ``packrl/char_count``, ``packrl/shapes``)."""
    return f"packrl/{source.removeprefix(TASK_PREFIX)}"
