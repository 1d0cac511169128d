"""Rows with images: read through the model's processor, every image token inside the prompt
budget, images resized (never cut) to fit, bad images counted and named."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from packrl.config.schema import DataConfig, ImageConfig
from packrl.data.dataset import PromptDataset
from packrl.data.examples import to_example
from packrl.data.images import ImageGeometry, fit_sizes
from packrl.data.shapes import shapes_rows
from tests.vlm import image, tiny_processor, vlm_tokenizer


@pytest.fixture(scope="module")
def processor(smollm_tokenizer):
    return tiny_processor(vlm_tokenizer(), max_pixels=28 * 28 * 256)


def _png(width: int, height: int, seed: int = 0) -> bytes:
    out = io.BytesIO()
    image(width, height, seed).save(out, format="PNG")
    return out.getvalue()


def _row(content: str, images: list, truth: str = "3") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images, "reward_model": {"ground_truth": truth},
            "data_source": "test/vision"}


def _build(tmp_path, rows, processor, max_image_patches=None, **data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packrl.config.grouped_caps import grouped_cap_limits
    from packrl.config.schema import TrainConfig

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = DataConfig(train_files=[str(path)], batch_size=1, **({"max_prompt_tokens": 512} | data))
    return PromptDataset.build(cfg.train_files, processor, cfg, seed=0, split="train", key="data.train_files",
                               caps=grouped_cap_limits(TrainConfig(max_vision_patches_per_microbatch=max_image_patches)))


def test_image_tokens_count_in_the_prompt_and_match_the_images(tmp_path, processor):
    rows = [_row("<image>How many?", [{"bytes": _png(100, 60)}]),
            _row("Two: <image> and <image>.", [{"bytes": _png(40, 150)}, {"bytes": _png(64, 64, 1)}]), _row("No image here.", [])]
    dataset = _build(tmp_path, rows, processor)
    assert dataset.accounting.num_kept == 3
    batch = dataset.batch(range(3))
    pad = processor.image_token_id
    for ids, images in zip(batch.prompt_ids, batch.extra_inputs):
        held = sum(t == pad for t in ids)
        assert held == (0 if images is None else images.num_tokens)
    assert batch.extra_inputs[0].num_images == 1 and batch.extra_inputs[1].num_images == 2 and batch.extra_inputs[2] is None
    assert batch.extra_inputs[0].num_tokens > 0 and len(batch.prompt_ids[0]) > batch.extra_inputs[0].num_tokens


def test_max_image_tokens_resizes_before_the_budget(tmp_path, processor):
    rows = [_row("<image>How many?", [{"bytes": _png(448, 448)}])]
    big = _build(tmp_path, rows, processor).batch([0]).extra_inputs[0]
    capped = _build(tmp_path, rows, processor, max_image_tokens=40)
    small = capped.batch([0]).extra_inputs[0]
    assert big.num_tokens == 256 and small.num_tokens + 2 <= 40  # 2 markers around the placeholders
    assert capped.accounting.outcomes[0].status == "kept"


def test_an_overlong_image_prompt_is_resized_or_filtered_never_cut(tmp_path, processor):
    rows = [_row("<image>" + "word " * 30, [{"bytes": _png(448, 448)}])]
    full = _build(tmp_path, rows, processor).batch([0])
    budget = len(full.prompt_ids[0]) - 100  # room for the text and a smaller image
    resized = _build(tmp_path, rows, processor, max_prompt_tokens=budget, overlong_prompt="right")
    outcome = resized.accounting.outcomes[0]
    assert outcome.status == "truncated" and "images resized" in outcome.reason and outcome.num_tokens_removed > 0
    batch = resized.batch([0])
    assert len(batch.prompt_ids[0]) <= budget
    assert sum(t == processor.image_token_id for t in batch.prompt_ids[0]) == batch.extra_inputs[0].num_tokens
    small = _row("<image>Count.", [{"bytes": _png(56, 56)}])
    filtered = _build(tmp_path, [*rows, small], processor, max_prompt_tokens=budget, overlong_prompt="filter")
    assert [o.status for o in filtered.accounting.outcomes] == ["filtered", "kept"]
    text_only = len(full.prompt_ids[0]) - full.extra_inputs[0].num_tokens - 2
    with pytest.raises(ValueError, match="no usable prompt"):  # not even the smallest image fits: filtered, never cut
        _build(tmp_path, rows, processor, max_prompt_tokens=text_only + 3, overlong_prompt="middle")


def test_bad_images_are_counted_and_named(tmp_path, processor):
    rows = [_row("<image>a", [{"bytes": b"not an image"}]), _row("<image>b", [{"path": "missing.png"}]),
            _row("<image><image>c", [{"bytes": _png(40, 40)}]), _row("<image>" * 3 + "d", [{"bytes": _png(40, 40)}] * 3),
            _row("<image>e", [{"bytes": _png(2000, 5)}]), _row("<image>ok", [{"bytes": _png(40, 40)}])]
    dataset = _build(tmp_path, rows, processor, skip_bad_rows=True, image=ImageConfig(max_images_per_row=2))
    reasons = [o.reason for o in dataset.accounting.outcomes]
    assert [o.status for o in dataset.accounting.outcomes] == ["rejected"] * 5 + ["kept"]
    assert "not a readable image" in reasons[0] and "does not exist" in reasons[1]
    assert "2 <image> marker(s) for 1 image(s)" in reasons[2] and "3 images > data.image.max_images_per_row=2" in reasons[3]
    assert "aspect ratio over 200" in reasons[4]
    with pytest.raises(ValueError, match="not a readable image"):
        _build(tmp_path, rows, processor, image=ImageConfig(max_images_per_row=2))


def test_jsonl_images_as_base64_and_empty_files(tmp_path, processor):
    import base64
    import json

    (tmp_path / "empty.png").write_bytes(b"")
    rows = [_row("<image>a", [{"bytes": base64.b64encode(_png(40, 40)).decode()}]), _row("<image>b", [{"bytes": "%%%"}]),
            _row("<image>c", [{"path": "empty.png"}]), _row("<image>d", [{"bytes": ""}])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=[str(path)], batch_size=1, max_prompt_tokens=512, skip_bad_rows=True)
    dataset = PromptDataset.build(cfg.train_files, processor, cfg, seed=0, split="train", key="data.train_files")
    reasons = [o.reason for o in dataset.accounting.outcomes]
    assert [o.status for o in dataset.accounting.outcomes] == ["kept"] + ["rejected"] * 3
    assert "not base64" in reasons[1] and "is empty (0 bytes)" in reasons[2] and "empty bytes" in reasons[3]
    with pytest.raises(ValueError, match=r"row 1 \(.*rows.jsonl line 2\): image 0: an image's 'bytes' is text that is not base64"):
        PromptDataset.build(cfg.train_files, processor, replace(cfg, skip_bad_rows=False), seed=0, split="train",
                            key="data.train_files")


def test_a_patch_budget_that_fits_no_image_names_its_key(tmp_path, processor):
    rows = [_row("<image>a", [{"bytes": _png(40, 40)}])]
    with pytest.raises(ValueError, match=r"no usable prompt .*raise train.max_vision_patches_per_microbatch"):
        _build(tmp_path, rows, processor, max_image_patches=1)


def test_image_rows_need_a_vision_model(tmp_path, smollm_tokenizer):
    with pytest.raises(ValueError, match="needs a vision-language model.path"):
        _build(tmp_path, [_row("<image>a", [{"bytes": _png(40, 40)}])], smollm_tokenizer)


def test_chat_parts_and_relative_paths(tmp_path):
    image(30, 30).save(tmp_path / "a.png")
    raw = {"prompt": [{"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "Count."}]}],
           "reward_model": {"ground_truth": "1"}, "data_source": "x"}
    example = to_example(raw, row=0, instruction="", system_prompt=None, base_dir=tmp_path)
    assert example.chat[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Count."}]
    assert example.images[0].path == tmp_path / "a.png"


def test_fit_sizes_shrinks_all_images_to_the_budget(processor):
    geometry = ImageGeometry.of(processor, ImageConfig())
    sizes = fit_sizes([(448, 448), (224, 112)], geometry, 60)
    assert sizes is not None and sum(geometry.tokens(w, h) + 2 for w, h in sizes) <= 60
    assert all(w % 28 == 0 and h % 28 == 0 for w, h in sizes)
    assert fit_sizes([(448, 448)] * 8, geometry, 20) is None  # 8 images x (4 + 2) tokens at least


def test_task_shapes_rows_are_seeded_and_answered_by_the_image():
    rows = shapes_rows(6, 5, 112, seed=3)
    assert rows == shapes_rows(6, 5, 112, seed=3)
    assert len({r["prompt"][0]["content"] for r in rows}) == 1  # the text is the same: the count is in the image
    assert all(1 <= int(r["reward_model"]["ground_truth"]) <= 5 for r in rows)
    assert len({r["images"][0]["bytes"] for r in rows}) == 6


def test_markers_with_an_empty_images_field_are_a_bad_row():
    for images in ([], None):
        raw = _row("<image>x", images)
        assert to_example(raw, row=0, instruction="", system_prompt=None) == \
            "1 <image> marker(s) for 0 image(s) in field 'images'; give one image per marker"
    text = {k: v for k, v in _row("a <image> tag in text", []).items() if k != "images"}
    assert not isinstance(to_example(text, row=0, instruction="", system_prompt=None), str)  # no images field: text


def test_rows_with_the_same_text_and_other_images_are_not_duplicates(tmp_path, processor):
    rows = [_row("<image>How many?", [{"bytes": _png(56, 56, seed)}]) for seed in (0, 1, 0)]
    assert _build(tmp_path, rows, processor).duplicates == {2: 0}


def test_rows_no_image_cap_can_hold_name_the_cap(tmp_path, processor):
    with pytest.raises(ValueError, match="raise data.max_image_tokens"):
        _build(tmp_path, [_row("<image>a", [{"bytes": _png(56, 56)}])], processor, max_image_tokens=3)


def test_the_patch_budget_resizes_a_rows_images_to_fit_one_micro_batch(tmp_path, processor):
    rows = [_row("Two: <image> and <image>.", [{"bytes": _png(448, 448)}, {"bytes": _png(300, 200, 1)}])]
    full = _build(tmp_path, rows, processor).batch([0]).extra_inputs[0]
    capped = _build(tmp_path, rows, processor, max_image_patches=400)
    small = capped.batch([0]).extra_inputs[0]
    assert full.num_patches > 400 >= small.num_patches and small.num_images == 2
    assert small.num_patches == small.num_tokens * 4  # merge 2 x 2
    assert capped.accounting.outcomes[0].status == "kept"  # asked for, as data.max_image_tokens


def test_overlong_error_names_image_rows_whose_images_cannot_fit(tmp_path, processor):
    rows = [_row("<image>a", [{"bytes": _png(56, 56)}]), _row("word " * 200, [])]
    with pytest.raises(ValueError) as err:
        _build(tmp_path, rows, processor, max_prompt_tokens=64, max_image_tokens=3, overlong_prompt="error")
    message = str(err.value)
    assert "row 0" in message and "data.max_image_tokens=3" in message and "row 1" in message
    assert "raise data.max_prompt_tokens to >=" in message and "raise data.max_image_tokens" in message


def test_an_image_row_one_token_over_keeps_its_aspect_ratio_and_loses_one_row_of_tokens(tmp_path, processor):
    """A 1148 x 56 image (20.5:1) is 41 x 2 tokens of 28 pixels. One token over the budget, the
    largest grid near 20.5:1 that fits is 40 x 2 (20:1, 80 tokens); 81 tokens have no grid of
    that shape (81 x 1, 27 x 3, 9 x 9)."""
    rows = [_row("<image>How wide?", [{"bytes": _png(1148, 56)}])]
    full = _build(tmp_path, rows, processor).batch([0])
    assert full.extra_inputs[0].num_tokens == 82
    budget = len(full.prompt_ids[0]) - 1
    fitted = _build(tmp_path, rows, processor, max_prompt_tokens=budget, overlong_prompt="right")
    outcome = fitted.accounting.outcomes[0]
    assert outcome.status == "truncated" and outcome.num_tokens_removed == 2
    assert outcome.reason == f"{budget + 1} -> {budget - 1} tokens (images resized to 1120x56; text kept whole)"
    assert fitted.prompts[0].part_sizes == ((1120, 56),)
    assert fitted.batch([0]).extra_inputs[0].num_tokens == 80


@pytest.mark.parametrize("size", [(1148, 56), (56, 1148), (1000, 50), (640, 480), (300, 1000)])
def test_fit_sizes_keeps_the_aspect_ratio_and_shrinks_no_more_than_needed(processor, size):
    """Against a brute force over every token grid: the grids a common scale s can give by
    rounding each side (|w - W s| <= 14 and |h - H s| <= 14 pixels, or a side of one token when
    its scaled side is under half a token), no larger than the unshrunk grid; the fitted grid
    must be one of them and hold the most tokens any of them fits in the budget."""
    geometry = ImageGeometry.of(processor, ImageConfig())
    f, (width, height) = 28, size
    unshrunk = geometry.resized(width, height)  # 640 x 480 is over max_pixels: 504 x 364 (18 x 13 tokens)

    def scales(pixels: int, side: int) -> tuple[float, float]:  # the s that round side * s to pixels
        return (0.0 if pixels == f else (pixels - f / 2) / side), (pixels + f / 2) / side

    def reachable(w: int, h: int) -> bool:
        (lo_w, hi_w), (lo_h, hi_h) = scales(w, width), scales(h, height)
        return max(lo_w, lo_h) <= min(hi_w, hi_h)

    grids = [(gw * f, gh * f) for gw in range(1, unshrunk[0] // f + 1) for gh in range(1, unshrunk[1] // f + 1)
             if reachable(gw * f, gh * f) and gw * gh * f * f >= geometry.min_pixels]
    full = geometry.tokens(*unshrunk) + 2
    for budget in (full - 1, full - 5, full // 2, full // 4):
        fitted = fit_sizes([size], geometry, budget)
        best = max(geometry.tokens(w, h) for w, h in grids if geometry.tokens(w, h) + 2 <= budget)
        assert fitted is not None and fitted[0] in grids, (budget, fitted)
        assert geometry.tokens(*fitted[0]) == best, (budget, fitted, best)
