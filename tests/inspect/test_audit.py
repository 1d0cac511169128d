"""packrl audit: exact numbers on known lengths, the trainer's p99, bad input, rows with images
under a text model, the cache (rows with images through a processor: test_audit_images.py).

Exact tests use a character-level tokenizer whose chat template is ``<role>content`` per message
plus ``<assistant>``, so a prompt's token count is the length of that string, computed here
independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import PreTrainedTokenizerFast

from packrl.config import load_config
from packrl.config.schema import DataConfig, MultiTurnConfig, RolloutConfig, RunConfig, TrainConfig
from packrl.data import PromptDataset, load_examples
from packrl.inspect.audit import audit_rows, audit_sources, cache_key, length_percentiles
from packrl.inspect.audit_html import render_html
from tests.builders import AUDIT_INSTRUCTION, AUDIT_KEYS, QUESTION_LENGTHS, char_tokenizer, prompt_chars, write_jsonl
from tests.conftest import GSM8K_DIR, skip_without_shared


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture
def ten_rows(tmp_path) -> str:
    rows = [{"question": "q" * n, "answer": f"step {'s' * i}\n#### {i}"} for i, n in enumerate(QUESTION_LENGTHS)]
    return write_jsonl(tmp_path / "ten.jsonl", rows)


def config(**data) -> RunConfig:
    data = {"instruction": AUDIT_INSTRUCTION, "max_prompt_tokens": 60, "batch_size": 1} | data
    return RunConfig(data=DataConfig(**data), rollout=RolloutConfig(max_response_tokens=100),
                     train=TrainConfig(max_tokens_per_microbatch=4096))


def audit(sources, tok, cfg):
    return audit_rows(load_examples(sources, cfg.data, seed=0, split="train", key="DATA"), tok, cfg, progress=False)


def test_percentiles_are_nearest_rank():
    assert length_percentiles(range(1, 11)) == {"p50": 5, "p90": 9, "p95": 10, "p99": 10, "max": 10}
    assert length_percentiles([7]) == {"p50": 7, "p90": 7, "p95": 7, "p99": 7, "max": 7}
    assert length_percentiles(list(range(1, 201))) == {"p50": 100, "p90": 180, "p95": 190, "p99": 198, "max": 200}
    assert length_percentiles([])["p99"] is None


def test_numbers_are_exact_on_known_lengths(tok, ten_rows):
    report = audit([ten_rows], tok, config())
    lengths = sorted(prompt_chars("q" * n) for n in QUESTION_LENGTHS)
    p = report.prompt_tokens
    assert (p.num_rows, p.p50, p.p90, p.p95, p.p99, p.max) == (10, lengths[4], lengths[8], lengths[9], lengths[9], lengths[9])
    assert p.mean == round(sum(lengths) / 10, 2)
    assert sum(p.histogram.counts) == 10 and p.histogram.bin_edges[0] <= lengths[0] < lengths[-1] < p.histogram.bin_edges[-1]
    answers = sorted(len(f"step {'s' * i}\n#### {i}") for i in range(10))
    assert (report.answer_tokens.p50, report.answer_tokens.max) == (answers[4], answers[9])
    assert report.num_rows == 10 and report.num_bad_rows == 0


def test_policies_at_the_budget_are_exact(tok, ten_rows):
    budget = 60
    report = audit([ten_rows], tok, config(max_prompt_tokens=budget))
    lengths = [prompt_chars("q" * n) for n in QUESTION_LENGTHS]
    over = [row for row, n in enumerate(lengths) if n > budget]
    removed = sum(lengths[row] - budget for row in over)  # characters are tokens: a cut is exact
    assert report.num_overlong == len(over) == 6
    f = report.policy("filter")
    assert (f.num_kept, f.num_filtered, f.num_truncated, f.num_tokens_removed, f.rows) == (4, 6, 0, 0, tuple(over))
    for side in ("left", "right", "middle"):
        t = report.policy(side)
        assert (t.num_kept, t.num_truncated, t.num_filtered, t.num_rejected, t.num_tokens_removed) == (4, 6, 0, 0, removed)
        assert t.rows == tuple(over)
    e = report.policy("error")
    assert e.stops_training and e.rows == tuple(over) and e.num_filtered == 0


def test_a_budget_below_the_template_rejects_instead_of_cutting(tok, ten_rows):
    report = audit([ten_rows], tok, config(max_prompt_tokens=15))  # the template alone: len("<user><assistant>") = 17
    assert report.policy("left").num_rejected == 10 and report.policy("left").num_truncated == 0


def test_rows_listed_are_the_first_twenty(tok, tmp_path):
    rows = [{"question": "q" * (5 if i % 3 else 90), "answer": "#### 1"} for i in range(90)]
    report = audit([write_jsonl(tmp_path / "many.jsonl", rows)], tok, config())
    over = [i for i in range(90) if i % 3 == 0]
    assert report.num_overlong == report.policy("filter").num_rows_affected == 30
    assert report.policy("filter").rows == tuple(over[:20])


def test_suggested_budgets_follow_the_stated_rule(tok, ten_rows):
    report = audit([ten_rows], tok, config())
    p99 = max(prompt_chars("q" * n) for n in QUESTION_LENGTHS)  # 10 rows: p99 is the longest
    prompt = -(-p99 // 64) * 64
    assert report.suggested.max_prompt_tokens == prompt
    assert report.suggested.max_tokens_per_microbatch == -(-(prompt + 100) // 256) * 256


def test_audit_p99_equals_the_trainers(tok, ten_rows, tmp_path):
    extra = write_jsonl(tmp_path / "more.jsonl", [{"question": "r" * (7 * i % 97 + 1), "answer": "#### 2"} for i in range(300)])
    cfg = config(overlong_prompt="middle", skip_bad_rows=True)
    report = audit([ten_rows, extra], tok, cfg)
    trainer = PromptDataset.build([ten_rows, extra], tok, cfg.data, seed=0, split="train", key="data.train_files")
    p = report.prompt_tokens
    assert trainer.prompt_length_percentiles() == {"p50": p.p50, "p90": p.p90, "p95": p.p95, "p99": p.p99, "max": p.max}
    assert trainer.accounting.num_truncated == report.policy("middle").num_truncated
    assert trainer.accounting.num_tokens_removed == report.policy("middle").num_tokens_removed


def test_audit_p99_equals_the_trainers_with_smollm2(smollm_tokenizer, tmp_path):
    gsm8k = GSM8K_DIR / "train.jsonl"
    if not gsm8k.is_file():
        skip_without_shared(gsm8k)
    path = tmp_path / "gsm8k_600.jsonl"
    path.write_text("".join(gsm8k.read_text().splitlines(keepends=True)[:600]))
    cfg = config(instruction=DataConfig().instruction, max_prompt_tokens=128)
    report = audit([str(path)], smollm_tokenizer, cfg)
    trainer = PromptDataset.build([str(path)], smollm_tokenizer, cfg.data, seed=0, split="train", key="data.train_files")
    assert trainer.prompt_length_percentiles()["p99"] == report.prompt_tokens.p99
    # and both equal the chat template's own count, row by row
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    direct = [len(smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{r['question']} {cfg.data.instruction}"}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for r in rows]
    assert length_percentiles(direct)["p99"] == report.prompt_tokens.p99
    assert report.num_overlong == sum(n > 128 for n in direct)


def test_bad_rows_are_listed_with_numbers_and_training_reasons(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"question": "ok", "answer": "#### 1"},
        {"question": "no answer"},
        "{not json",
        {"question": "x", "answer": "#### ten"},
        {"question": "ok too", "answer": "#### 2"},
    ])
    report = audit([path], tok, config())
    assert report.num_rows == 5 and report.num_bad_rows == 3
    assert [(b.row, b.source, b.source_row) for b in report.bad_rows] == [(1, path, 1), (2, path, 2), (3, path, 3)]
    assert [b.reason for b in report.bad_rows] == [
        "missing field 'answer'", "line 3: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        "non-numeric answer: 'ten'",
    ]
    assert report.prompt_tokens.num_rows == 2
    assert any("3 bad row(s)" in p and "data.skip_bad_rows=true" in p for p in report.problems)
    skipping = audit([path], tok, config(skip_bad_rows=True))
    assert not skipping.problems


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "", r"is empty \(0 bytes\)"),
        ("rows.csv", "question,answer\nq,1\n", "has suffix '.csv'"),
        ("not_json.jsonl", "question,answer\nq,1\n", "is not JSON Lines"),
    ],
)
def test_bad_input_names_the_file(tok, tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        audit_sources([str(path)], config(), tokenizer_loader=lambda: tok, tokenizer_id="char", model="char", cache_dir=tmp_path / "c")
    assert str(path) in str(err.value)


def multimodal_row(text: str, *parts: dict) -> dict:
    content = [*parts, {"type": "text", "text": text}]
    return {"data_source": "demo", "prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": "4"}}


IMAGE_224 = {"type": "image", "width": 224, "height": 224}


def test_a_text_model_rejects_rows_with_images_as_training_does(tok, tmp_path):
    from tests.vlm import image

    image(30, 30).save(tmp_path / "a.png")
    readable = {"type": "image", "path": "a.png"}
    path = write_jsonl(tmp_path / "mm.jsonl", [multimodal_row("look", IMAGE_224, IMAGE_224), multimodal_row("see", readable),
                                               {"question": "q", "answer": "#### 1"}])
    report = audit([path], tok, config())
    assert [b.reason for b in report.bad_rows] == [
        "prompt[0].content[0] is an image part without 'image' or 'path' (keys: height, type, width)",
        "a row with images needs a vision-language model.path (this model has no image processor)"]
    m = report.multimodal
    assert (m.num_rows, m.num_images, m.processor, m.vision_tokens.num_rows) == (2, 3, None, 0)
    assert "packrl train rejects them" in m.training and "set model.path (or --model) to a vision-language model" in m.training
    assert any(p.startswith("1 row(s) with images") and "set model.path (or --model) to a vision-language model" in p
               for p in report.problems)
    assert not report.read_image_files  # a text model opens no image: the report can be cached
    with pytest.raises(ValueError, match="needs a vision-language model.path"):
        PromptDataset.build([path], tok, config().data, seed=0, split="train", key="data.train_files")


def test_json_has_the_documented_keys_and_round_trips(tok, tmp_path):
    path = write_jsonl(tmp_path / "mm.jsonl", [multimodal_row("x", IMAGE_224), {"question": "q", "answer": "#### 1"}])
    report = audit([path], tok, config())
    data = json.loads(report.to_json())
    assert set(data) == AUDIT_KEYS
    import packrl.inspect.audit as module

    assert all(f"    {key}" in module.__doc__ or f", {key}" in module.__doc__ for key in AUDIT_KEYS)
    assert set(data["policies"]) == {"filter", "left", "right", "middle", "error"}
    assert set(data["prompt_tokens"]) == {"num_rows", "p50", "p90", "p95", "p99", "max", "mean", "histogram"}
    assert set(data["suggested"]) == {"data.max_prompt_tokens", "train.max_tokens_per_microbatch", "rule"}
    again = type(report).from_dict(data)
    assert dataclasses.replace(again, read_image_files=report.read_image_files) == report


def test_text_report_shows_the_numbers(tok, ten_rows):
    text = audit([ten_rows], tok, config()).to_text()
    for needle in ("p99", "6 row(s) over the budget, row numbers: 4, 5, 6, 7, 8, 9", "data.max_prompt_tokens=", "rows/s", "*filter"):
        assert needle in text


def test_html_is_self_contained_with_the_histogram(tok, ten_rows, tmp_path):
    mm = write_jsonl(tmp_path / "mm.jsonl", [multimodal_row("x" * 80, IMAGE_224), "{bad"])
    page = render_html(audit([ten_rows, mm], tok, config()))
    assert page.startswith("<!DOCTYPE html>") and "Plotly.newPlot" in page and "prompt tokens: histogram" in page
    assert "Multimodal rows: 1 (1 images)" in page and "Bad rows: 2" in page
    assert "<script src=" not in page and "<link" not in page and "@import" not in page  # plotly.js inlined: nothing fetched


def test_cache_hits_and_misses(tok, ten_rows, tmp_path):
    loads = []

    def loader():
        loads.append(1)
        return tok

    def run(cfg):
        return audit_sources([ten_rows], cfg, tokenizer_loader=loader, tokenizer_id="char-v1", model="char", cache_dir=tmp_path / "cache")

    first, second = run(config()), run(config())
    assert (first.cached, second.cached, len(loads)) == (False, True, 1)
    assert dataclasses.replace(second, cached=False, wall_s=0, rows_per_s=0) == dataclasses.replace(first, wall_s=0, rows_per_s=0)
    assert not run(config(max_prompt_tokens=61)).cached and len(loads) == 2
    with open(ten_rows, "a") as f:
        f.write(json.dumps({"question": "new", "answer": "#### 3"}) + "\n")
    changed = run(config())
    assert not changed.cached and changed.num_rows == 11 and len(loads) == 3
    assert run(config()).cached
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".json")] == []  # no temp files left


def test_multimodal_parquet_rows_with_struct_parts(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    row = multimodal_row("What?", {"type": "image", "path": "cat.png"}) | {"extra_info": {"answer": "It is 4.\n#### 4"}}
    row["prompt"] = [system, *row["prompt"]]
    path = tmp_path / "mm.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)  # parts become structs: absent keys read back as None
    report = audit([str(path)], tok, config())
    (only,) = report.multimodal.rows
    assert (only.status, only.num_images) == ("rejected", 1)  # read as a row with one image, then rejected: a text model
    assert only.reason.startswith("a row with images needs a vision-language model.path")
    assert report.num_bad_rows == 1 and report.answer_tokens is not None  # the row was read, so its answer counts


def test_suggestions_and_fixes_stay_within_the_model_context(tok, ten_rows):
    """The longest prompt is 224 tokens (p99 of ten rows), 256 rounded up; responses take 100."""
    longest = prompt_chars("q" * 200)
    assert longest == 224
    sources = load_examples([ten_rows], config().data, seed=0, split="train", key="DATA")
    tight = audit_rows(sources, tok, config(overlong_prompt="error"), progress=False, max_context_tokens=200)
    assert (tight.suggested.max_prompt_tokens, tight.suggested.max_tokens_per_microbatch) == (64, 256)
    assert tight.suggested.rule == (
        "p99 rounded up (256) does not fit: the model context 200 - rollout.max_response_tokens=100 leaves 100, so "
        "data.max_prompt_tokens = 64 and more than 1% of the rows are over it: set data.overlong_prompt=filter (drop "
        "them) or left/right/middle (cut them), or use a model with a longer context; train.max_tokens_per_microbatch = "
        "(64 + rollout.max_response_tokens=100) rounded up to a multiple of 256")
    assert tight.problems[0].endswith(
        "with data.overlong_prompt=error; pick another policy: no data.max_prompt_tokens fits a 224-token prompt (the "
        "model context 200 - rollout.max_response_tokens=100 leaves 100): set data.max_prompt_tokens <= 100 with "
        "data.overlong_prompt=filter (drop the longer prompts) or left/right/middle (cut them to the budget), or use a "
        "model whose context holds 324 tokens")
    roomy = audit_rows(sources, tok, config(overlong_prompt="error"), progress=False, max_context_tokens=400)
    assert roomy.suggested.max_prompt_tokens == 256  # 256 + 100 fits 400: the plain rule
    assert roomy.problems[0].endswith("raise data.max_prompt_tokens to >= 224 (the model context 400 - "
                                      "rollout.max_response_tokens=100 leaves 300), or pick another policy")
    none = audit_rows(sources, tok, config(), progress=False, max_context_tokens=100)
    assert none.suggested.max_prompt_tokens is None and none.suggested.rule.startswith("no prompt budget fits")


def _leaf_keys(value, prefix: str) -> list[str]:
    """Every dotted key under a config section (into its nested sections)."""
    out = []
    for f in dataclasses.fields(value):
        inner = getattr(value, f.name)
        out += _leaf_keys(inner, f"{prefix}{f.name}.") if dataclasses.is_dataclass(inner) else [f"{prefix}{f.name}"]
    return out


_VALUES = {"rollout.max_response_tokens": 101, "rollout.max_response_tokens_schedule": [[1, 50], [3, 100]],
           "train.max_vision_patches_per_microbatch": 999}
"""Values of keys the audit computes with; every other key takes a string no config holds (a key
is computed, never validated)."""


def _changed(cfg: RunConfig, key: str) -> RunConfig:
    """``cfg`` with ``key`` set to another value (`_VALUES`)."""
    *path, leaf = key.split(".")
    def put(section, names):
        if not names:
            return dataclasses.replace(section, **{leaf: _VALUES.get(key, f"changed {key}")})
        return dataclasses.replace(section, **{names[0]: put(getattr(section, names[0]), names[1:])})
    return put(cfg, path)


def test_the_cache_key_holds_every_data_option_and_every_other_value_the_audit_reads(ten_rows):
    """Derived, not listed: each key of the data section (a task's options, an option added
    later) and each other value the audit reads gives its own cache key."""
    cfg = config()
    base = cache_key([ten_rows], "char-v1", cfg)
    read = [*_leaf_keys(cfg.data, "data."), "model.path", "train.seed", "rollout.max_response_tokens",
            "rollout.max_response_tokens_schedule", "train.max_vision_patches_per_microbatch",
            "train.max_tokens_per_microbatch"]
    assert {"data.shapes.max_shapes", "data.shapes.num_rows", "data.char_count.max_count", "data.image.max_pixels"} <= set(read)
    keys = {key: cache_key([ten_rows], "char-v1", _changed(cfg, key)) for key in read}
    assert base not in keys.values() and len(set(keys.values())) == len(keys), [k for k, v in keys.items() if v == base]
    tools = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, multi_turn=MultiTurnConfig(tools=["calculator"])))
    assert cache_key([ten_rows], "char-v1", tools) != base  # the tool schemas every prompt renders with
    assert cache_key([ten_rows], "char-v1", _changed(cfg, "train.lr")) == base  # a value the audit does not read


def test_a_changed_task_shapes_option_re_audits(tok, tmp_path):
    loads = []

    def loader():
        loads.append(1)
        return tok

    def run(*overrides: str):
        cfg = load_config("demo", ["data.shapes.num_rows=3", "data.shapes.image_size=28", *overrides])
        return audit_sources(["task:shapes"], cfg, tokenizer_loader=loader, tokenizer_id="char-v1", model="char",
                             cache_dir=tmp_path / "cache")

    first, again = run(), run()
    assert (first.cached, again.cached, len(loads)) == (False, True, 1)
    fewer = run("data.shapes.max_shapes=1")
    assert not fewer.cached and len(loads) == 2
    more = run("data.shapes.num_rows=4")
    assert not more.cached and (first.num_rows, more.num_rows) == (3, 4)
