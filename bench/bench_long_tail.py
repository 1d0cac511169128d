"""Step time and generation speed on a long-tailed response-length workload,
``trainer.rollout_mode=sync`` against ``colocate_async`` (partial rollouts carried across steps), at
equal prompts, in one run.

Workload: the real SmolLM2-135M-Instruct on the demo preset's arithmetic task (or GSM8K) with a
1,024-token response budget. The model's own answers are short (tens of tokens); a scripted share
of responses (``--tail-fraction``, by sampling seed: `bench/long_tail_engine.py`) cannot end and
runs to the budget. A synchronous step waits for its longest response; a partial-rollout step ends
once ``data.batch_size`` groups are complete and carries the rest, which keep decoding alongside
the next steps' short responses (re-prefilled each step, bounded by ``rollout.max_staleness``).
``--tail-fraction 0`` leaves the model's own lengths.

Each arm trains the same config for ``--steps`` steps in its own subprocess (same interpreter, one
after the other; the first step is not timed). Reported per arm: mean step time and generation time
of the timed steps, tokens generated per second of generation, the response lengths, and for the
async arm staleness, carried groups and re-prefilled tokens. ``speedup`` gives sync / async of the
step time and of the generation time, async / sync of the generation tokens/s, and the step-time
ratio per trained response token (``step_time_per_trained_token``: at equal prompts the async arm
ends with long groups still in its pool, untrained, so its trained responses are shorter).

Command (repository root; about 15 minutes on a 2-core host)::

    python bench/bench_long_tail.py [--preset demo|gsm8k] [--steps 8] [--batch 8] [--n 4] [--max-response 1024]
        [--over 8] [--max-staleness 8] [--tail-fraction 0.03]

Measured (defaults; AMX host, 2 cores, bf16): step 61.1 s sync vs 30.1 s colocate_async
(``speedup.step_time`` 2.03x), generation 44.3 vs 16.8 s (2.65x), generation tokens/s 2.37x;
trained responses 92.0 vs 73.8 tokens on average, so per trained response token 1.63x; token
staleness at most 4 updates. docs/async.md discusses the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import GSM8K_TRAIN, SMOLLM_DIR, emit, require_shared  # noqa: E402

GGUF = SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _overrides(args: argparse.Namespace, out_dir: Path, mode: str) -> list[str]:
    data = [f"data.train_files=[{GSM8K_TRAIN}]"] if args.preset == "gsm8k" else []  # demo: its built-in arithmetic task
    base = [f"model.path={GGUF}", *data, "data.val_files=[]", f"data.batch_size={args.batch}", f"rollout.n={args.n}",
            f"rollout.max_response_tokens={args.max_response}", f"train.total_steps={args.steps}",
            f"trainer.plugins=[{REPO / 'bench' / 'long_tail_engine.py'}]", "rollout.engine=hf_long_tail",
            f"train.out_dir={out_dir / 'run'}", "train.save_every=0", "train.loggers=[]", f"model.dtype={args.dtype}",
            "train.lr=1e-6", "data.max_prompt_tokens=256", f"train.max_tokens_per_microbatch={args.max_response + 256}"]
    if mode == "colocate_async":
        base += ["trainer.rollout_mode=colocate_async", f"rollout.over_provision={args.over}",
                 f"rollout.max_staleness={args.max_staleness}"]
    return base


def _arm(args: argparse.Namespace, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "packrl.cli.main", "train", args.preset, *_overrides(args, Path(tmp), mode)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)  # inherits PACKRL_BENCH_TAIL_FRACTION (main)
        if proc.returncode:
            raise SystemExit(f"{mode} arm failed:\n{proc.stderr[-3000:]}")
        run_dir = Path(tmp) / "run"
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = lines[1:]
    gen = [line["timing_s/gen"] for line in timed]
    step = [line["timing_s/step"] for line in timed]
    tokens = [line.get("async/generated_tokens", line["response_length/mean"] * args.batch * args.n) for line in timed]
    out = {"step_s_mean": statistics.mean(step), "gen_s_mean": statistics.mean(gen), "step_s": step, "gen_s": gen,
           "generated_tokens_per_step": tokens, "gen_tokens_per_s": sum(tokens) / sum(gen),
           "response_length_mean": statistics.mean(line["response_length/mean"] for line in timed),
           "response_length_max": max(line["response_length/max"] for line in timed),
           "response_clip_ratio_mean": statistics.mean(line["response_length/clip_ratio"] for line in timed),
           "score_mean": statistics.mean(line["critic/score/mean"] for line in timed)}
    if mode == "colocate_async":
        out |= {key: [line[f"async/{key}"] for line in timed] for key in
                ("staleness_token_mean", "staleness_token_max", "carried_groups", "reprefill_tokens", "partial_ratio",
                 "must_finish_groups")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["demo", "gsm8k"], default="demo",
                        help="demo: the built-in arithmetic task (short answers); gsm8k: GSM8K questions")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--over", type=int, default=8, help="rollout.over_provision of the async arm")
    parser.add_argument("--max-staleness", type=int, default=8, help="rollout.max_staleness of the async arm")
    parser.add_argument("--tail-fraction", type=float, default=0.03,
                        help="share of responses that cannot end before the budget (0 = the model's own lengths)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")
    if not 0.0 <= args.tail_fraction <= 1.0:
        raise SystemExit(f"--tail-fraction={args.tail_fraction} must be in [0, 1]")
    require_shared()
    from packrl.config import load_config
    from packrl.errors import ConfigError

    os.environ["PACKRL_BENCH_TAIL_FRACTION"] = str(args.tail_fraction)
    for mode in ("sync", "colocate_async"):  # both arms' settings checked before either trains
        try:
            load_config(args.preset, _overrides(args, Path(tempfile.gettempdir()) / "packrl-long-tail-check", mode))
        except ConfigError as err:
            raise SystemExit(f"{mode} arm: {err}") from None
    arms = {mode: _arm(args, mode) for mode in ("sync", "colocate_async")}
    sync, part = arms["sync"], arms["colocate_async"]
    speedup = {"step_time": sync["step_s_mean"] / part["step_s_mean"], "gen_time": sync["gen_s_mean"] / part["gen_s_mean"],
               "gen_tokens_per_s": part["gen_tokens_per_s"] / sync["gen_tokens_per_s"],
               # per trained response token: an async arm that has not yet trained its carried long groups is not credited for them
               "step_time_per_trained_token": (sync["step_s_mean"] / sync["response_length_mean"])
               / (part["step_s_mean"] / part["response_length_mean"])}
    emit({"command": " ".join(sys.argv), "settings": vars(args), "arms": arms, "speedup": speedup}, dtype=args.dtype)


if __name__ == "__main__":
    main()
