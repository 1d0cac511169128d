"""Read raw rows from a file, the built-in task or the HF hub. No normalisation happens here.

A source is one of:

    source                          read as
    "train.jsonl"                   one JSON object per line; blank lines skipped
    "train.json"                    a JSON list of objects
    "train.parquet"                 a parquet table (pyarrow), one row per table row
    "task:arithmetic"               `packrl.data.tasks.arithmetic_rows`; the split picks the seed,
                                    and validation keeps each question once
    "task:shapes"                   `packrl.data.shapes.shapes_rows` (images; a vision-language model)
    "openai/gsm8k[:main]"           a hub dataset (optional `datasets` package and a network)

A jsonl line that is not valid UTF-8, not valid JSON or not an object does not stop the load:
it becomes a `BadRow` with its reason (non-objects are passed on for `examples` to reject), so
the dataset can count it or name it. A source that cannot be read at all is a ValueError
naming the file and the config key.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrl.config.schema import ArithmeticConfig, ShapesConfig
from packrl.data.shapes import shapes_rows
from packrl.data.tasks import VAL_SEED_OFFSET, arithmetic_rows

logger = logging.getLogger("packrl.data")

TASKS: tuple[str, ...] = ("arithmetic", "shapes")
SPLITS: tuple[str, ...] = ("train", "val")
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_HUB_SPLITS = {"train": ("train",), "val": ("validation", "test")}


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that could not be read, with the reason (e.g. ``"line 7: invalid JSON: ..."``)."""

    reason: str


def _default_key(split: str) -> str:
    return "data.train_files" if split == "train" else "data.val_files"


