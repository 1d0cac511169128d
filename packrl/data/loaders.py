"""Read raw rows from a file, the built-in task or the HF hub. No normalisation happens here.

A source is one of:

    source                          read as
    "train.jsonl"                   one JSON object per line; blank lines skipped
    "train.json"                    a JSON list of objects
    "train.parquet"                 a parquet table (pyarrow), one row per table row
    "task:arithmetic"               the rows of a registered task (`packrl.data.task_sources`: the
                                    built-in task:arithmetic, task:char_count, task:shapes, or one
                                    from trainer.plugins); the split picks the seed
    "openai/gsm8k[:main]"           a hub dataset (optional `datasets` package and a network)

A jsonl line that is not valid UTF-8, not valid JSON or not an object does not stop the load:
it becomes a `BadRow` with its reason (non-objects are passed on for `examples` to reject), so
the dataset can count it or name it. A row (jsonl line, or element of a ``.json`` list) with
the same key twice in one of its objects is a `BadRow` too, naming the key and both values:
JSON names should be unique (RFC 8259, section 4: readers of a repeated name behave
unpredictably; Python's json keeps the last), so packrl does not guess which one the row
meant. A parquet file with a column twice is refused by pyarrow when read. A source that
cannot be read at all is a ValueError naming the file and the config key.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrl.config.schema import DataConfig
from packrl.config.tasks import TASK_PREFIX, task_sources_text
from packrl.data.task_sources import read_task

logger = logging.getLogger("packrl.data")

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


def load_rows(source: str, *, data: DataConfig, seed: int, split: str, key: str | None = None) -> list[Any]:
    """Read every row of one source, in order.

    Args:
        source: a path ending in ``.jsonl``/``.json``/``.parquet``, ``task:<name>`` (a registered
            task that makes prompts, `packrl.data.task_sources.read_task`) or a hub dataset id
            (``openai/gsm8k``, ``openai/gsm8k:main`` for a config).
        data: the ``data`` section; a task reads its options there (``data.arithmetic``,
            ``data.task_args.<name>``, ...).
        seed: ``train.seed``; a task draws its ``train`` rows from it and its ``val`` rows from
            ``seed + VAL_SEED_OFFSET`` (the built-in tasks).
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
    if source.startswith(TASK_PREFIX):
        return read_task(source, data, seed=seed, split=split, key=key)
    path = Path(source).expanduser()
    if path.is_file():
        return _file_rows(path, key)
    built_in = (task_sources_text("traces") if key.startswith("sft.")
                else f"{task_sources_text('prompts')}, or a hub id such as openai/gsm8k")
    if path.exists():
        raise ValueError(f"{key}: {source!r} is not a file; give a .jsonl, .json or .parquet file, or {built_in}")
    if path.suffix.lower() in FILE_SUFFIXES or not _HUB_ID.match(source):
        raise ValueError(f"{key}: {source!r} does not exist; fix the path in {key}, or use {built_in}")
    return _hub_rows(source, split=split, key=key)


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


class _KeyRecorder:
    """``object_pairs_hook`` for `json.loads`: builds each object as a dict, as json does, and
    records the keys that appear more than once in one object (``found``: key, first value, next
    value), where plain json would keep the last value silently. An object with such a key is
    returned as a `_DuplicatedKeys` so the row holding it can be found in a parsed list."""

    def __init__(self) -> None:
        self.found: list[tuple[str, Any, Any]] = []

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        first: dict[str, Any] = {}
        repeated = []
        for key, value in pairs:
            if key in first:
                repeated.append((key, first[key], value))
            else:
                first[key] = value
        self.found += repeated
        return _DuplicatedKeys(obj, repeated)


class _DuplicatedKeys(dict[str, Any]):
    """A JSON object that had a key twice (the row holding it is bad); ``repeated`` holds
    ``(key, first value, next value)`` for each repeat."""

    def __init__(self, obj: dict[str, Any], repeated: list[tuple[str, Any, Any]]):
        super().__init__(obj)
        self.repeated = repeated


def _duplicate_reason(found: list[tuple[str, Any, Any]]) -> str:
    key, first, then = found[0]
    more = f" (and {len(found) - 1} more repeated key(s))" if len(found) > 1 else ""
    return (f"key {key!r} appears twice in one object ({_short(first)}, then {_short(then)}){more}; JSON keys must be "
            "unique, and which value the row meant is unknown: keep one")


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonl_rows(path: Path) -> list[Any]:
    """One row per non-blank line. Each line is decoded on its own, so one bad byte costs one row."""
    rows: list[Any] = []
    keys = _KeyRecorder()
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
                row = json.loads(text, object_pairs_hook=keys)
            except json.JSONDecodeError as err:
                rows.append(BadRow(f"line {line_no}: invalid JSON ({err.msg.removesuffix(' at')} at column {err.colno})"))
            except (ValueError, RecursionError) as err:  # a 5,000-digit number, nesting deeper than Python's stack
                rows.append(BadRow(f"line {line_no}: unreadable JSON ({type(err).__name__}: {str(err)[:80]})"))
            else:
                rows.append(BadRow(f"line {line_no}: {_duplicate_reason(keys.found)}") if keys.found else row)
            keys.found.clear()
    return rows


def _json_rows(path: Path, key: str) -> list[Any]:
    keys = _KeyRecorder()
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"), object_pairs_hook=keys)
    except (ValueError, RecursionError) as err:  # invalid UTF-8 or JSON, huge numbers, deep nesting
        raise ValueError(f"{key}: {str(path)!r} is not valid UTF-8 JSON ({err}); fix the file, or use .jsonl to skip bad lines") from err
    if not isinstance(data, list):
        raise ValueError(
            f"{key}: {str(path)!r} holds a JSON {type(data).__name__}, expected a list of row objects; "
            "wrap the rows in [...] or write one object per line to a .jsonl file"
        )
    if keys.found:  # rare: find the rows that hold an object with a repeated key
        return [BadRow(f"row {i}: {_duplicate_reason(found)}") if (found := _repeated_in(row)) else row
                for i, row in enumerate(data)]
    return data


def _repeated_in(value: Any) -> list[tuple[str, Any, Any]]:
    """The repeated keys of every object inside ``value`` (a parsed row), outermost first."""
    found = list(value.repeated) if isinstance(value, _DuplicatedKeys) else []
    if isinstance(value, dict):
        for v in value.values():
            found += _repeated_in(v)
    elif isinstance(value, list):
        for v in value:
            found += _repeated_in(v)
    return found


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
