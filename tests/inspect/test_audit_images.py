"""packrl audit on rows with images, through a tiny random Qwen2-VL's processor: the counts per
policy are `PromptDataset.build`'s, the vision/text split sums to the prompt training builds (the
vision part counted independently from the ids), resized rows are truncated and filtered rows
filtered with training's reasons, an unreadable image is a bad row, and a text model.path makes
training reject the rows, which the audit says with the fix."""

from __future__ import annotations

import io
import json
import sys
from collections import Counter

import pytest

from packrl.config.grouped_caps import grouped_cap_limits
from packrl.config.schema import DataConfig, ImageConfig, RolloutConfig, RunConfig, TrainConfig
from packrl.data import PromptDataset, load_examples
from packrl.inspect.audit import audit_rows, audit_sources, cache_key
from packrl.inspect.audit_html import render_html
from tests.builders import write_jsonl
from tests.vlm import image, tiny_processor, vlm_tokenizer

MAX_PIXELS = 28 * 28 * 256  # a 448 x 448 image stays whole: 16 x 16 tokens
BUDGET = 300
"""data.max_prompt_tokens of these tests: rows 0 and 1 fit it, row 3 (a 448 x 448 image and long text) does not."""


@pytest.fixture(scope="module")
def processor(smollm_tokenizer):
    return tiny_processor(vlm_tokenizer(), max_pixels=MAX_PIXELS)


