"""Data-parallel step time: the same steps with ``trainer.num_workers=2`` (Ray + FSDP2, gloo) vs
one process, on this machine.

Each arm trains the demo preset (SmolLM2-135M-Instruct unless ``model.path=`` says otherwise) for
``--steps`` steps from the same weights and seed. Sampling seeds are per prompt, so both arms
generate the same responses and the steps do the same work; the first step (warm-up, and for the
workers also the first gather of the rollout copy) is left out. Torch threads: the single process
uses all cores; each worker uses ``trainer.num_cpus_per_worker`` (1), so on 2 cores both arms use
the same cores. The ratio measures what data parallelism costs or saves on CPU here; on GPUs each
rank has its own device and the shares run truly in parallel.

Prints one JSON object: per arm the wall time of ``train()`` (Ray start-up and model loading
included), the median step time and median per-stage times over steps 2.., and
``ratio_step`` = median step time with 2 workers / with 1 (the per-stage ratios alongside); also
the host (``host``) and the compute dtype (``dtype``: ``model.dtype`` as configured, ``auto``
unless an override sets it, and what it resolved to here).

Command (about 4 minutes on 2 idle CPU cores)::

    python bench/bench_workers.py [--steps 4] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import emit  # noqa: E402
from packrl.config import load_config  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402

STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")


def _arm(workers: int, steps: int, overrides: list[str], out: Path) -> dict:
    cfg = load_config("demo", [f"train.out_dir={out / f'workers{workers}'}", f"trainer.num_workers={workers}",
                               f"train.total_steps={steps}", "train.save_every=0", "train.dump_rollouts=false",
                               "train.loggers=[console]", *overrides])
    start = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return {
        "num_workers": workers,
        "wall_s": round(wall, 2),
        "median_s": {stage: round(statistics.median(line[f"timing_s/{stage}"] for line in lines), 3) for stage in STAGES},
        "response_length_mean": [round(line["response_length/mean"], 2) for line in lines],
        "rank_imbalance": [round(line.get("seqlen/rank_imbalance", 1.0), 3) for line in lines],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per arm; the first is a warm-up")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the demo preset")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    with tempfile.TemporaryDirectory(prefix="packrl-bench-workers-") as tmp:
        one = _arm(1, args.steps, args.overrides, Path(tmp))
        two = _arm(2, args.steps, args.overrides, Path(tmp))
    ratios = {stage: round(two["median_s"][stage] / max(one["median_s"][stage], 1e-9), 3) for stage in STAGES}
    emit({"one_process": one, "two_workers": two, "ratio_step": ratios["step"], "ratio_by_stage": ratios,
          "same_work": one["response_length_mean"] == two["response_length_mean"]},
         dtype=load_config("demo", args.overrides).model.dtype, indent=1)


if __name__ == "__main__":
    main()
