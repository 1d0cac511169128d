"""Length control on `task:char_count`, decided by paired tests: from one verbose starting policy,
plain GRPO against GFPO and the length objectives at equal steps, every arm answering the same
held-out rows (docs/algorithms/length_control.md).

The task cannot be guessed: the count is drawn first (uniform over 0-3, so a constant guess of the
count is right for about a quarter of the rows: the lenient reading's guess floor, computed from
the rows and reported), and the `char_count` reward's strict reading is right only when every
worked line is there, in order, with its running count (`packrl.reward.char_count`), so a length
objective can only remove redundant lines. Both readings are kept per row.

1. The start: `packrl sft char_count` (verbose traces: every line restated, filler lines; the
   preset's ``sft`` section), then its greedy answers to ``--eval-rows`` held-out rows. Both are
   cached under ``--cache`` (keyed by the SFT settings, the evaluation settings and the code that
   makes them), so a rerun skips both; ``--start CHECKPOINT`` uses a checkpoint instead.
2. Each arm of ``--arms`` in order trains ``--steps`` steps from the start with `TRAINING` and its
   own overrides (`ARMS`), then answers the same rows greedily. An arm whose estimated time would
   take the run past ``--budget-minutes`` is dropped (and said so) instead of run.
3. Per-row results of every arm (``arms.<name>.rows``: ``{"row", "count", "correct_strict",
   "correct_lenient", "tokens", "truncated"}``, the start as ``arms.start``), each arm's summary
   (`bench.length_stats.summary`: both readings, accuracy by count, tokens mean/p50/p95, the guess
   floor), its training (step, generation and update times; train score and length), and the
   paired comparisons (`bench.length_stats.compare`): grpo against the start and every arm against
   grpo, with McNemar's exact test, the bootstrap 95% interval of the accuracy difference and its
   one-sided lower end (non-inferiority at ``--margin``), and the interval of the mean-length
   ratio. Every arm's JSON is written to ``--out`` as it ends; the whole report (``wall_s``: the
   run's seconds, the host, the dtype) is printed and written to ``--report``.

Command (the defaults; the committed report ``bench/results/length_control.json`` is its output)::

    python bench/bench_length_control.py

Options: ``--steps``, ``--eval-rows``, ``--arms`` (of `ARMS`), ``--budget-minutes``, ``--margin``,
``--start``, ``--cache``, ``--out``, ``--report``, ``--target-steps`` (a `target_length` arm, off by
default), ``--baseline REPORT`` (the trained arms of an earlier report of the same start join this
run's comparisons, row by row: later arms without rerunning grpo) and config overrides after them
(``train.lr=...``), which every run of the bench takes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.length_stats import compare, rows_needed, summary  # noqa: E402
from packrl.config import load_config  # noqa: E402

PRESET = "char_count"
ROOT = Path(__file__).resolve().parents[1]
COMMON = ["algorithm.loss_agg_mode=token-mean", "train.save_every=0", "train.val_every=0", "train.dump_rollouts=true"]
"""Every run: one aggregation mode (Dr. GRPO: per-sequence normalisation alone moves length)."""
TRAINING = ["train.lr=2e-5", "train.warmup_steps=2", "rollout.temperature=0.7"]
"""Every arm's optimizer and sampling. At the preset's temperature 1.0 the start's samples were right
under the strict reading 12.5% of the time (32 responses; greedy: 65.6%), so most groups carried
no signal; at 0.7, 65.6% (64 responses, 5 of 16 groups with a spread, lengths 114-258); 0.5 gave
59.4% (docs/algorithms/length_control.md)."""

ARMS: dict[str, list[str]] = {
    "grpo": [],
    "gfpo": ["rollout.n=8", "algorithm.filters.gfpo.keep=4", "algorithm.filters.gfpo.metric=shortest"],
    "shortest_correct": ["reward.shaping.shortest_correct={}"],
    "shortest_correct_gated": ["reward.shaping.shortest_correct.min_group_accuracy=0.5"],
    "group_length": ["reward.shaping.group_length.weight=0.5"],
    "efficiency": ["reward.shaping.efficiency.alpha=0.2"],
}
"""Each arm's overrides on top of the preset, `COMMON` and `TRAINING`: GFPO keeps the 4 shortest of
8 (the same reward as GRPO); shortest_correct at the paper's pressure (alpha 2, beta 0.001); its
gated variant applies the length term only in groups at least half right (GRPO-lambda's switch)."""
DEFAULT_ARMS = "grpo,gfpo,shortest_correct,shortest_correct_gated,group_length,efficiency"

# What one unit of work took on a 2-core AVX2 host in float32 (docs/algorithms/length_control.md), for
# the estimates made before anything is measured; once measured, the run's own figures replace them.
EST_SFT_S_PER_STEP = 50.0
EST_EVAL_S_PER_ROW = 2.2
EST_STEP_S = {"n4": 165.0, "n8": 230.0}
CODE = ["packrl/data/char_count.py", "packrl/data/char_count_traces.py", "packrl/data/traces.py", "packrl/trainer/sft.py",
        "packrl/config/presets/char_count.yaml", "packrl/reward/char_count.py"]
"""The files whose text the start's cache key holds (with the settings, library versions and `START_VERSION`)."""
START_VERSION = 2
"""Raised when this file changes how the start is made or evaluated (`_sft`, `_evaluate`)."""


def main() -> None:
    args = _parse()
    wall = time.perf_counter()
    deadline = wall + 60 * args.budget_minutes
    base = [*COMMON, f"data.max_val_rows={args.eval_rows}", *args.overrides]
    arms = args.arms.split(",")
    try:
        _refuse_bad_input(args, base, arms)
    except ValueError as err:  # bad arguments or overrides (ConfigError included): one line, as packrl's own commands
        print(f"bench_length_control: error: {err}", file=sys.stderr)
        sys.exit(2)
    start = _start(args, base, deadline)
    report: dict[str, Any] = {"settings": _settings(args, base), "start": start["meta"], "arms": {"start": start["eval"]},
                              "dropped": {}, "comparisons": {}}
    out = Path(args.out)
    report["arms"] |= _baseline_arms(args.baseline, start["meta"])
    for name in arms:
        estimate = _arm_estimate(name, args, report["arms"])
        if time.perf_counter() + estimate > deadline:
            left = (deadline - time.perf_counter()) / 60
            report["dropped"][name] = f"estimated {estimate / 60:.1f} min, {left:.1f} min of --budget-minutes left"
            print(f"[length bench] dropping {name}: {report['dropped'][name]}", flush=True)
            continue
        report["arms"][name] = _arm(name, [*base, *TRAINING, *ARMS[name], f"model.path={start['checkpoint']}"], args.steps, out)
        (out / f"{name}.json").write_text(json.dumps(report["arms"][name], indent=1))
    if args.target_steps:
        from bench.length_target_arm import target_arm

        estimate = args.target_steps * EST_STEP_S["n4"] + 2 * report["arms"]["start"]["eval_s"]
        if time.perf_counter() + estimate > deadline:
            report["dropped"]["target_length"] = f"estimated {estimate / 60:.1f} min, past --budget-minutes"
        else:
            report["target_length"] = target_arm([*base, *TRAINING], start["checkpoint"], args.target_steps, out, PRESET, _arm)
    report["comparisons"] = _comparisons(report["arms"], args.margin)
    report["verdict"] = _verdict(report, args.margin)
    report = {"command": _command(args), "wall_s": round(time.perf_counter() - wall, 1), **report}
    _write(report, args)


def _baseline_arms(path: str | None, start: dict[str, Any]) -> dict[str, Any]:
    """The trained arms of an earlier report (``--baseline``) of the same start, each marked with
    the report it comes from, so a run of further arms compares with them row by row.

    Raises:
        ValueError: the report comes from another start (its cache key differs).
    """
    if not path:
        return {}
    earlier = json.loads(Path(path).read_text())
    if earlier["start"].get("key") != start.get("key"):
        raise ValueError(f"--baseline {path} comes from the start {earlier['start'].get('key')}, not this run's {start.get('key')}; "
                         "compare arms of one start only")
    return {name: arm | {"from_report": path} for name, arm in earlier["arms"].items() if name != "start"}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the start (default: the preset's sft.total_steps)")
    parser.add_argument("--start", default=None, help="a starting checkpoint (skips the SFT and its cache)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-rows", type=int, default=256)
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, in order, of {', '.join(ARMS)}")
    parser.add_argument("--budget-minutes", type=float, default=90.0, help="drop the arms that would run past it")
    parser.add_argument("--margin", type=float, default=0.05, help="non-inferiority margin (fraction)")
    parser.add_argument("--target-steps", type=int, default=0, help="train a target_length arm this many steps (0: none)")
    parser.add_argument("--baseline", default=None, help="an earlier report of the same start whose arms this run compares with")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "packrl" / "bench_length_control"))
    parser.add_argument("--out", default="bench/results/length_control")
    parser.add_argument("--report", default="bench/results/length_control.json")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args()


