"""`packrl sft` on 2 FSDP2 ranks (Ray, gloo) trains as one process does: a step's traces split
over the ranks under the same global token-mean (float64, tests/same_training.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray and worker processes

from packrl.config import load_config  # noqa: E402
from packrl.trainer.sft import sft  # noqa: E402
from tests.invariance.test_sft_invariance import SFT  # noqa: E402
from tests.same_training import assert_same_training  # noqa: E402


def test_sft_on_two_ranks_trains_as_one_process(tmp_path, model_dir):
    runs = {}
    for workers in (1, 2):
        cfg = load_config("arithmetic_tool", [f"model.path={model_dir}", f"train.out_dir={tmp_path / str(workers)}", *SFT,
                                              f"trainer.num_workers={workers}", "train.max_tokens_per_microbatch=256"])
        runs[workers] = sft(cfg)
    assert_same_training(runs[1] / "checkpoints" / "step_2", runs[2] / "checkpoints" / "step_2")
