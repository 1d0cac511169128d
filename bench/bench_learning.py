"""It learns: the `demo` preset (GRPO, SmolLM2-135M-Instruct, built-in arithmetic) for 30 steps.

Prints one JSON object: mean training reward (``critic/score/mean``, sampled at temperature 1)
over steps 1-5 and over the last 5 steps, their difference, greedy validation accuracy before
training (step 0) and after, and the wall time. An RL trainer that does not raise the reward on
this easy task has a bug.

Command (about 10 minutes on 2 CPU cores)::

    python bench/bench_learning.py [--steps 30] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from packrl.config import load_config
from packrl.distributed.local import local_group
from packrl.trainer.loop import train
from packrl.trainer.validate import validate
from packrl.data.dataset import PromptDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the demo preset")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="packrl-learning-"))
    cfg = load_config("demo", [f"train.total_steps={args.steps}", f"train.out_dir={out}", f"train.val_every={args.steps}", *args.overrides])
    start = time.perf_counter()
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    before = validate(workers, val_set, cfg)
    run_dir = train(cfg, workers)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [line["critic/score/mean"] for line in lines]
    first, last = statistics.mean(scores[:5]), statistics.mean(scores[-5:])
    print(json.dumps({
        "command": "python bench/bench_learning.py " + " ".join(f"--steps {args.steps}".split() + args.overrides),
        "steps": args.steps,
        "reward_mean_steps_1_5": first,
        "reward_mean_last_5": last,
        "reward_gain": last - first,
        "val_accuracy_before": before["val/accuracy"],
        "val_accuracy_after": lines[-1].get("val/accuracy"),
        "response_length_mean_first_5": statistics.mean(line["response_length/mean"] for line in lines[:5]),
        "response_length_mean_last_5": statistics.mean(line["response_length/mean"] for line in lines[-5:]),
        "reward_per_step": [round(s, 4) for s in scores],
        "wall_s": round(time.perf_counter() - start, 1),
        "run_dir": str(run_dir),
    }, indent=2))


if __name__ == "__main__":
    main()
