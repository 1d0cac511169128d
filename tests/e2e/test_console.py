"""The console of `packrl train`: the run's one progress bar, none of the libraries' bars or
warnings (GGUF conversion, weight loading, checkpoint writing), which go to train.log."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from packrl.config import load_config
from packrl.trainer.run import Run
from tests.conftest import GGUF, needs_shared

ROOT = Path(__file__).resolve().parents[2]
TINY = ["data.batch_size=2", "rollout.n=2", "rollout.max_response_tokens=8", "train.total_steps=1", "train.save_every=1",
        "data.val_files=[]", "train.val_every=0", "train.max_tokens_per_microbatch=512"]
BAR = re.compile(r"\d+%\||\d+/\d+ \[")  # tqdm's "40%|" or "1/1 [" in a bar line
LIBRARY_NOISE = ("Loading weights", "Writing model shards", "de-quantizing", "Fetching", "Downloading")


@pytest.mark.slow
@needs_shared(GGUF)
def test_a_one_step_run_shows_one_bar_and_no_library_output(tmp_path):
    env = {**os.environ, "PACKRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    env.pop("TQDM_DISABLE", None)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "packrl.cli.main", "train", "demo", f"model.path={GGUF}",
                          f"train.out_dir={run_dir}", *TINY], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    fragments = [f.strip() for f in re.split(r"[\r\n]", console) if f.strip()]
    bars = [f for f in fragments if BAR.search(f)]
    assert bars and all(f.startswith("packrl: ") for f in bars), bars
    assert "1/1" in bars[-1]  # the run's bar reached its one step
    for noise in LIBRARY_NOISE:
        assert noise not in console, noise
    assert not re.search(r"\b[A-Z]\w*Warning\b|warnings\.warn", console), console[-3000:]
    assert (run_dir / "checkpoints" / "step_1").is_dir()  # the checkpoint was written, without its bar
    log = (run_dir / "train.log").read_text()
    assert "converted SmolLM2-135M-Instruct.Q4_1.gguf" in log  # the conversion as one log line
    assert not any(BAR.search(line) for line in log.splitlines())


def test_library_warnings_and_records_go_to_train_log_only(tmp_path, capsys):
    cfg = load_config("demo", [f"train.out_dir={tmp_path}", "train.loggers=[]"])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with Run(cfg):
            warnings.warn("old API\nsecond line", FutureWarning, stacklevel=1)
            logging.getLogger("transformers.modeling_utils").warning("a transformers notice")
            logging.getLogger("packrl.test").warning("a packrl warning")
    console = "".join(capsys.readouterr())
    assert "old API" not in console and "transformers notice" not in console
    assert "a packrl warning" in console  # packrl's own warnings still reach the console, above the bar
    log = (tmp_path / "train.log").read_text()
    assert "FutureWarning: old API" in log and "second line" not in log and "a transformers notice" in log
    for owner in ("py.warnings", "packrl"):  # detached at close: the run's folder may be deleted after it
        assert not any(getattr(h, "_packrl_run", False) for h in logging.getLogger(owner).handlers), owner
    shutil.rmtree(tmp_path)
    logging.getLogger("packrl.test").warning("after the run")  # no handler reopens the deleted train.log
    assert not (tmp_path / "train.log").exists()
