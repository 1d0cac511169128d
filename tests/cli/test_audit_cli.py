"""`packrl audit`: JSON and text output, HTML page, cache, overrides and bad input as exit 2."""

from __future__ import annotations

import json

import pytest

from packrl.cli.audit import locate_tokenizer, split_arguments
from packrl.cli.main import main
from tests.builders import AUDIT_INSTRUCTION, AUDIT_KEYS, QUESTION_LENGTHS, char_tokenizer, prompt_chars, write_jsonl
from tests.conftest import SMOLLM_DIR


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A directory holding only the character tokenizer's files (no weights, no config.json)."""
    folder = tmp_path_factory.mktemp("char_model")
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture
def data(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("PACKRL_CACHE", str(tmp_path / "cache"))
    rows = [{"question": "q" * n, "answer": "#### 1"} for n in QUESTION_LENGTHS]
    return write_jsonl(tmp_path / "ten.jsonl", rows)


def audit_json(capsys, *argv) -> dict:
    assert main(["audit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_parses_with_the_documented_keys(capsys, data, model_dir):
    out = audit_json(capsys, data, f"data.instruction={AUDIT_INSTRUCTION}", "data.max_prompt_tokens=60", "--model", model_dir)
    assert set(out) == AUDIT_KEYS
    assert out["prompt_tokens"]["p99"] == max(prompt_chars("q" * n) for n in QUESTION_LENGTHS)
    assert out["policies"]["filter"]["num_filtered"] == out["num_overlong"] == 6
    assert out["config"]["data.max_prompt_tokens"] == 60 and out["model"] == model_dir
    assert out["wall_s"] > 0 and out["rows_per_s"] > 0


def test_second_run_comes_from_the_cache(capsys, data, model_dir):
    first = audit_json(capsys, data, "--model", model_dir)
    second = audit_json(capsys, data, "--model", model_dir)
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert not audit_json(capsys, data, "--model", model_dir, "data.max_prompt_tokens=61")["cached"]
    assert not audit_json(capsys, data, "--model", model_dir, "--no-cache")["cached"]


def test_text_report_and_html_page(capsys, data, model_dir, tmp_path):
    page = tmp_path / "out" / "audit.html"
    assert main(["audit", data, "--model", model_dir, "--html", str(page)]) == 0
    captured = capsys.readouterr()
    assert "prompt tokens" in captured.out and "p99" in captured.out and "rows/s" in captured.out
    assert f"wrote {page}" in captured.err
    text = page.read_text()
    assert "Plotly.newPlot" in text and "prompt tokens: histogram" in text
    assert "<script src=" not in text and '<link' not in text  # plotly.js inlined: nothing fetched


def test_preset_and_overrides_reach_the_audit(capsys, data, model_dir):
    out = audit_json(capsys, data, "--preset", "gsm8k", "data.overlong_prompt=left", "--model", model_dir)
    assert out["config"]["data.overlong_prompt"] == "left"


@pytest.mark.parametrize(("name", "content"), [("missing.jsonl", None), ("empty.jsonl", ""), ("rows.txt", "a,b\n")])
def test_bad_data_exits_2_with_a_message_naming_the_file(capsys, tmp_path, model_dir, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert main(["audit", str(path), "--model", model_dir]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packrl audit: ") and str(path) in err and "Traceback" not in err


def test_bad_config_and_model_exit_2(capsys, data, tmp_path):
    assert main(["audit", data, "data.max_prompt_tokens=0"]) == 2
    assert "data.max_prompt_tokens" in capsys.readouterr().err
    assert main(["audit", data, "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf" in capsys.readouterr().err


def test_split_arguments_tells_overrides_from_sources():
    args = ["a.jsonl", "data.max_prompt_tokens=1024", "runs/a=b/train.jsonl", "task:arithmetic"]
    assert split_arguments(args) == (["a.jsonl", "runs/a=b/train.jsonl", "task:arithmetic"], ["data.max_prompt_tokens=1024"])


def test_a_gguf_uses_the_tokenizer_training_would_without_converting():
    gguf = SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not found")
    located = locate_tokenizer(str(gguf))
    assert located.directory is not None and (located.directory / "tokenizer.json").is_file()