def load_rows(
    source: str,
    *,
    arithmetic: ArithmeticConfig,
    seed: int,
    split: str,
    key: str | None = None,
    shapes: ShapesConfig | None = None,
) -> list[Any]:
    """Read every row of one source, in order.

    Args:
        source: a path ending in ``.jsonl``/``.json``/``.parquet``, ``task:arithmetic`` or a
            hub dataset id (``openai/gsm8k``, ``openai/gsm8k:main`` for a config).
        arithmetic: knobs of ``task:arithmetic`` (``data.arithmetic``).
        shapes: knobs of ``task:shapes`` (``data.shapes``; default: its defaults).
        seed: ``train.seed``; ``task:arithmetic`` uses it for ``train`` and
            ``seed + VAL_SEED_OFFSET`` for ``val``.
        split: ``"train"`` or ``"val"``; also picks the hub split (val: ``validation``, else ``test``).
        key: the config key naming this source, for messages; default ``data.train_files``
            for train and ``data.val_files`` for val.

    Returns:
        The raw rows: dicts as read, `BadRow` for unreadable jsonl lines, and whatever else a
        file held where an object was expected (rejected later, not here).

    Raises:
        ValueError: an unknown split or task, a path that does not exist, an empty or
            unparseable file, an unknown suffix, or a hub dataset that cannot be loaded.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)}")
    key = key or _default_key(split)
    if source.startswith("task:"):
        if source == "task:shapes":
            cfg = shapes or ShapesConfig()
            return shapes_rows(cfg.num_rows, cfg.max_shapes, cfg.image_size, seed if split == "train" else seed + VAL_SEED_OFFSET)
        return _task_rows(source, arithmetic=arithmetic, seed=seed, split=split, key=key)
    path = Path(source).expanduser()
    if path.is_file():
        return _file_rows(path, key)
    built_in = "task:tool_traces (calculator traces)" if key.startswith("sft.") else "task:arithmetic or a hub id such as openai/gsm8k"
    if path.exists():
        raise ValueError(f"{key}: {source!r} is not a file; give a .jsonl, .json or .parquet file, or {built_in}")
    if path.suffix.lower() in FILE_SUFFIXES or not _HUB_ID.match(source):
        raise ValueError(f"{key}: {source!r} does not exist; fix the path in {key}, or use {built_in}")
    return _hub_rows(source, split=split, key=key)


def _task_rows(source: str, *, arithmetic: ArithmeticConfig, seed: int, split: str, key: str) -> list[Any]:
    name = source.removeprefix("task:")
    if name != "arithmetic":
        raise ValueError(f"{key}: unknown built-in task {source!r}; known tasks: {', '.join('task:' + t for t in TASKS)}")
    args = (arithmetic.num_rows, arithmetic.digits, arithmetic.num_operands, arithmetic.operators)
    if split == "train":
        return arithmetic_rows(*args, seed)
    train_questions = [r["question"] for r in arithmetic_rows(*args, seed)]
    rows = arithmetic_rows(*args, seed + VAL_SEED_OFFSET, exclude=train_questions)
    # a repeated validation row adds cost, not information: keep each question once
    distinct = list({r["question"]: r for r in rows}.values())
    if len(distinct) < len(rows):
        logger.info("%s: task:arithmetic validation keeps %d distinct of %d rows", key, len(distinct), len(rows))
    return distinct


def _file_rows(path: Path, key: str) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ValueError(f"{key}: {str(path)!r} has suffix {suffix or '(none)'!r}; supported: {', '.join(FILE_SUFFIXES)}")
    if path.stat().st_size == 0:
        raise ValueError(f"{key}: {str(path)!r} is empty (0 bytes); fix or remove it from {key}")
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".json":
        rows = _json_rows(path, key)
    else:
        rows = _parquet_rows(path, key)
    if not rows:
        raise ValueError(f"{key}: {str(path)!r} has no rows; fix or remove it from {key}")
    return rows


def _jsonl_rows(path: Path) -> list[Any]:
    """One row per non-blank line. Each line is decoded on its own, so one bad byte costs one row."""
    rows: list[Any] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8", errors="strict")
            except UnicodeDecodeError as err:
                rows.append(BadRow(f"line {line_no}: invalid UTF-8 (byte {err.start})"))
                continue
            if line_no == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError as err:
                rows.append(BadRow(f"line {line_no}: invalid JSON ({err.msg.removesuffix(' at')} at column {err.colno})"))
            except (ValueError, RecursionError) as err:  # a 5,000-digit number, nesting deeper than Python's stack
                rows.append(BadRow(f"line {line_no}: unreadable JSON ({type(err).__name__}: {str(err)[:80]})"))
    return rows


def _json_rows(path: Path, key: str) -> list[Any]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (ValueError, RecursionError) as err:  # invalid UTF-8 or JSON, huge numbers, deep nesting
        raise ValueError(f"{key}: {str(path)!r} is not valid UTF-8 JSON ({err}); fix the file, or use .jsonl to skip bad lines") from err
    if not isinstance(data, list):
        raise ValueError(
            f"{key}: {str(path)!r} holds a JSON {type(data).__name__}, expected a list of row objects; "
            "wrap the rows in [...] or write one object per line to a .jsonl file"
        )
    return data


def _parquet_rows(path: Path, key: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ValueError(f"{key}: reading {str(path)!r} needs pyarrow; pip install pyarrow") from err
    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise ValueError(f"{key}: {str(path)!r} is not a readable parquet file ({type(err).__name__}: {err}); fix the file") from err


def _hub_rows(source: str, *, split: str, key: str) -> list[Any]:
    name, _, config = source.partition(":")
    fix = f"or download the data and set {key} to a local .jsonl/.parquet file"
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"{key}: {source!r} looks like a hub dataset id, which needs `datasets`: pip install 'packrl[hub]', {fix}"
        ) from err
    try:
        loaded = datasets.load_dataset(name, config or None)
    except Exception as err:  # network, auth and missing-dataset errors all land here
        raise ValueError(
            f"{key}: could not load hub dataset {source!r} ({type(err).__name__}: {err}); check the id and the network, {fix}"
        ) from err
    for candidate in _HUB_SPLITS[split]:
        if candidate in loaded:
            return [dict(r) for r in loaded[candidate]]
    raise ValueError(
        f"{key}: hub dataset {source!r} has splits {sorted(loaded)}, none of {list(_HUB_SPLITS[split])} for {split}; {fix}"
    )
