"""load_rows: jsonl, json, parquet (GSM8K and verl schema), bad lines as BadRow, and clear errors."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packrl.config.schema import DataConfig
from packrl.data import BadRow, load_rows

DATA = DataConfig()
ROWS = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + 2?", "answer": "#### 4"}]


def _load(path, split="train", key=None):
    return load_rows(str(path), data=DATA, seed=0, split=split, key=key)


def test_jsonl_skips_blank_lines_and_a_bom(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n\n   \r\n" + json.dumps(ROWS[1]).encode() + b"\r\n")
    assert _load(path) == ROWS


def test_jsonl_bad_lines_become_bad_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        json.dumps(ROWS[0]).encode() + b"\n"
        + b'{"question": "caf\xe9", "answer": "#### 1"}\n'  # latin-1 byte: invalid UTF-8
        + b"{not json\n"
        + b"[1, 2]\n"
        + json.dumps(ROWS[1]).encode() + b"\n"
    )
    rows = _load(path)
    assert len(rows) == 5
    assert rows[0] == ROWS[0] and rows[4] == ROWS[1]
    assert isinstance(rows[1], BadRow) and rows[1].reason.startswith("line 2: invalid UTF-8")
    assert isinstance(rows[2], BadRow) and rows[2].reason.startswith("line 3: invalid JSON")
    assert rows[3] == [1, 2]  # not an object: passed on, rejected by to_example


def test_jsonl_hostile_lines_become_bad_rows(tmp_path):
    """A 5,000-digit number and nesting deeper than Python's stack cost one row each, not the load."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b'{"question": "q", "answer": "#### 1", "id": ' + b"9" * 5000 + b"}\n"
        + b"[" * 100_000 + b"]" * 100_000 + b"\n"
        + json.dumps(ROWS[0]).encode() + b"\n"
    )
    rows = _load(path)
    assert isinstance(rows[0], BadRow) and rows[0].reason.startswith("line 1: unreadable JSON (ValueError")
    assert isinstance(rows[1], BadRow) and rows[1].reason.startswith("line 2: unreadable JSON (RecursionError")
    assert rows[2] == ROWS[0]


def test_json_with_a_huge_number_names_the_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"question": "q", "answer": "#### 1", "id": ' + b"9" * 5000 + b"}]")
    with pytest.raises(ValueError, match=r"data.train_files: .*rows.json.* is not valid UTF-8 JSON"):
        _load(path)


def test_json_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert _load(path) == ROWS


def test_json_that_is_not_a_list(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS[0]))
    with pytest.raises(ValueError, match=r"data.train_files: .*rows.json.*list of row objects"):
        _load(path)


def test_json_that_does_not_parse(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[{]")
    with pytest.raises(ValueError, match=r"data.val_files: .*not valid UTF-8 JSON"):
        _load(path, split="val")


def test_parquet_gsm8k_rows(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert _load(path) == ROWS


def test_parquet_verl_schema_keeps_the_prompt_as_a_list_of_dicts(tmp_path):
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 1 + 1? Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0},
    }
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    (loaded,) = _load(path)
    assert loaded == row


def test_custom_key_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"my\.key: .*does not exist"):
        _load(tmp_path / "missing.jsonl", key="my.key")


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.jsonl", None, r"data.train_files: .*missing.jsonl' does not exist"),
        ("empty.jsonl", b"", r"data.train_files: .*empty.jsonl' is empty"),
        ("blank.jsonl", b"\n \n", r"data.train_files: .*blank.jsonl' has no rows"),
        ("empty.json", b"[]", r"has no rows"),
        ("rows.csv", b"a,b\n", r"suffix '.csv'; supported: .jsonl, .json, .parquet"),
        ("broken.parquet", b"not parquet", r"not a readable parquet file"),
    ],
)
def test_unreadable_sources_name_the_file_and_the_key(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        _load(path)


def test_a_directory_is_not_a_source(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        _load(tmp_path)


def test_unknown_task_and_split():
    with pytest.raises(ValueError, match=r"data.train_files: 'task:sums' is not a registered task; did you mean task:shapes\? "
                                         r"registered tasks that make prompts: task:arithmetic, task:char_count, task:shapes;"):
        load_rows("task:sums", data=DATA, seed=0, split="train")
    with pytest.raises(ValueError, match="split='test'"):
        load_rows("task:arithmetic", data=DATA, seed=0, split="test")


def test_hub_id_without_datasets_names_the_key_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError, no network
    with pytest.raises(ValueError, match=r"data.train_files: 'openai/gsm8k:main' .*pip install 'packrl\[hub\]'"):
        load_rows("openai/gsm8k:main", data=DATA, seed=0, split="train")


def test_hub_download_failure_is_a_value_error(monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(name, config):
            raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(ValueError, match=r"data.val_files: could not load hub dataset 'openai/gsm8k' \(ConnectionError: offline\)"):
        load_rows("openai/gsm8k", data=DATA, seed=0, split="val")


def test_hub_split_choice(monkeypatch):
    calls = []

    class FakeDatasets:
        @staticmethod
        def load_dataset(name, config):
            calls.append((name, config))
            return {"train": [ROWS[0]], "test": [ROWS[1]]}

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    assert load_rows("openai/gsm8k:main", data=DATA, seed=0, split="train") == [ROWS[0]]
    assert load_rows("openai/gsm8k", data=DATA, seed=0, split="val") == [ROWS[1]]
    assert calls == [("openai/gsm8k", "main"), ("openai/gsm8k", None)]


def test_a_key_twice_in_a_row_is_a_bad_row_naming_the_key_and_both_values(tmp_path):
    """Python's json keeps the last value of a repeated key; packrl refuses the row instead."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"question": "What is 2 + 2?", "answer": "#### 4", "answer": "#### 5"}\n' + json.dumps(ROWS[1]) + "\n")
    rows = _load(jsonl)
    assert rows[0] == BadRow("line 1: key 'answer' appears twice in one object (\"#### 4\", then \"#### 5\"); JSON keys "
                             "must be unique, and which value the row meant is unknown: keep one")
    assert rows[1] == ROWS[1]
    listed = tmp_path / "rows.json"  # a .json list: the row is found even when the repeat is nested
    listed.write_text('[{"question": "q", "answer": "#### 1"}, {"question": "r", "answer": "#### 2", '
                      '"extra_info": {"index": 3, "index": 4}}]')
    rows = _load(listed)
    assert rows[0] == {"question": "q", "answer": "#### 1"}
    assert rows[1] == BadRow("row 1: key 'index' appears twice in one object (3, then 4); JSON keys must be unique, "
                             "and which value the row meant is unknown: keep one")
