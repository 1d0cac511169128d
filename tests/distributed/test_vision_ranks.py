"""A vision-language policy on 2 Ray + FSDP2 ranks (gloo on this CPU): micro-batches with images on
one rank and text-only ones on the other do not hang (the idle rank runs the vision tower on a
blank image times 0, `packrl.models.vision._idle_vision`), and the run trains as one process does,
vision tower included."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray and worker processes

from packrl.config import load_config  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from tests.builders import LAYOUT, RAY_COMMON, metric_lines  # noqa: E402
from tests.same_training import assert_same_training  # noqa: E402
from tests.vlm import image, save_tiny_vlm  # noqa: E402

IMAGE_ROWS = [(112, 112), (56, 84), (140, 56), (84, 84)]
"""Sizes of the image rows; as many text-only rows are interleaved with them."""


def _png(width: int, height: int, seed: int) -> bytes:
    out = io.BytesIO()
    image(width, height, seed).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, smollm_tokenizer):
    """``(model dirs by family, parquet of 4 image rows and 4 text rows)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("vision-ranks")
    rows = []
    for k, (w, h) in enumerate(IMAGE_ROWS):
        for images in ([{"bytes": _png(w, h, k)}], []):
            text = "<image>How many shapes?" if images else f"Say a word with the letter e, {k}."
            rows.append({"prompt": [{"role": "user", "content": text}], "images": images,
                         "reward_model": {"ground_truth": "3"}, "data_source": "test/vision"})
    path = root / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return {family: save_tiny_vlm(root / family, family=family) for family in ("qwen2_vl", "qwen3_vl")}, path


def _run(out, model_dir, data, workers: int, freeze: bool):
    cfg = load_config("vision_demo", [f"train.out_dir={out}", f"model.path={model_dir}", f"trainer.num_workers={workers}",
                                      *RAY_COMMON, *LAYOUT, f"data.train_files=[{data}]", "data.batch_size=4", "rollout.n=2",
                                      "train.total_steps=2", "data.max_prompt_tokens=96", "train.max_tokens_per_microbatch=120",
                                      "train.mini_batch_size=2", f"model.freeze_vision_tower={str(freeze).lower()}"])
    return train(cfg)


@pytest.mark.parametrize(("family", "freeze"), [("qwen2_vl", True), ("qwen2_vl", False), ("qwen3_vl", False)])
def test_mixed_image_and_text_microbatches_train_on_two_ranks_as_in_one_process(tmp_path, mixed, family, freeze):
    """Mini-batches of 2 prompts (4 sequences) over 2 ranks: an image prompt's responses on one rank
    and a text prompt's on the other; a trainable tower too (its text-only steps: a zero gradient,
    Qwen3-VL's deepstack mergers included)."""
    model_dirs, data = mixed
    model_dir = model_dirs[family]
    one = _run(tmp_path / "one", model_dir, data, 1, freeze)
    two = _run(tmp_path / "two", model_dir, data, 2, freeze)
    lines = metric_lines(two)
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["seqlen/num_microbatches"] >= 2 for line in lines)  # several micro-batches a rank: some without images
    assert all(0 < line["prompt_length/num_images/mean"] < 1 for line in lines)  # image and text prompts in every step
    assert_same_training(one / "checkpoints" / "step_2", two / "checkpoints" / "step_2")