def chat_row(text: str, *paths: str, truth: str = "3") -> dict:
    """A row whose message content is a list of parts (images first, then the text)."""
    content = [{"type": "image", "path": p} for p in paths] + [{"type": "text", "text": text}]
    return {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": truth}, "data_source": "test/vision"}


def verl_row(text: str, images: list, truth: str = "2") -> dict:
    """verl's form: an ``images`` column, ``<image>`` markers in the text."""
    return {"prompt": [{"role": "user", "content": text}], "images": images, "reward_model": {"ground_truth": truth},
            "data_source": "test/vision", "extra_info": {"answer": f"There are {truth}.\n#### {truth}"}}


@pytest.fixture
def rows(tmp_path) -> str:
    """0: chat parts, one 448x448 image; 1: verl markers, a 224x224 and a 100x60 image; 2: a text
    row; 3: a 448x448 image and long text, over `BUDGET`; 4: an unreadable image file."""
    image(448, 448).save(tmp_path / "big.png")
    image(224, 224, seed=1).save(tmp_path / "mid.png")
    image(100, 60, seed=2).save(tmp_path / "small.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    return write_jsonl(tmp_path / "vision.jsonl", [
        chat_row("How many shapes?", "big.png"),
        verl_row("Left <image>, right <image>: how many?", [{"path": "mid.png"}, "small.png"]),
        {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
        chat_row("Count the shapes, and explain. " + "Think about every corner of the picture. " * 8, "big.png"),
        chat_row("And here?", "broken.png"),
    ])


def config(**data) -> RunConfig:
    data = {"instruction": "Solve.", "max_prompt_tokens": BUDGET, "batch_size": 1, "skip_bad_rows": True} | data
    return RunConfig(data=DataConfig(**data), rollout=RolloutConfig(max_response_tokens=64),
                     train=TrainConfig(max_tokens_per_microbatch=1024))


def audit(sources, encoder, cfg):
    return audit_rows(load_examples(sources, cfg.data, seed=0, split="train", key="DATA"), encoder, cfg, progress=False)


def build(sources, encoder, cfg) -> PromptDataset:
    return PromptDataset.build(sources, encoder, cfg.data, seed=0, split="train", key="data.train_files")


def statuses(accounting) -> tuple[int, int, int, int]:
    return accounting.num_kept, accounting.num_truncated, accounting.num_filtered, accounting.num_rejected


@pytest.mark.parametrize("policy", ["filter", "left", "right", "middle"])
def test_counts_per_policy_are_the_trainers(processor, rows, policy):
    cfg = config(overlong_prompt=policy)
    report = audit([rows], processor, cfg)
    trainer = build([rows], processor, cfg)
    outcome = report.policy(policy)
    assert (outcome.num_kept, outcome.num_truncated, outcome.num_filtered, outcome.num_rejected) == statuses(trainer.accounting)
    assert report.policy(policy).num_tokens_removed == trainer.accounting.num_tokens_removed
    p = report.prompt_tokens
    assert trainer.prompt_length_percentiles() == {"p50": p.p50, "p90": p.p90, "p95": p.p95, "p99": p.p99, "max": p.max}
    # the image rows alone: the rows of the trainer's accounting that have images
    mine = {o.row: o for o in trainer.accounting.outcomes if o.row in (0, 1, 3, 4)}
    image_policy = report.multimodal.policy_outcome(policy)
    counts = Counter(o.status for o in mine.values())
    assert (image_policy.num_kept, image_policy.num_truncated, image_policy.num_filtered, image_policy.num_rejected) == \
        (counts["kept"], counts["truncated"], counts["filtered"], counts["rejected"])
    assert [(r.row, r.status, r.reason) for r in report.multimodal.rows] == [(row, o.status, o.reason) for row, o in mine.items()]


def test_error_stops_training_as_the_trainer_does(processor, rows):
    cfg = config(overlong_prompt="error")
    report = audit([rows], processor, cfg)
    assert report.policy("error").stops_training and report.policy("error").rows == (3,)
    assert any("data.overlong_prompt=error" in p for p in report.problems)
    with pytest.raises(ValueError, match=r"row 3 \(.*\): \d+ tokens"):
        build([rows], processor, cfg)


def test_vision_and_text_tokens_sum_to_the_prompt_training_builds(processor, rows):
    cfg = config(overlong_prompt="middle")
    m = audit([rows], processor, cfg).multimodal
    trainer = build([rows], processor, cfg)
    prompts = {p.example.row: p for p in trainer.prompts}
    pad = processor.image_token_id
    assert (m.num_rows, m.num_images, m.processor is not None, m.policy) == (4, 5, True, "middle")
    sized = [r for r in m.rows if r.vision_tokens is not None]
    assert [r.row for r in sized] == [0, 1, 3]
    for r in sized:
        ids = prompts[r.row].prompt_ids
        assert r.vision_tokens + r.text_tokens == len(ids)
        assert r.vision_tokens == sum(t == pad for t in ids) + 2 * r.num_images  # placeholders + start/end markers
        assert r.image_sizes == prompts[r.row].part_sizes
    assert sized[0].image_sizes == ((448, 448),) and sized[0].vision_tokens == 16 * 16 + 2
    assert sized[1].image_sizes == ((224, 224), (112, 56)) and sized[1].num_images == 2
    assert m.total_tokens.max == max(len(prompts[r.row].prompt_ids) for r in sized)
    assert m.vision_tokens.num_rows == m.text_tokens.num_rows == 3
    sizes = {(s.width, s.height): s for s in m.image_sizes}
    big = sizes[(448, 448)]
    assert (big.vision_tokens, big.encoder_patches, big.num_images) == (258, 1024, 1)  # 16 x 16 tokens x 2^2 patches each
    assert (sizes[(224, 224)].vision_tokens, sizes[(224, 224)].encoder_patches) == (66, 256)
    assert sum(s.num_images for s in m.image_sizes) == 4 and m.num_sizes == len(m.image_sizes) == 4  # row 3's resized size too
    text = audit([rows], processor, cfg).to_text()
    assert "448x448 -> 258 tokens (markers included), 1,024 encoder patches; 1 images" in text


def test_an_overlong_row_is_resized_under_middle_and_filtered_under_filter(processor, rows):
    middle = audit([rows], processor, config(overlong_prompt="middle")).multimodal
    (row,) = [r for r in middle.rows if r.row == 3]
    assert row.status == "truncated" and "images resized" in row.reason and "text kept whole" in row.reason
    assert row.vision_tokens + row.text_tokens <= BUDGET and row.image_sizes[0][0] < 448
    assert [r.row for r in middle.changed] == [3]
    assert middle.policy_outcome("middle").num_truncated == 1 and middle.policy_outcome("middle").num_tokens_removed > 0
    filtered = audit([rows], processor, config(overlong_prompt="filter"))
    (row,) = [r for r in filtered.multimodal.rows if r.row == 3]
    assert row.status == "filtered" and f"data.max_prompt_tokens={BUDGET}" in row.reason and row.vision_tokens is None
    assert filtered.multimodal.policy_outcome("filter").num_filtered == 1
    assert "row 3: filtered:" in filtered.to_text()


def test_image_rows_are_not_bad_rows_but_an_unreadable_image_is(processor, rows):
    report = audit([rows], processor, config(skip_bad_rows=False))
    assert [(b.row, b.source_row) for b in report.bad_rows] == [(4, 4)]
    assert "broken.png" in report.bad_rows[0].reason and "not a readable image" in report.bad_rows[0].reason
    assert any("1 bad row(s)" in p and "data.skip_bad_rows=true" in p for p in report.problems)
    assert not any("vision-language" in p for p in report.problems)
    assert report.read_image_files  # the processor opened the files: not cached
    assert report.answer_tokens is not None and report.answer_tokens.num_rows == 2  # GSM8K answer + verl extra_info.answer


def test_max_image_tokens_resizes_before_the_budget(processor, rows):
    cfg = config(max_image_tokens=40, overlong_prompt="middle")
    m = audit([rows], processor, cfg).multimodal
    trainer = build([rows], processor, cfg)
    assert all(r.vision_tokens <= 40 for r in m.rows if r.vision_tokens is not None)
    assert (m.policy_outcome("middle").num_kept, m.policy_outcome("middle").num_truncated) == (3, 0)
    assert [(r.row, r.image_sizes) for r in m.rows if r.image_sizes] == [(p.example.row, p.part_sizes) for p in trainer.prompts
                                                                          if p.part_sizes]


def test_the_patch_budget_resizes_as_in_training(processor, rows):
    cfg = config(overlong_prompt="middle")
    cfg = RunConfig(data=cfg.data, rollout=cfg.rollout, train=TrainConfig(max_tokens_per_microbatch=1024,
                                                                           max_vision_patches_per_microbatch=400))
    report = audit([rows], processor, cfg)
    trainer = PromptDataset.build([rows], processor, cfg.data, seed=0, split="train", key="data.train_files",
                                  caps=grouped_cap_limits(cfg.train))
    assert (report.policy("middle").num_kept, report.policy("middle").num_truncated) == statuses(trainer.accounting)[:2]
    sized = [(r.row, r.image_sizes) for r in report.multimodal.rows if r.image_sizes]
    assert sized == [(p.example.row, p.part_sizes) for p in trainer.prompts if p.part_sizes]
    assert all(sum(w * h for w, h in sizes) // (14 * 14) <= 400 for _, sizes in sized)  # encoder patches of each row's images
    assert report.config["train.max_vision_patches_per_microbatch"] == 400
    assert "train.max_vision_patches_per_microbatch=400" in report.multimodal.training


def test_a_text_model_rejects_image_rows_and_the_audit_names_the_fix(rows, smollm_tokenizer):
    tokenizer = vlm_tokenizer()  # a text tokenizer: no image processor
    cfg = config(skip_bad_rows=False)
    report = audit([rows], tokenizer, cfg)
    reasons = {b.row: b.reason for b in report.bad_rows}
    assert sorted(reasons) == [0, 1, 3, 4]
    assert all(r.startswith("a row with images needs a vision-language model.path") for r in reasons.values())
    m = report.multimodal
    assert (m.num_rows, m.num_images, m.processor, m.geometry, m.image_sizes) == (4, 5, None, None, ())
    assert m.vision_tokens.num_rows == 0 and all(r.vision_tokens is None and r.status == "rejected" for r in m.rows)
    assert "set model.path (or --model) to a vision-language model" in m.training
    (problem,) = [p for p in report.problems if "row(s) with images" in p]
    assert problem.startswith("4 row(s) with images") and "set model.path (or --model) to a vision-language model" in problem
    assert "qwen2_vl" in problem
    assert not report.read_image_files  # nothing opened: a text model reads no image
    with pytest.raises(ValueError, match="needs a vision-language model.path"):
        build([rows], tokenizer, cfg)
    assert "set model.path (or --model) to a vision-language model" in report.to_text()


def test_parquet_rows_with_struct_parts_and_image_bytes(processor, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = io.BytesIO()
    image(56, 84).save(png, format="PNG")
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    row = chat_row("What?", "unused") | {"extra_info": {"answer": "It is 3.\n#### 3"}}
    row["prompt"] = [system, {"role": "user", "content": [{"type": "image", "image": {"bytes": png.getvalue()}},
                                                          {"type": "text", "text": "What?"}]}]
    path = tmp_path / "mm.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)  # parts become structs: absent keys read back as None
    cfg = config()
    report = audit([str(path)], processor, cfg)
    (only,) = report.multimodal.rows
    (prompt,) = build([str(path)], processor, cfg).prompts
    assert only.status == "kept" and only.vision_tokens + only.text_tokens == len(prompt.prompt_ids)
    assert only.image_sizes == ((56, 84),) and only.vision_tokens == 2 * 3 + 2
    assert report.answer_tokens is not None and not report.read_image_files  # bytes live in the data file


def test_without_pillow_an_image_row_is_a_bad_row_saying_how_to_install(processor, rows, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    report = audit([rows], processor, config())
    assert [b.row for b in report.bad_rows] == [0, 1, 3, 4]
    assert all("pip install 'packrl[vision]'" in b.reason for b in report.bad_rows)


def test_json_round_trips_and_html_shows_the_sizes(processor, rows):
    report = audit([rows], processor, config(overlong_prompt="middle"))
    data = json.loads(report.to_json())
    m = data["multimodal"]
    assert set(m) == {"num_rows", "num_images", "policy", "vision_tokens", "text_tokens", "total_tokens", "image_sizes",
                      "num_sizes", "policies", "rows", "changed", "processor", "geometry", "training"}
    assert m["geometry"] == {"factor": 28, "merge": 2, "min_pixels": 56 * 56, "max_pixels": MAX_PIXELS, "extra_tokens": 2}
    assert data["schema"] == 3 and data["config"]["data.max_image_tokens"] is None and "data.image.max_pixels" in data["config"]
    import packrl.inspect.audit as module

    assert all(key in module.__doc__ for key in m)
    again = type(report).from_dict(data)
    assert again.multimodal == report.multimodal
    page = render_html(report)
    assert "Multimodal rows: 4 (5 images)" in page and "<td>448x448</td><td>258</td><td>1,024</td>" in page


def test_cache_key_holds_the_processor_and_the_image_settings(rows):
    key = cache_key([rows], "tok", config(), "processor-1")
    assert key == cache_key([rows], "tok", config(), "processor-1")
    others = [cache_key([rows], "tok", config(), "processor-2"), cache_key([rows], "tok", config(), None),
              cache_key([rows], "tok", config(max_image_tokens=100), "processor-1"),
              cache_key([rows], "tok", config(image=ImageConfig(max_pixels=28 * 28 * 64)), "processor-1"),
              cache_key([rows], "tok", config(image=ImageConfig(min_pixels=28 * 28 * 8)), "processor-1"),
              cache_key([rows], "tok", config(image=ImageConfig(max_images_per_row=1)), "processor-1")]
    assert len({key, *others}) == 1 + len(others)


def test_a_report_that_read_image_files_is_not_cached(processor, rows, tmp_path):
    def run():
        return audit_sources([rows], config(), tokenizer_loader=lambda: processor, tokenizer_id="t", processor_id="p",
                             model="tiny", cache_dir=tmp_path / "cache")

    assert not run().cached and not run().cached
