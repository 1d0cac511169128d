"""Length control on `task:char_count`: from one verbose starting policy, plain GRPO against each
length objective and GFPO at equal steps and equal ``algorithm.loss_agg_mode``, every arm judged
on the same held-out rows (docs/algorithms/length_control.md).

The starting policy is `packrl sft char_count` (the preset's `sft` section: verbose traces, every
line restated and filler lines; 16 steps at lr 1e-4), so it is mostly correct and says about 2.8x
what a correct answer needs. Each arm trains
``--steps`` GRPO steps from it; then every arm (and the start) answers ``--eval-rows`` held-out
questions greedily. The JSON reports per arm: held-out accuracy with its standard error, mean /
p50 / p95 generated tokens of correct and of wrong answers, tokens per correct answer, the
truncation ratio, the mean step time of the last steps, and each arm's length and accuracy
against plain GRPO's. With ``--target-steps`` a `target_length` arm trains on prompts that ask for
a length (each row's target drawn from its feasible range: 1.0-2.5x its shortest correct answer)
and reports ``|len - N| / N`` on held-out prompts before and after training.

Every arm writes ``OUT/<arm>.json`` as soon as it ends, so a run cut short keeps what it measured.

Command (hours on 2 CPU cores: the SFT about 25 min, each arm's 10 steps 20-25 min, each
evaluation of 512 rows 11-15 min, on an AVX2-only host in float32; on a host with AVX512_BF16 in bf16 the SFT
took 7.6 min and an evaluation about 16; every arm with ``--target-steps`` is about five hours)::

    python bench/bench_length_control.py --steps 10 --eval-rows 512 --arms grpo,shortest_correct,gfpo \
        model.path=../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf train.lr=3e-5

Measured (that command, AMD EPYC with AVX2 only, float32, 2 cores; stopped during the gfpo arm):
start 78.5% +- 1.8 held-out accuracy at a mean of 227 tokens; grpo 67.0% +- 2.1, mean 198,
correct p95 325, 145 s a step; shortest_correct 54.3% +- 2.2, mean 145, correct p95 215, 102 s a
step: 26.6% shorter (p95 of correct answers 33.8%) and 29.6% faster steps than grpo, at 12.7
points lower accuracy (docs/algorithms/length_control.md has the table).

``--start CHECKPOINT`` reuses a starting checkpoint instead of running the SFT steps.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from packrl.config import load_config  # noqa: E402
from packrl.data.char_count import shortest_correct_response, split_rows  # noqa: E402
from packrl.data.dataset import PromptDataset  # noqa: E402
from packrl.distributed.local import local_group  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from packrl.trainer.sft import sft  # noqa: E402
from packrl.trainer.validate import validate  # noqa: E402

PRESET = "char_count"
COMMON = ["algorithm.loss_agg_mode=token-mean", "train.save_every=0", "train.val_every=0", "train.dump_rollouts=false"]
"""Every arm: one aggregation mode (Dr. GRPO: per-sequence normalisation alone moves length)."""

ARMS: dict[str, list[str]] = {
    "grpo": [],
    "group_length": ["reward.shaping.group_length.weight=0.5"],
    "efficiency": ["reward.shaping.efficiency.alpha=0.2"],
    "shortest_correct": ["reward.shaping.shortest_correct.beta=0.002"],
    "gfpo": ["rollout.n=8", "algorithm.group_filter.keep=4", "algorithm.group_filter.metric=shortest"],
}
"""Each arm's overrides on top of the preset and `COMMON`."""

TARGET_TEMPLATE = " Answer in {target} tokens."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--start", default=None, help="a starting checkpoint (skips the SFT steps)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-rows", type=int, default=512)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--target-steps", type=int, default=0, help="train a target_length arm this many steps (0: none)")
    parser.add_argument("--out", default="bench/results/length_control")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = [*COMMON, f"data.max_val_rows={args.eval_rows}", *args.overrides]
    checkpoint = args.start or _sft_start(base, args.sft_steps, out)
    report: dict = {"start": _evaluate([*base, f"model.path={checkpoint}"], "start", out), "checkpoint": checkpoint, "arms": {}}
    for name in args.arms.split(","):
        report["arms"][name] = _arm(name, [*base, *ARMS[name], f"model.path={checkpoint}"], args.steps, out)
    if args.target_steps:
        report["target_length"] = _target_arm(base, checkpoint, args.target_steps, out)
    report["vs_grpo"] = _against_grpo(report["arms"])
    command = (f"python bench/bench_length_control.py --sft-steps {args.sft_steps} --steps {args.steps} --eval-rows {args.eval_rows} "
               f"--arms {args.arms} --target-steps {args.target_steps}" + (f" --start {args.start}" if args.start else "")
               + "".join(f" {o}" for o in args.overrides))
    emit({"command": command, "wall_s": round(time.perf_counter() - start, 1), **report})


