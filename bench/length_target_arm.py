"""The `target_length` arm of `bench/bench_length_control.py` (``--target-steps``): prompts that ask
for a length (L1-Exact), adherence ``|len - N| / N`` on held-out prompts before and after training.

Each row's target is drawn from 1.0-2.5x the tokens of its shortest correct answer (a length a
correct answer can have). The rows are drawn with the run's own ``data.char_count`` and
``train.seed`` (the bench's overrides included), so the target data is the run's data.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packrl.config import load_config
from packrl.data.char_count import shortest_correct_response, split_rows

TARGET_TEMPLATE = " Answer in {target} tokens."


def target_rows(overrides: list[str], preset: str, split: str, tokenizer: Any, path: Path) -> None:
    """``task:char_count`` rows of ``split`` (the run's config: ``preset`` with ``overrides``) with a
    ``target_tokens`` column, written to ``path`` as jsonl."""
    cfg = load_config(preset, overrides)
    rng = random.Random(cfg.train.seed)
    with path.open("w") as f:
        for row in split_rows(cfg.data.char_count, cfg.train.seed, split):
            _, shortest = shortest_correct_response(row["question"], tokenizer)
            f.write(json.dumps(row | {"target_tokens": int(shortest * rng.uniform(1.0, 2.5))}) + "\n")


def adherence(run: dict[str, Any], path: Path) -> float:
    """Mean ``|tokens - target| / target`` of an evaluation's rows (targets read from ``path``)."""
    targets = [json.loads(line)["target_tokens"] for line in path.read_text().splitlines()]
    return statistics.mean(abs(r["tokens"] - targets[r["row"]]) / targets[r["row"]] for r in run["rows"])


def target_arm(base: list[str], checkpoint: str, steps: int, out: Path, preset: str,
               arm: Callable[[str, list[str], int, Path], dict[str, Any]]) -> dict[str, Any]:
    """Adherence before and after ``steps`` steps of `target_length` (alpha 0.005) from ``checkpoint``;
    ``arm`` trains and evaluates (`bench.bench_length_control._arm`)."""
    from transformers import AutoTokenizer

    from bench.bench_length_control import _evaluate

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    data = out / "target_data"
    data.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        target_rows(base, preset, split, tokenizer, data / f"{split}.jsonl")
    targets = [f"data.train_files=[{data / 'train.jsonl'}]", f"data.val_files=[{data / 'val.jsonl'}]",
               "data.length_target.column=target_tokens", f"data.length_target.template={TARGET_TEMPLATE}"]
    before = _evaluate([*base, *targets, f"model.path={checkpoint}"])
    after = arm("target_length", [*base, *targets, "reward.shaping.target_length.alpha=0.005", f"model.path={checkpoint}"], steps, out)
    val = data / "val.jsonl"
    return {"adherence_before": adherence(before, val), "adherence_after": adherence(after, val),
            "before": {k: v for k, v in before.items() if k != "rows"}, "after": {k: v for k, v in after.items() if k != "rows"}}
