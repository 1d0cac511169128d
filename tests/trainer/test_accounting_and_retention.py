"""RUN_DIR/data_accounting.json accounts for every row; train.keep_last prunes only after a newer checkpoint is complete."""

from __future__ import annotations

import pytest

from packrl.config import ConfigError, load_config
from packrl.seqlen.prompt_policy import PromptAccounting, RowOutcome
from packrl.trainer.checkpoint import prune_checkpoints


def test_accounting_dict_has_every_row_and_totals_that_sum():
    acc = PromptAccounting((RowOutcome(0, "kept", "", 10), RowOutcome(1, "truncated", "20 -> 16 tokens (left)", 20, 4),
                            RowOutcome(2, "filtered", "30 tokens > 16", 30), RowOutcome(3, "rejected", "missing field 'answer'")))
    d = acc.to_dict()
    t = d["totals"]
    assert t == {"num_rows": 4, "num_kept": 1, "num_truncated": 1, "num_filtered": 1, "num_rejected": 1, "num_tokens_removed": 4}
    assert t["num_kept"] + t["num_truncated"] + t["num_filtered"] + t["num_rejected"] == t["num_rows"]
    assert [r["row"] for r in d["rows"]] == [0, 1, 2, 3] and d["rows"][3]["reason"] == "missing field 'answer'"


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 10, 3):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / ".tmp-step_11").mkdir()  # an interrupted write: not a checkpoint
    deleted = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_11", "step_10", "step_3"]


@pytest.mark.parametrize("value", [0, -1])
def test_keep_last_must_be_positive(value):
    with pytest.raises(ConfigError, match="train.keep_last"):
        load_config("demo", [f"train.keep_last={value}"])
