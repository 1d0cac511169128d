"""`packrl data gsm8k`: GSM8K jsonl -> verl's parquet, read back by packrl's verl-schema loader."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packrl.cli.main import main
from packrl.config.schema import DataConfig
from packrl.data.examples import to_example
from packrl.data.loaders import load_rows
from packrl.data.verl_gsm8k import VERL_GSM8K_INSTRUCTION, extract_answer, verl_schema, write_verl_gsm8k
from tests.conftest import GSM8K_DIR, needs_shared

ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many?", "answer": "48/2 = 24\n#### 72"},
    {"question": "Big number?", "answer": "so\n#### 1,234"},
    {"question": "No answer here", "answer": "the answer is ten"},  # left out, counted
    {"question": "Negative?", "answer": "#### -3.5"},
]


def _write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


@pytest.mark.parametrize("text, expected", [("... #### 72", "72"), ("#### 1,234", "1234"), ("#### -3.5", "-3.5"),
                                            ("#### ten", None), ("#### 5\n#### 6", "5")])
def test_extract_answer_is_verls(text, expected):
    assert extract_answer(text) == expected


def _examples(path, **kw):
    rows = load_rows(str(path), data=DataConfig(), seed=0, split="train")
    return [to_example(r, row=i, system_prompt=None, **kw) for i, r in enumerate(rows)]


def test_parquet_has_verls_schema_and_reads_back_with_the_same_prompts(tmp_path):
    source = _write_jsonl(tmp_path / "train.jsonl", ROWS, ["not json\n"])
    account = write_verl_gsm8k(source, "train", tmp_path / "out" / "train.parquet")
    assert (account.num_rows, account.num_written) == (5, 3)
    assert [i for i, _ in account.skipped] == [2, 4]  # no '#### <number>'; invalid JSON
    assert "no '#### <number>' answer" in account.skipped[0][1] and "invalid JSON" in account.skipped[1][1]
    assert account.num_rows == account.num_written + len(account.skipped)

    table = pq.read_table(account.output)
    assert table.schema.equals(verl_schema())
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = table.slice(0, 1).to_pylist()[0]
    assert first == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": ROWS[0]["question"] + " " + VERL_GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": ROWS[0]["answer"], "question": ROWS[0]["question"]},
    }
    assert [r["extra_info"]["index"] for r in table.to_pylist()] == [0, 1, 3]  # file positions, as verl's idx

    from_parquet = _examples(account.output, instruction="")
    from_jsonl = [e for e in _examples(source, instruction=VERL_GSM8K_INSTRUCTION) if not isinstance(e, str)]
    assert [e.chat for e in from_parquet] == [e.chat for e in from_jsonl]
    assert [e.ground_truth for e in from_parquet] == ["72", "1234", "-3.5"] == [e.ground_truth for e in from_jsonl]
    assert {e.data_source for e in from_parquet} == {"openai/gsm8k"}


def test_cli_writes_both_splits_and_reports_left_out_rows(tmp_path, capsys):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _write_jsonl(tmp_path / "test.jsonl", ROWS[:2])
    assert main(["data", "gsm8k", "--input-dir", str(tmp_path), "--out", str(tmp_path / "verl")]) == 0
    out, err = capsys.readouterr()
    assert "train: 4 rows read" in out and "3 written" in out and "1 left out (row 2: no '#### <number>' answer" in out
    assert "test: 2 rows read" in out and "1 train row(s) left out" in err
    assert pq.read_table(tmp_path / "verl" / "test.parquet").num_rows == 2


def test_cli_names_a_missing_file(tmp_path, capsys):
    assert main(["data", "gsm8k", "--train", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    assert "--test" in capsys.readouterr().err
    assert main(["data", "gsm8k", "--input-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "train.jsonl' is not a file" in capsys.readouterr().err


def test_a_file_with_no_convertible_row_is_an_error(tmp_path):
    source = _write_jsonl(tmp_path / "train.jsonl", [ROWS[2]])
    with pytest.raises(ValueError, match=r"--train: none of the 1 rows .* converts"):
        write_verl_gsm8k(source, "train", tmp_path / "train.parquet")


@needs_shared(GSM8K_DIR / "train.jsonl")
def test_the_shared_gsm8k_converts_every_row_and_matches_packrls_jsonl_reading(tmp_path):
    for split in ("train", "test"):
        account = write_verl_gsm8k(GSM8K_DIR / f"{split}.jsonl", split, tmp_path / f"{split}.parquet")
        assert account.num_written == account.num_rows and not account.skipped
        table = pa.Table.from_pylist(load_rows(str(account.output), data=DataConfig(), seed=0, split="train"))
        assert table.num_rows == account.num_rows
        from_parquet = _examples(account.output, instruction="")
        from_jsonl = _examples(GSM8K_DIR / f"{split}.jsonl", instruction=VERL_GSM8K_INSTRUCTION)
        assert [(e.chat, e.ground_truth) for e in from_parquet] == [(e.chat, e.ground_truth) for e in from_jsonl]
