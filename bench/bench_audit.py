"""`packrl audit` on GSM8K train: cold vs warm wall time, rows/s, and audit p99 == trainer p99.

Measured: the command ``packrl audit GSM8K_TRAIN --model <SmolLM2 .gguf> --json`` run as a
subprocess twice with an empty packrl cache (env ``PACKRL_CACHE`` set to a fresh temporary
folder): the first run is cold (nothing cached: Python and transformers imports, tokenizer load,
render + tokenize of every row, the left/right/middle truncation of the rows over the demo
preset's ``data.max_prompt_tokens=128``), the second is warm (the report comes from the cache).
Wall time is measured around each subprocess here (``wall_s``) and also read from the report
(``report_wall_s``, which starts after the interpreter and argument parsing).

Then the trainer's prompt lengths: `PromptDataset.build` over the same rows with the same
tokenizer and config gives `prompt_length_percentiles`, whose p99 must equal the audit's.

The JSON also names the host (``host``, `bench.common.machine`); ``dtype`` is null, as nothing
here computes with a model.

Command (about 10 s on 2 idle CPU cores)::

    python bench/bench_audit.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import GSM8K_TRAIN, SMOLLM_DIR, emit  # noqa: E402

GGUF = SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _run_audit(cache: str) -> tuple[float, dict]:
    env = os.environ | {"PACKRL_CACHE": cache}
    cmd = [sys.executable, "-m", "packrl.cli.main", "audit", str(GSM8K_TRAIN), "--model", str(GGUF), "--json"]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(out.stdout)


def _trainer_p99(cache: str) -> int | None:
    os.environ["PACKRL_CACHE"] = cache
    from packrl.cli.audit import load_audit_tokenizer, locate_tokenizer
    from packrl.config import load_config
    from packrl.data import PromptDataset

    cfg = load_config(None, [])
    tokenizer = load_audit_tokenizer(locate_tokenizer(str(GGUF)))
    dataset = PromptDataset.build([str(GSM8K_TRAIN)], tokenizer, cfg.data, seed=cfg.train.seed, split="train", key="data.train_files")
    return dataset.prompt_length_percentiles()["p99"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="packrl-bench-audit-") as cache:
        cold_s, cold = _run_audit(cache)
        warm_s, warm = _run_audit(cache)
        trainer_p99 = _trainer_p99(cache)
    result = {
        "rows": cold["num_rows"],
        "cold": {"wall_s": round(cold_s, 3), "rows_per_s": round(cold["num_rows"] / cold_s, 1),
                 "report_wall_s": cold["wall_s"], "report_rows_per_s": cold["rows_per_s"], "cached": cold["cached"]},
        "warm": {"wall_s": round(warm_s, 3), "rows_per_s": round(warm["num_rows"] / warm_s, 1),
                 "report_wall_s": warm["wall_s"], "report_rows_per_s": warm["rows_per_s"], "cached": warm["cached"]},
        "cold_over_warm": round(cold_s / warm_s, 1),
        "audit_p99": cold["prompt_tokens"]["p99"],
        "trainer_p99": trainer_p99,
        "p99_equal": cold["prompt_tokens"]["p99"] == trainer_p99 == warm["prompt_tokens"]["p99"],
        "max_prompt_tokens": cold["config"]["data.max_prompt_tokens"],
        "num_overlong": cold["num_overlong"],
    }
    emit(result, dtype=None, indent=1)


if __name__ == "__main__":
    main()
