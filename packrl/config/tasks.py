"""The built-in tasks' sections (`data.arithmetic`, `data.char_count`, `data.shapes`), what every
registered task declares (`TaskInfo`) and the check of the ``task:`` sources a config names, and
the images of vision-language rows (`data.images`).

Part of the typed run configuration (`packrl.config.schema.RunConfig`)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from packrl.capabilities import TaskInfo, TaskMakes
from packrl.errors import ConfigProblem, check_positive
from packrl.registry import TASKS

TASK_PREFIX = "task:"
"""A source ``task:<name>`` is made by the registered task ``name`` (`packrl.registry.TASKS`)."""

VAL_SEED_OFFSET = 1_000_003
"""The validation split of a built-in task draws from ``train.seed + VAL_SEED_OFFSET``
(`packrl.data.task_sources.TaskRequest.split_seed`), the training split from ``train.seed``."""

_HOMES: dict[str, str] = {"prompts": "data.train_files / data.val_files", "traces": "sft.train_files"}

def task_info(name: str) -> TaskInfo:
    """What the registered task ``name`` declared (`TaskInfo`; the defaults when it declared nothing).

    Raises:
        ValueError: no task ``name`` is registered.
    """
    return TASKS.info(name)


def task_names(makes: TaskMakes) -> list[str]:
    """The registered tasks (built-in and from ``trainer.plugins``) that make ``makes``, sorted."""
    return [name for name in TASKS.names() if task_info(name).makes == makes]


def task_sources_text(makes: TaskMakes) -> str:
    """The ``task:`` sources that make ``makes``, for messages: ``task:arithmetic, task:char_count, task:shapes``."""
    return ", ".join(TASK_PREFIX + name for name in task_names(makes))


def task_source_problem(source: str, makes: TaskMakes) -> tuple[str, str] | None:
    """None when ``source`` (``task:<name>``) names a registered task that makes ``makes``, else
    ``(what is wrong, the fix)``: the fix names the nearest such task, every one, and how to
    register another (or where a task that makes the other kind belongs)."""
    name = source.removeprefix(TASK_PREFIX)
    if name in TASKS:
        made = task_info(name).makes
        if made == makes:
            return None
        return (f"is a task that makes {made}, read from {_HOMES[made]}, not {makes}",
                f"move it to {_HOMES[made]}, or use one of {task_sources_text(makes)} here")
    close = difflib.get_close_matches(name, task_names(makes), n=1, cutoff=0.4)
    nearest = f"did you mean {TASK_PREFIX}{close[0]}? " if close else ""
    return ("is not a registered task", f"{nearest}registered tasks that make {makes}: {task_sources_text(makes)}; or "
            "register one with @packrl.registry.TASKS.register in a file named in trainer.plugins")


def task_source_problems(key: str, sources: list[str], makes: TaskMakes) -> list[ConfigProblem]:
    """One problem per ``task:`` source in ``sources`` (the list at config key ``key``) that is not
    a registered task making ``makes`` (`task_source_problem`); other sources are files or hub ids."""
    out = []
    for source in sources:
        problem = task_source_problem(source, makes) if isinstance(source, str) and source.startswith(TASK_PREFIX) else None
        if problem is not None:
            out.append(ConfigProblem(key, sources, f"holds {source!r}, which {problem[0]}", problem[1]))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ArithmeticConfig:
    num_rows: int = 2000
    """Rows the built-in `task:arithmetic` generates (validation gets its own seeded rows)."""

    digits: int = 1
    """Digits per operand (1 -> 0..9)."""

    num_operands: int = 2
    """Operands per problem."""

    operators: str = "+"
    """Operators to draw from, e.g. `+-*`."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.digits", self.digits)
        out += check_positive(f"{prefix}.num_operands", self.num_operands)
        bad = set(self.operators) - set("+-*")
        if not self.operators or bad:
            out.append(ConfigProblem(f"{prefix}.operators", self.operators, "must be a non-empty string of + - *",
                                     f"set {prefix}.operators=+-"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CharCountConfig:
    num_rows: int = 2000
    """Rows the built-in `task:char_count` generates (validation gets its own seeded rows)."""

    min_letters: int = 5
    """Fewest letters of a word (`packrl.data.char_count`: pronounceable pseudo-words)."""

    max_letters: int = 20
    """Most letters of a word; the worked answer has one line per letter, so this bounds the
    response a correct answer needs (`packrl.data.char_count.shortest_correct_response`)."""

    max_count: int = 3
    """The answers (counts) are drawn first, uniformly over ``0 .. max_count``, then a word and a
    letter with that count, so a constant guess of the count is right for about
    ``1 / (max_count + 1)`` of the rows (`packrl.data.char_count`)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.min_letters", self.min_letters)
        out += check_positive(f"{prefix}.max_letters", self.max_letters)
        if not out and self.max_letters < self.min_letters:
            out.append(ConfigProblem(f"{prefix}.max_letters", self.max_letters, f"is below {prefix}.min_letters={self.min_letters}",
                                     f"set {prefix}.max_letters >= {self.min_letters}",
                                     keys=(f"{prefix}.max_letters", f"{prefix}.min_letters")))
        if isinstance(self.max_count, bool) or not isinstance(self.max_count, int) or self.max_count < 0:
            out.append(ConfigProblem(f"{prefix}.max_count", self.max_count, "must be an integer >= 0", f"set {prefix}.max_count=3"))
        elif not out and self.max_count > self.max_letters:
            out.append(ConfigProblem(f"{prefix}.max_count", self.max_count, f"is above {prefix}.max_letters={self.max_letters}: "
                                     "no word that long holds a letter that often", f"set {prefix}.max_count <= {self.max_letters}",
                                     keys=(f"{prefix}.max_count", f"{prefix}.max_letters")))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapesConfig:
    num_rows: int = 2000
    """Rows the built-in `task:shapes` generates (validation gets its own seeded rows)."""

    max_shapes: int = 6
    """At most this many shapes per image (at least 1)."""

    image_size: int = 112
    """Side of each square image, pixels."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.num_rows", self.num_rows) + check_positive(f"{prefix}.max_shapes", self.max_shapes)
        if self.image_size < 28:
            out.append(ConfigProblem(f"{prefix}.image_size", self.image_size, "is below 28 pixels (one image token)",
                                     f"set {prefix}.image_size >= 28"))
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageConfig:
    """Images of vision-language rows (`packrl.data.images`); a text model ignores them."""

    max_pixels: int | None = None
    """Largest image area in pixels after resizing (Qwen2-VL's processor ``max_pixels``; one
    image token per 28 x 28 pixels there). None = the model processor's own setting."""

    min_pixels: int | None = None
    """Smallest image area in pixels after resizing (``min_pixels``). None = the processor's own."""

    max_images_per_row: int = 8
    """A row with more images is rejected (counted, named)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        out = check_positive(f"{prefix}.max_images_per_row", self.max_images_per_row)
        for name in ("max_pixels", "min_pixels"):
            if getattr(self, name) is not None:
                out += check_positive(f"{prefix}.{name}", getattr(self, name))
        if self.max_pixels is not None and self.min_pixels is not None and self.min_pixels > self.max_pixels:
            out.append(ConfigProblem(f"{prefix}.min_pixels", self.min_pixels, f"is above {prefix}.max_pixels={self.max_pixels}",
                                     f"set {prefix}.min_pixels <= {prefix}.max_pixels"))
        return out
