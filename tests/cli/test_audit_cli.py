"""`packrl audit`: JSON and text output, HTML page, cache, overrides, bad input as exit 2, and rows
with images through a vision-language model.path's processor (or rejected under a text one)."""

from __future__ import annotations

import json

import pytest

from packrl.cli.audit import locate_tokenizer, split_arguments
from packrl.cli.main import main
from tests.builders import AUDIT_INSTRUCTION, AUDIT_KEYS, QUESTION_LENGTHS, char_tokenizer, prompt_chars, write_jsonl
from tests.conftest import GGUF, skip_without_shared
from tests.vlm import image


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
    gguf = GGUF
    if not gguf.is_file():
        skip_without_shared(gguf)
    located = locate_tokenizer(str(gguf))
    assert located.directory is not None and (located.directory / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, smollm_tokenizer):
    from tests.vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", max_pixels=28 * 28 * 256)


def image_rows(folder) -> str:
    """Two rows with image files (chat parts; verl markers) and one whose image file is missing."""
    image(448, 448).save(folder / "big.png")
    image(100, 60).save(folder / "small.png")
    truth = {"reward_model": {"ground_truth": "1"}, "data_source": "test/vision"}
    return write_jsonl(folder / "vision.jsonl", [
        {"prompt": [{"role": "user", "content": [{"type": "image", "path": "big.png"}, {"type": "text", "text": "How many? " * 20}]}]}
        | truth,
        {"prompt": [{"role": "user", "content": "<image>How many?"}], "images": ["small.png"]} | truth,
        {"prompt": [{"role": "user", "content": "<image>And?"}], "images": ["gone.png"]} | truth,
    ])


def test_a_vision_model_path_audits_image_rows_through_its_processor(capsys, data, vlm_dir, tmp_path):
    from packrl.cli.audit import locate_tokenizer

    assert locate_tokenizer(str(vlm_dir)).processor is not None
    rows = image_rows(tmp_path)
    out = audit_json(capsys, rows, "--model", str(vlm_dir), "data.overlong_prompt=middle", "data.max_prompt_tokens=200")
    m = out["multimodal"]
    assert m["processor"] is not None and m["geometry"]["factor"] == 28 and m["geometry"]["max_pixels"] == 28 * 28 * 256
    assert [(r["row"], r["status"]) for r in m["rows"]] == [(0, "truncated"), (1, "kept"), (2, "rejected")]
    assert "images resized" in m["changed"][0]["reason"] and m["rows"][1]["image_sizes"] == [[112, 56]]
    assert [b["row"] for b in out["bad_rows"]] == [2] and "does not exist" in out["bad_rows"][0]["reason"]
    assert out["policies"]["middle"]["num_truncated"] == 1 and out["policies"]["filter"]["num_filtered"] == 1
    again = audit_json(capsys, rows, "--model", str(vlm_dir), "data.overlong_prompt=middle", "data.max_prompt_tokens=200")
    assert not again["cached"]  # the images are files outside the data file: never cached


def test_images_inside_the_data_file_are_cached_with_the_image_settings_in_the_key(capsys, data, vlm_dir, tmp_path):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    png = io.BytesIO()
    image(56, 56).save(png, format="PNG")
    row = {"prompt": [{"role": "user", "content": "<image>How many?"}], "images": [{"bytes": png.getvalue()}],
           "reward_model": {"ground_truth": "1"}, "data_source": "test/vision"}
    inline = tmp_path / "inline.parquet"
    pq.write_table(pa.Table.from_pylist([row]), inline)
    first, second = (audit_json(capsys, str(inline), "--model", str(vlm_dir)) for _ in range(2))
    assert (first["cached"], second["cached"]) == (False, True)  # the image bytes are in the file's hash
    assert second["multimodal"] == first["multimodal"] and first["multimodal"]["rows"][0]["vision_tokens"] == 2 * 2 + 2
    for override in ("data.image.max_pixels=50176", "data.image.min_pixels=1568", "data.max_image_tokens=100"):
        assert not audit_json(capsys, str(inline), "--model", str(vlm_dir), override)["cached"], override


def test_a_text_model_path_rejects_image_rows_and_names_the_fix(capsys, data, model_dir, tmp_path):
    out = audit_json(capsys, image_rows(tmp_path), "--model", model_dir)
    assert out["num_bad_rows"] == 3 and out["multimodal"]["processor"] is None and out["multimodal"]["num_images"] == 3
    assert all(b["reason"].startswith("a row with images needs a vision-language model.path") for b in out["bad_rows"])
    assert any("row(s) with images" in p and "set model.path (or --model) to a vision-language model" in p for p in out["problems"])
    assert audit_json(capsys, image_rows(tmp_path), "--model", model_dir)["cached"]  # no image was opened