def _sft_start(overrides: list[str], steps: int, out: Path) -> str:
    """The verbose starting policy: `packrl sft char_count` for ``steps`` steps."""
    cfg = load_config(PRESET, [*overrides, f"sft.total_steps={steps}", f"train.out_dir={out / 'sft'}"])
    run_dir = sft(cfg)
    return str(run_dir / "checkpoints" / f"step_{steps}")


def _evaluate(overrides: list[str], name: str, out: Path) -> dict:
    """Greedy answers to the held-out rows: accuracy (with its standard error) and the length metrics."""
    cfg = load_config(PRESET, overrides)
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    metrics = validate(workers, val_set, cfg.rollout, cfg.reward)
    workers.close()
    accuracy, rows = metrics["val/accuracy"], len(val_set)
    result = {"rows": rows, "accuracy": accuracy, "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / max(1, rows)),
              "truncation_ratio": metrics["val/response_length/clip_ratio"], "response_length_mean": metrics["val/response_length/mean"]}
    result |= {key.removeprefix("val/length/"): value for key, value in metrics.items() if key.startswith("val/length/")}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def _arm(name: str, overrides: list[str], steps: int, out: Path) -> dict:
    """``steps`` GRPO steps from the start with the arm's overrides, then the held-out evaluation."""
    run = Path(tempfile.mkdtemp(prefix=f"packrl-length-{name}-"))
    cfg = load_config(PRESET, [*overrides, f"train.total_steps={steps}", f"train.out_dir={run}"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-5:]
    training = {"steps": len(lines), "step_s_last5": statistics.mean(line["timing_s/step"] for line in last),
                "train_s": sum(line["timing_s/step"] for line in lines),
                "train_length_first5": statistics.mean(line["response_length/mean"] for line in lines[:5]),
                "train_length_last5": statistics.mean(line["response_length/mean"] for line in last),
                "train_score_last5": statistics.mean(line["critic/score/mean"] for line in last)}
    final = run_dir / "checkpoints" / f"step_{steps}"
    result = {"overrides": overrides[len(COMMON):], "training": training,
              "eval": _evaluate([*overrides, f"model.path={final}"], f"{name}_eval", out)}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def _against_grpo(arms: dict) -> dict:
    """Each arm's held-out length and accuracy against plain GRPO's (length change as a fraction)."""
    if "grpo" not in arms:
        return {}
    base = arms["grpo"]["eval"]
    out = {}
    for name, arm in arms.items():
        ev = arm["eval"]
        out[name] = {"accuracy_points": round(100 * (ev["accuracy"] - base["accuracy"]), 2)}
        for key in ("response_length_mean", "correct/mean", "correct/p95"):
            if key in ev and key in base and base[key]:
                out[name][f"{key}_change"] = round(ev[key] / base[key] - 1, 4)
        out[name]["step_s_change"] = round(arm["training"]["step_s_last5"] / arms["grpo"]["training"]["step_s_last5"] - 1, 4)
    return out


def _target_rows(seed: int, split: str, tokenizer, path: Path) -> None:
    """``task:char_count`` rows of ``split`` with a ``target_tokens`` column: each row's target drawn
    from 1.0-2.5x the tokens of its shortest correct answer (a length a correct answer can have)."""
    cfg = load_config(PRESET).data.char_count
    rng = random.Random(seed)
    rows = split_rows(cfg, seed, split)
    with path.open("w") as f:
        for row in rows:
            _, shortest = shortest_correct_response(row["question"], tokenizer)
            f.write(json.dumps(row | {"target_tokens": int(shortest * rng.uniform(1.0, 2.5))}) + "\n")


def _target_arm(base: list[str], checkpoint: str, steps: int, out: Path) -> dict:
    """``target_length`` (L1-Exact): prompts that ask for a length, adherence before and after training."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    data = out / "target_data"
    data.mkdir(exist_ok=True)
    seed = load_config(PRESET).train.seed
    _target_rows(seed, "train", tokenizer, data / "train.jsonl")
    _target_rows(seed, "val", tokenizer, data / "val.jsonl")
    targets = [f"data.train_files=[{data / 'train.jsonl'}]", f"data.val_files=[{data / 'val.jsonl'}]",
               "data.length_target.column=target_tokens", f"data.length_target.template={TARGET_TEMPLATE}"]
    before = _evaluate([*base, *targets, f"model.path={checkpoint}"], "target_before", out)
    arm = _arm("target_length", [*base, *targets, "reward.shaping.target_length.alpha=0.005", f"model.path={checkpoint}"], steps, out)
    return {"before": before, **arm}


if __name__ == "__main__":
    main()
