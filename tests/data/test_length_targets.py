"""data.length_target: each prompt asks for its length through the chat template and the prompt
budget, drawn per row (seeded) or read from a column; a bad column value is a bad row."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from packrl.config import load_config
from packrl.data.dataset import PromptDataset


def _dataset(tok, overrides, files=None):
    cfg = load_config("demo", [*overrides, *(["data.train_files=[" + str(files) + "]"] if files else [])])
    return cfg, PromptDataset.build(cfg.data.train_files, tok, cfg.data, seed=cfg.train.seed, split="train", key="data.train_files")


def test_drawn_targets_are_written_into_the_prompt_and_travel_with_it(smollm_tokenizer):
    over = ["data.length_target.min_tokens=10", "data.length_target.max_tokens=60"]
    _, ds = _dataset(smollm_tokenizer, over)
    batch = ds.batch([0, 1, 2, 3])
    assert batch.length_targets is not None and all(10 <= n <= 60 for n in batch.length_targets)
    for ids, n in zip(batch.prompt_ids, batch.length_targets):
        assert f"Think for {n} tokens." in smollm_tokenizer.decode(ids)  # inside the user turn, through the chat template
    _, again = _dataset(smollm_tokenizer, over)
    assert again.batch([0, 1, 2, 3]).length_targets == batch.length_targets  # seeded per row
    _, plain = _dataset(smollm_tokenizer, [])
    assert plain.batch([0]).length_targets is None
    assert len(plain.batch([0]).prompt_ids[0]) < len(batch.prompt_ids[0])  # the request counts in the prompt's tokens


def test_a_column_gives_each_row_its_target_and_a_bad_value_is_a_bad_row(tmp_path, smollm_tokenizer):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2", "target_tokens": 30},
            {"question": "What is 2 + 2?", "answer": "#### 4", "target_tokens": "many"},
            {"question": "What is 3 + 3?", "answer": "#### 6", "target": 30},
            {"question": "What is 4 + 4?", "answer": "#### 8", "target_tokens": 65}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    over = ["data.length_target.column=target_tokens", "data.length_target.template=Answer in {target} tokens.", "data.skip_bad_rows=true",
            "data.batch_size=1"]
    cfg, ds = _dataset(smollm_tokenizer, over, files=path)
    assert len(ds) == 2 and ds.batch([0]).length_targets == (30,)  # a target over the response budget: no budget given here
    assert "Answer in 30 tokens." in smollm_tokenizer.decode(ds.batch([0]).prompt_ids[0])
    reasons = json.dumps(ds.accounting_dict())
    assert "data.length_target.column" in reasons and "'many'" in reasons
    assert "no field 'target_tokens' (data.length_target.column); the row's fields: 'question', 'answer', 'target'" in reasons
    budgeted = PromptDataset.build(cfg.data.train_files, smollm_tokenizer, cfg.data, seed=0, split="train", key="data.train_files",
                                   max_target_tokens=cfg.rollout.max_response_tokens)
    reasons = json.dumps(budgeted.accounting_dict())
    assert len(budgeted) == 1 and "is 65 > the response budget 64 (rollout.max_response_tokens" in reasons


def test_length_target_config_checks():
    from packrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.length_target.column='t': is set together with data.length_target.min_tokens"):
        load_config("demo", ["data.length_target.column=t", "data.length_target.min_tokens=4", "data.length_target.max_tokens=8"])
    with pytest.raises(ConfigError, match=r"data.length_target.min_tokens=4: is set but data.length_target.max_tokens is not"):
        load_config("demo", ["data.length_target.min_tokens=4"])
    with pytest.raises(ConfigError, match=r"data.length_target.template='Answer briefly.': does not hold \{target\}"):
        load_config("demo", ["data.length_target.column=t", "data.length_target.template=Answer briefly."])
    with pytest.raises(ConfigError, match=r"data.length_target.mode_column='mode': has no effect: data.length_target sets no target"):
        load_config("demo", ["data.length_target.mode_column=mode"])
    with pytest.raises(ConfigError, match=r"data.length_target.max_template='Be brief.': does not hold \{target\}"):
        load_config("demo", ["data.length_target.column=t", "data.length_target.mode_column=mode",
                             "data.length_target.max_template=Be brief."])


def test_a_mode_column_asks_each_row_its_way_and_the_mode_travels_with_the_prompt(tmp_path, smollm_tokenizer):
    """L1-Max's mix: a max row is asked "Think for maximum N tokens.", an exact row "Think for N tokens."."""
    from packrl.types import PromptBatch

    path = tmp_path / "rows.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2", "n": 30, "mode": "max"},
            {"question": "What is 2 + 2?", "answer": "#### 4", "n": 20, "mode": "exact"},
            {"question": "What is 3 + 3?", "answer": "#### 6", "n": 20, "mode": "short"},
            {"question": "What is 4 + 4?", "answer": "#### 8", "n": 20}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    over = ["data.length_target.column=n", "data.length_target.mode_column=mode", "data.skip_bad_rows=true", "data.batch_size=1"]
    _, ds = _dataset(smollm_tokenizer, over, files=path)
    batch = ds.batch([0, 1])
    assert len(ds) == 2 and batch.length_targets == (30, 20) and batch.length_modes == ("max", "exact")
    texts = [smollm_tokenizer.decode(ids) for ids in batch.prompt_ids]
    assert "Think for maximum 30 tokens." in texts[0] and "Think for 20 tokens." in texts[1] and "maximum" not in texts[1]
    reasons = json.dumps(ds.accounting_dict())
    assert "field 'mode' (data.length_target.mode_column) is 'short', not 'exact' or 'max'" in reasons
    assert "no field 'mode' (data.length_target.mode_column); the row's fields: 'question', 'answer', 'n'" in reasons
    both = PromptBatch.concat([batch.select([1]), batch.select([0])])
    assert both.length_modes == ("exact", "max") and both.length_targets == (20, 30)
    with pytest.raises(ValueError, match=r"some parts carry length_modes and others do not"):
        PromptBatch.concat([batch, replace(batch, length_modes=None)])
