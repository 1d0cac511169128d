"""It learns: the `demo` preset (GRPO, SmolLM2-135M-Instruct, built-in arithmetic) for 30 steps.

Prints one JSON object: mean training reward (``critic/score/mean``, sampled at temperature 1)
over steps 1-5 and over the last 5 steps, their difference, greedy validation accuracy before
training (step 0) and after, and the wall time. An RL trainer that does not raise the reward on
this easy task has a bug. With ``--preset arithmetic_tool`` (multi-turn, calculator tool) it also
prints the tool-use rate (``multi_turn/tool_use_rate``) over the first and last 5 steps and in
greedy validation before and after.

Command (about 10 minutes on 2 CPU cores for demo)::

    python bench/bench_learning.py [--preset demo] [--steps 30] [key=value ...]

With ``--vs-gae`` it trains the preset twice, as configured (GRPO in ``demo``) and as PPO with a
critic (``algorithm.adv_estimator=gae`` plus the ``--gae`` overrides), validating every
``--val-every`` steps, and prints both arms' reward rise and held-out accuracy at the same wall
time: the last validation each reached within the shorter arm's training time (generation,
reward, log-prob, value and update time, ``timing_s/step``; validation excluded).
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
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--vs-gae", action="store_true", help="also train PPO with a critic and compare at equal wall time")
    parser.add_argument("--gae", nargs="*", default=[], help="extra overrides of the PPO arm (e.g. critic.lr=1e-5)")
    parser.add_argument("--val-every", type=int, default=5, help="validation interval of the --vs-gae arms")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the preset")
    args = parser.parse_args()
    if args.vs_gae:
        compare_gae(args)
        return
    out = Path(tempfile.mkdtemp(prefix="packrl-learning-"))
    cfg = load_config(args.preset, [f"train.total_steps={args.steps}", f"train.out_dir={out}", f"train.val_every={args.steps}", *args.overrides])
    start = time.perf_counter()
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    before = validate(workers, val_set, cfg)
    run_dir = train(cfg, workers)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [line["critic/score/mean"] for line in lines]
    first, last = statistics.mean(scores[:5]), statistics.mean(scores[-5:])
    tools = {}
    if "multi_turn/tool_use_rate" in lines[0]:
        rates = [line["multi_turn/tool_use_rate"] for line in lines]
        tools = {"tool_use_rate_steps_1_5": statistics.mean(rates[:5]), "tool_use_rate_last_5": statistics.mean(rates[-5:]),
                 "val_tool_use_rate_before": before.get("val/multi_turn/tool_use_rate"),
                 "val_tool_use_rate_after": lines[-1].get("val/multi_turn/tool_use_rate"),
                 "malformed_calls_first_5": statistics.mean(line["multi_turn/malformed_calls"] for line in lines[:5]),
                 "malformed_calls_last_5": statistics.mean(line["multi_turn/malformed_calls"] for line in lines[-5:])}
    print(json.dumps({
        "command": "python bench/bench_learning.py " + " ".join(f"--preset {args.preset} --steps {args.steps}".split() + args.overrides),
        "steps": args.steps,
        "reward_mean_steps_1_5": first,
        "reward_mean_last_5": last,
        "reward_gain": last - first,
        "val_accuracy_before": before["val/accuracy"],
        "val_accuracy_after": lines[-1].get("val/accuracy"),
        "response_length_mean_first_5": statistics.mean(line["response_length/mean"] for line in lines[:5]),
        "response_length_mean_last_5": statistics.mean(line["response_length/mean"] for line in lines[-5:]),
        **tools,
        "reward_per_step": [round(s, 4) for s in scores],
        "wall_s": round(time.perf_counter() - start, 1),
        "run_dir": str(run_dir),
    }, indent=2))


def _arm(preset: str, steps: int, val_every: int, overrides: list[str]) -> dict:
    """One arm of --vs-gae: validation before, training with validation every ``val_every`` steps;
    its per-step scores, training seconds and validation accuracies."""
    out = Path(tempfile.mkdtemp(prefix="packrl-learning-"))
    cfg = load_config(preset, [f"train.total_steps={steps}", f"train.out_dir={out}", f"train.val_every={val_every}", *overrides])
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    before = validate(workers, val_set, cfg)["val/accuracy"]
    run_dir = train(cfg, workers)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve = 0.0, [(0.0, before)]
    for line in lines:
        elapsed += line["timing_s/step"]
        if "val/accuracy" in line:
            curve.append((elapsed, line["val/accuracy"]))
    return {"scores": [line["critic/score/mean"] for line in lines], "train_s": elapsed, "curve": curve, "run_dir": str(run_dir)}


def compare_gae(args: argparse.Namespace) -> None:
    """Both arms, then each one's reward rise and accuracy at the shorter arm's training time."""
    arms = {"grpo": _arm(args.preset, args.steps, args.val_every, args.overrides),
            "ppo_gae": _arm(args.preset, args.steps, args.val_every, [*args.overrides, "algorithm.adv_estimator=gae", *args.gae])}
    wall = min(arm["train_s"] for arm in arms.values())
    report = {"command": "python bench/bench_learning.py --vs-gae " + " ".join(
        [f"--preset {args.preset} --steps {args.steps} --val-every {args.val_every}", *args.overrides]
        + (["--gae", *args.gae] if args.gae else [])), "equal_wall_s": round(wall, 1)}
    for name, arm in arms.items():
        reached = [acc for t, acc in arm["curve"] if t <= wall + 1e-6]
        report[name] = {"reward_mean_steps_1_5": statistics.mean(arm["scores"][:5]),
                        "reward_mean_last_5": statistics.mean(arm["scores"][-5:]),
                        "val_accuracy_before": arm["curve"][0][1], "val_accuracy_at_equal_wall": reached[-1],
                        "val_accuracy_end": arm["curve"][-1][1], "train_s": round(arm["train_s"], 1),
                        "val_curve": [(round(t, 1), acc) for t, acc in arm["curve"]], "run_dir": arm["run_dir"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
