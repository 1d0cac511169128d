"""Generation time per step, ``trainer.rollout_mode=sync`` against ``colocate_async`` (partial
rollouts carried across steps), on the real SmolLM2-135M-Instruct and GSM8K (or the demo preset's
arithmetic task), in one run.

Each arm trains the same config for ``--steps`` steps in its own subprocess (same interpreter, 2
torch threads, one after the other): GSM8K prompts, ``--batch`` prompts x ``--n`` responses,
``--max-response`` tokens, greedy-free sampling at temperature 1. The async arm adds
``rollout.over_provision`` groups and cuts each step once ``data.batch_size`` groups are complete
(the HF engine's one call stopped between decode rounds). Reported per arm: the median ``timing_s/gen`` of the steps after
the first (the first step of the async arm has nothing carried yet), tokens generated per step,
the step time, and for the async arm the staleness, carried groups and re-prefilled tokens; then
the ratio async / sync of the generation time and of the tokens decoded per second of generation.

What it measures: whether cutting the tail pays for its re-prefills on this host. It does not
claim a learning-curve effect (that needs many more steps).

Command (repository root; about 6 minutes on a 2-core host)::

    python bench/bench_partial_rollout.py [--preset gsm8k|demo] [--steps 5] [--batch 4] [--n 4] [--max-response 192] [--over 2]

The HF engine on one in-process rank runs a step's generation as one call stopped once the batch
is complete (chunks, ``rollout.partial_chunk_tokens``, serve other engines and ranks).
"""

from __future__ import annotations

import argparse
import json
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
    base = [f"model.path={GGUF}", *data, "data.val_files=[]", f"data.batch_size={args.batch}",
            f"rollout.n={args.n}", f"rollout.max_response_tokens={args.max_response}", f"train.total_steps={args.steps}",
            f"train.out_dir={out_dir / 'run'}", "train.save_every=0", "train.loggers=[]", f"model.dtype={args.dtype}", "train.lr=1e-6"]
    if mode == "colocate_async":
        base += ["trainer.rollout_mode=colocate_async", f"rollout.over_provision={args.over}",
                 f"rollout.max_staleness={args.max_staleness}"]
    return base


def _arm(args: argparse.Namespace, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "packrl.cli.main", "train", args.preset, *_overrides(args, Path(tmp), mode)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{mode} arm failed:\n{proc.stderr[-3000:]}")
        run_dir = Path(tmp) / "run"
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = lines[1:]
    gen = [line["timing_s/gen"] for line in timed]
    tokens = [line.get("async/generated_tokens", line["response_length/mean"] * args.batch * args.n) for line in timed]
    out = {"gen_s_median": statistics.median(gen), "gen_s": gen,
           "step_s_median": statistics.median(line["timing_s/step"] for line in timed),
           "generated_tokens_per_step": tokens, "decode_tokens_per_gen_s": sum(tokens) / sum(gen),
           "response_length_mean": statistics.mean(line["response_length/mean"] for line in timed),
           "response_length_max": max(line["response_length/max"] for line in timed),
           "score_mean": statistics.mean(line["critic/score/mean"] for line in timed)}
    if mode == "colocate_async":
        out |= {key: [line[f"async/{key}"] for line in timed] for key in
                ("staleness_token_mean", "staleness_token_max", "carried_groups", "reprefill_tokens", "partial_ratio", "num_chunks")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["gsm8k", "demo"], default="gsm8k",
                        help="gsm8k: GSM8K questions; demo: the built-in arithmetic task (short answers, a long tail of rambling)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=192)
    parser.add_argument("--over", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")
    require_shared()
    arms = {mode: _arm(args, mode) for mode in ("sync", "colocate_async")}
    report = {"command": " ".join(sys.argv), "settings": vars(args), "arms": arms,
              "gen_time_ratio_async_over_sync": arms["colocate_async"]["gen_s_median"] / arms["sync"]["gen_s_median"],
              "decode_rate_ratio_async_over_sync":
                  arms["colocate_async"]["decode_tokens_per_gen_s"] / arms["sync"]["decode_tokens_per_gen_s"]}
    emit(report, dtype=args.dtype)


if __name__ == "__main__":
    main()
