"""The built-in tasks make the same rows for a fixed seed: the sha256 of every row each one makes
(train and val, through `load_examples`, the path training and the audit take, and its SFT traces)
is pinned here, so a change to how a task is found or called cannot change its rows unseen.

The text tasks draw from Python's `random.Random` (stable across versions for an int or str
seed); `task:shapes` rows hold PNG bytes whose encoding depends on Pillow and zlib, so its pinned
hash covers the text and the ground truths, and its images are compared with `shapes_rows`.
"""

from __future__ import annotations

import hashlib

import pytest

from packrl.config import load_config
from packrl.data import load_examples
from packrl.data.char_count_traces import char_count_trace_rows
from packrl.data.shapes import shapes_rows
from packrl.data.tasks import VAL_SEED_OFFSET
from packrl.data.tool_traces import tool_trace_rows

TEXT_TASKS = {
    ("task:arithmetic", "train"): "178f052333e4",
    ("task:arithmetic", "val"): "90cf75e24c1a",
    ("task:char_count", "train"): "05e88f0ae5e9",
    ("task:char_count", "val"): "79ab33d85312",
}
"""(source, split) -> the first 12 hex digits of the sha256 of its examples (`_digest`)."""

OVERRIDES = ["data.arithmetic.num_rows=40", "data.arithmetic.digits=2", "data.arithmetic.num_operands=3",
             "data.arithmetic.operators=+-*", "data.char_count.num_rows=30", "data.char_count.max_count=2",
             "data.shapes.num_rows=5", "data.shapes.max_shapes=4", "data.shapes.image_size=56",
             "sft.num_rows=12", "sft.redundancy=0.5", "sft.train_files=[task:char_count_traces]",
             "sft.trace_style=verbose", "train.seed=11"]


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


def _examples(source: str, split: str) -> list[tuple]:
    cfg = load_config("demo", OVERRIDES)
    loaded = load_examples([source], cfg.data, seed=cfg.train.seed, split=split, key="data.train_files")
    assert not loaded.bad
    return [(e.chat, e.ground_truth, e.data_source, e.row, e.extra_info, e.length_target) for e in loaded.examples]


@pytest.mark.parametrize(("source", "split"), sorted(TEXT_TASKS))
def test_a_text_task_makes_the_same_examples_for_a_fixed_seed(source, split):
    assert _digest(_examples(source, split)) == TEXT_TASKS[source, split]


@pytest.mark.parametrize("split", ["train", "val"])
def test_task_shapes_makes_the_same_rows_for_a_fixed_seed(split):
    cfg = load_config("demo", OVERRIDES)
    loaded = load_examples(["task:shapes"], cfg.data, seed=11, split=split, key="data.train_files")
    seed = 11 if split == "train" else 11 + VAL_SEED_OFFSET
    assert list(loaded.raw_rows) == shapes_rows(5, 4, 56, seed)
    text = [(e.chat, e.ground_truth, e.data_source, e.row, len(e.images)) for e in loaded.examples]
    assert _digest(text) == {"train": "d17188060d53", "val": "b2939d21640e"}[split]


def test_the_built_in_traces_are_the_same_for_a_fixed_seed():
    cfg = load_config("demo", OVERRIDES)
    assert _digest(tool_trace_rows(cfg.data, cfg.sft.num_rows, cfg.train.seed)) == "f780ae4b755d"
    assert _digest(char_count_trace_rows(cfg.data, cfg.sft, cfg.train.seed)) == "5be9dc8cf031"