def _refuse_bad_input(args: argparse.Namespace, base: list[str], arms: list[str]) -> None:
    """Everything that would fail or mean nothing, before anything trains (each a ValueError)."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"--arms {args.arms!r}: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if len(set(arms)) < len(arms):
        raise ValueError(f"--arms {args.arms!r} names an arm twice (the second run would replace the first); name each once")
    for name, value, least in (("--steps", args.steps, 1), ("--eval-rows", args.eval_rows, 1), ("--sft-steps", _sft_steps(args), 1),
                               ("--target-steps", args.target_steps, 0)):
        if value < least:
            raise ValueError(f"{name}={value} must be at least {least}")
    if not 0 < args.margin < 1:
        raise ValueError(f"--margin={args.margin} must be a fraction in (0, 1), e.g. 0.05")
    if not (math.isfinite(args.budget_minutes) and args.budget_minutes > 0):
        raise ValueError(f"--budget-minutes={args.budget_minutes} must be a finite number of minutes > 0, e.g. 90")
    if args.start and not (Path(args.start) / "config.json").is_file():
        raise ValueError(f"--start {args.start}: no model directory there (no config.json); give a checkpoint directory "
                         "(RUN_DIR/checkpoints/step_N) or leave --start out to make the start")
    for name in arms:  # every arm's config loads (a bad override or option is named now, not an hour in)
        load_config(PRESET, [*base, *TRAINING, *ARMS[name]])
    first = _arm_estimate(arms[0], args, {})
    start = 0.0 if args.start else EST_EVAL_S_PER_ROW * args.eval_rows + (0.0 if _cached_start(args, base) else
                                                                          EST_SFT_S_PER_STEP * _sft_steps(args))
    if 60 * args.budget_minutes < start + first:
        raise ValueError(f"--budget-minutes={args.budget_minutes:g} is too small for the start and one arm (estimated "
                         f"{(start + first) / 60:.0f} min on 2 CPU cores: --steps {args.steps}, --eval-rows {args.eval_rows}); "
                         f"raise --budget-minutes to {(start + first) / 60 + 5:.0f} or lower --steps / --eval-rows")


def _sft_steps(args: argparse.Namespace) -> int:
    return args.sft_steps if args.sft_steps is not None else load_config(PRESET).sft.total_steps


def _sft_config(args: argparse.Namespace, base: list[str], out_dir: Path | str):
    return load_config(PRESET, [*base, f"sft.total_steps={_sft_steps(args)}", f"train.out_dir={out_dir}"])


def _start_key(args: argparse.Namespace, base: list[str]) -> str:
    """The start's cache key: the SFT run's whole config, the code that makes it and the versions."""
    from importlib import metadata

    cfg = _sft_config(args, base, "key")
    blob = {"config": asdict(cfg) | {"train": asdict(cfg.train) | {"out_dir": None}},
            "code": {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in CODE},
            "versions": [metadata.version("torch"), metadata.version("transformers")], "start_version": START_VERSION}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cached_start(args: argparse.Namespace, base: list[str]) -> Path | None:
    path = Path(args.cache) / _start_key(args, base)
    return path if (path / "eval.json").is_file() and (path / "checkpoint").is_dir() else None


def _start(args: argparse.Namespace, base: list[str], deadline: float) -> dict[str, Any]:
    """The starting checkpoint and its evaluation: from the cache, from ``--start``, or made now
    (the SFT, then the evaluation) and cached."""
    if args.start:
        evaluation = _evaluate([*base, f"model.path={args.start}"])
        return {"checkpoint": args.start, "eval": evaluation, "meta": {"checkpoint": args.start, "cached": False}}
    cached = _cached_start(args, base)
    if cached is not None:
        print(f"[length bench] start from the cache: {cached}", flush=True)
        meta = json.loads((cached / "meta.json").read_text()) | {"cached": True}
        return {"checkpoint": str(cached / "checkpoint"), "eval": json.loads((cached / "eval.json").read_text()), "meta": meta}
    path = Path(args.cache) / _start_key(args, base)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    begun = time.perf_counter()
    checkpoint = _sft(args, base, path)
    sft_s = time.perf_counter() - begun
    evaluation = _evaluate([*base, f"model.path={checkpoint}"])
    meta = {"checkpoint": str(checkpoint), "key": path.name, "sft_steps": _sft_steps(args), "sft_s": round(sft_s, 1)}
    (path / "meta.json").write_text(json.dumps(meta, indent=1))
    (path / "eval.json").write_text(json.dumps(evaluation, indent=1))
    return {"checkpoint": str(checkpoint), "eval": evaluation, "meta": meta | {"cached": False}}


def _sft(args: argparse.Namespace, base: list[str], path: Path) -> Path:
    """`packrl sft char_count` into the cache; refused first when a verbose trace is over the RL
    response budget (the start would learn answers RL cuts)."""
    from packrl.models.loading import load_policy_tokenizer
    from packrl.trainer.sft import sft, sft_traces

    with tempfile.TemporaryDirectory(prefix="packrl-length-sft-") as run:
        cfg = _sft_config(args, base, run)
        longest = max(map(len, sft_traces(cfg, load_policy_tokenizer(cfg.model)).response_ids))
        if longest > cfg.rollout.max_response_tokens:
            raise ValueError(f"rollout.max_response_tokens={cfg.rollout.max_response_tokens} is below the longest verbose trace "
                             f"of the start ({longest} tokens): RL would cut the answers it starts from; raise "
                             f"rollout.max_response_tokens to {longest + 16} or lower data.char_count.max_letters")
        run_dir = sft(cfg)
        shutil.move(str(run_dir / "checkpoints" / f"step_{cfg.sft.total_steps}"), path / "checkpoint")
    return path / "checkpoint"


def _evaluate(overrides: list[str]) -> dict[str, Any]:
    """Greedy answers to the held-out rows: per-row results under both readings and the summary."""
    from packrl.data.dataset import PromptDataset
    from packrl.distributed.local import local_group
    from packrl.reward.char_count import final_count, reads_right
    from packrl.reward.score import check_ground_truths, policy_texts
    from packrl.rollout.engine import SamplingParams

    cfg = load_config(PRESET, overrides)
    begun = time.perf_counter()
    workers = local_group(cfg)
    val_set = PromptDataset.build(cfg.data.val_files, workers.tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files")
    check_ground_truths(cfg.reward, val_set, "data.val_files")
    params = SamplingParams.from_config(cfg.rollout, validation=True)
    rows = []
    for prompts in val_set.iter_batches(cfg.rollout.max_num_seqs):
        rollout = workers.generate(prompts, params)
        for k, (text, response) in enumerate(zip(policy_texts(rollout.responses, workers.tokenizer), rollout.responses)):
            truth = prompts.ground_truths[k]
            rows.append({"row": prompts.rows[k], "count": int(final_count(truth) or 0),
                         "correct_strict": not response.truncated and reads_right(text, truth, "strict"),
                         "correct_lenient": not response.truncated and reads_right(text, truth, "lenient"),
                         "tokens": int(response.generated_mask().sum()), "truncated": bool(response.truncated),
                         "redundant_lines": _redundant_lines(text)})
    workers.close()
    eval_s = time.perf_counter() - begun
    print(f"[length bench] evaluated {len(rows)} rows in {eval_s:.0f} s", flush=True)
    return {"eval_s": round(eval_s, 1), "summary": summary(rows), "rows": rows}


def _redundant_lines(text: str) -> int:
    """Lines of an answer that are neither a worked line (``r - yes (1)``) nor the final ``#### N``:
    restatements, fillers, openings and closings, what a length objective may remove."""
    from packrl.reward.char_count import WORKED_LINE

    return sum(1 for line in text.splitlines() if line.strip() and not WORKED_LINE.match(line) and not line.strip().startswith("####"))


def _arm(name: str, overrides: list[str], steps: int, out: Path) -> dict[str, Any]:
    """``steps`` RL steps from the start with the arm's overrides, then the held-out evaluation."""
    from packrl.trainer.loop import train

    print(f"[length bench] arm {name}: {steps} steps", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    run = out / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    cfg = load_config(PRESET, [*overrides, f"train.total_steps={steps}", f"train.out_dir={run}"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = run_dir / "checkpoints" / f"step_{steps}"
    evaluation = _evaluate([*overrides, f"model.path={final}"])
    shutil.rmtree(final)  # 1.6 GB of weights and optimizer states; the rollout dumps and metrics stay
    return {"overrides": overrides[len(COMMON):], "training": _training(lines), **evaluation}


def _training(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step and in the mean: step, generation and update seconds; train score and length."""
    def mean(key: str) -> float:
        values = [line[key] for line in lines if key in line]
        return round(statistics.mean(values), 3) if values else float("nan")

    keys = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "critic/score/mean", "response_length/mean")
    return {"steps": len(lines), **{f"{k}_mean": mean(k) for k in keys},
            "per_step": [{k: line.get(k) for k in keys} for line in lines]}


def _arm_estimate(name: str, args: argparse.Namespace, done: dict[str, Any]) -> float:
    """Seconds an arm is expected to take: its steps at the step time measured so far (grpo's,
    scaled for a larger group) or the host estimate, plus the start's measured evaluation time."""
    wide = any(o.startswith("rollout.n=") for o in ARMS[name])
    eval_s = done["start"]["eval_s"] if "start" in done else EST_EVAL_S_PER_ROW * args.eval_rows
    measured = [a["training"]["timing_s/step_mean"] for n, a in done.items() if n != "start" and
                any(o.startswith("rollout.n=") for o in ARMS[n]) == wide]
    if measured:
        return args.steps * max(measured) + eval_s
    grpo = done.get("grpo")
    step = EST_STEP_S["n8" if wide else "n4"] if grpo is None else grpo["training"]["timing_s/step_mean"] * (1.6 if wide else 1.0)
    return args.steps * step + eval_s


def _comparisons(arms: dict[str, Any], margin: float) -> dict[str, Any]:
    out = {}
    if "grpo" in arms:
        out["grpo_vs_start"] = compare(arms["grpo"]["rows"], arms["start"]["rows"], margin=margin)
        for name in arms:
            if name not in ("start", "grpo"):
                out[f"{name}_vs_grpo"] = compare(arms[name]["rows"], arms["grpo"]["rows"], margin=margin)
    return out


def _verdict(report: dict[str, Any], margin: float) -> dict[str, Any]:
    """The acceptance read off the comparisons: grpo non-inferior to the start; each length arm's
    mean and p95 cut against grpo, strict accuracy non-inferior to grpo; the update-time ratio of
    GFPO to GRPO; the rows a 2-point margin would need at the measured discordance."""
    comps, arms = report["comparisons"], report["arms"]
    out: dict[str, Any] = {}
    if "grpo_vs_start" in comps:
        out["grpo_non_inferior_to_start"] = comps["grpo_vs_start"]["accuracy_strict"]["non_inferior"]
    for name, comp in comps.items():
        if name.endswith("_vs_grpo"):
            arm = name.removesuffix("_vs_grpo")
            out[arm] = {"mean_cut": comp["tokens_mean_cut"], "p95_cut": comp["tokens_p95_cut"],
                        "non_inferior_strict": comp["accuracy_strict"]["non_inferior"],
                        "meets_target": comp["tokens_mean_cut"] >= 0.35 and comp["tokens_p95_cut"] >= 0.35
                        and comp["accuracy_strict"]["non_inferior"]}
    if "gfpo" in arms and "grpo" in arms:
        out["gfpo_update_over_grpo"] = round(arms["gfpo"]["training"]["timing_s/update_actor_mean"]
                                             / arms["grpo"]["training"]["timing_s/update_actor_mean"], 3)
    discordant = [c["accuracy_strict"]["only_arm_right"] + c["accuracy_strict"]["only_base_right"] for c in comps.values()]
    if discordant:
        share = max(discordant) / max(1, next(iter(comps.values()))["num_rows"])
        out["rows_needed"] = {"discordant_share": round(share, 4), "margin_5_points": rows_needed(max(share, 1e-3), margin),
                              "margin_2_points": rows_needed(max(share, 1e-3), 0.02)}
    return out


def _settings(args: argparse.Namespace, base: list[str]) -> dict[str, Any]:
    return {"preset": PRESET, "common": base, "training": TRAINING, "arms": {a: ARMS[a] for a in args.arms.split(",")},
            "steps": args.steps, "eval_rows": args.eval_rows, "budget_minutes": args.budget_minutes, "margin": args.margin}


def _command(args: argparse.Namespace) -> str:
    parts = ["python bench/bench_length_control.py", f"--steps {args.steps}", f"--eval-rows {args.eval_rows}", f"--arms {args.arms}",
             f"--budget-minutes {args.budget_minutes:g}"]
    parts += [f"--start {args.start}"] if args.start else []
    parts += [f"--target-steps {args.target_steps}"] if args.target_steps else []
    parts += [f"--baseline {args.baseline}"] if args.baseline else []
    return " ".join(parts + list(args.overrides))


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    from bench.common import machine

    dtype = load_config(PRESET, args.overrides).model.dtype
    full = report | machine(dtype)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(full, indent=1) + "\n")
    printed = {k: v for k, v in report.items() if k != "arms"} | {
        "arms": {n: {k: v for k, v in a.items() if k != "rows"} for n, a in report["arms"].items()}}
    emit(printed, dtype=dtype)


if __name__ == "__main__":
    main()
