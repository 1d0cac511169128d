"""Kill the trainer with SIGKILL at random moments and resume each time (tiny random model, CPU).

A subprocess trains `tests/diagnostics/tiny_run.py` for ``--steps`` steps with a checkpoint every
step (`train.save_every=1`, `train.keep_last=2`) and `train.resume=auto`; this script kills it
with SIGKILL after a random delay (``--kills`` times; delays drawn over several steps, so kills
land in generation and the update; every third kill waits for the next checkpoint write and lands
inside it, leaving a `.tmp-step_N` folder), then starts it again, until a run finishes. Checks
after every restart: the run resumes from the newest complete checkpoint (its `resumed.txt`),
never from a `.tmp-step_N` folder, and no resume fails on a corrupt checkpoint; at the end
metrics.jsonl holds steps 1..N exactly once, in order. Prints one JSON object, naming the host
(``host``) and the tiny run's dtype (``dtype``: fp32, as `tests/diagnostics/tiny_run.py` sets it).

Then the same config runs once more, never killed, and the two are compared
(``matches_straight_run``, details in ``vs_straight_run``): every step's metrics (scores, lengths,
losses, and under partial rollouts the ledger counts, carried tokens and staleness) equal, and
the final checkpoint's weights bitwise equal. With ``--rollout-mode colocate_async`` the run carries
partial rollouts across steps (``rollout.over_provision=2``); the checkpoint then holds the pool and
the ledger of drawn prompts, and the two runs' final ledgers must be equal too: every prompt drawn,
trained at the same step, once.

Command (repository root; about 2 minutes, twice that with a rollout mode)::

    python bench/bench_kill_resume.py [--kills 10] [--steps 80] [--seed 0] [--rollout-mode sync|colocate_async] [--max-delay 6]

Measured (AMX host, 2 cores): ``--rollout-mode colocate_async --kills 10 --steps 300 --max-delay 10``: 10 kills (7 inside
a checkpoint write), every restart resumed from the newest complete checkpoint, steps 1..300 logged once
each, 600 prompts trained once each, every step's metrics, the final weights (largest difference 0.0)
and the ledger equal to the run never killed; 96 s.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import emit  # noqa: E402
from packrl.worker.checkpoint import weights_state_dict  # noqa: E402

TINY_RUN_DTYPE = "fp32"  # tests/diagnostics/tiny_run.py's BASE sets model.dtype=fp32


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _complete_checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "trainer_state.json").is_file())


def _kill(proc: subprocess.Popen, run_dir: Path, delay: float, in_checkpoint: bool) -> bool:
    """SIGKILL ``proc`` after ``delay`` seconds, or with ``in_checkpoint`` at the first checkpoint
    write after that (a ``.tmp-step_N`` folder appears). False when the run finished first."""
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        pass
    while in_checkpoint and proc.poll() is None and not list((run_dir / "checkpoints").glob(".tmp-step_*")):
        time.sleep(0.0005)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollout-mode", choices=["sync", "colocate_async"], default="sync")
    parser.add_argument("--max-delay", type=float, default=6.0,
                        help="kills land 2.5 s (imports) to this many seconds after a start; raise it when steps are slower")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="packrl-kill-")) / "run"
    mode = [] if args.rollout_mode == "sync" else [f"trainer.rollout_mode={args.rollout_mode}", "rollout.over_provision=2"]
    cmd = [sys.executable, "-m", "tests.diagnostics.tiny_run", str(run_dir), str(args.steps),
           "train.save_every=1", "train.keep_last=2", "train.resume=auto", *mode]
    kills, log, expected_resume = 0, [], None
    start = time.perf_counter()
    while True:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started = time.time()
        kill_at = time.monotonic() + rng.uniform(2.5, args.max_delay)  # interpreter + imports take ~2.5 s; a tiny step ~0.1-0.3 s
        if expected_resume is not None:
            _check_resumed_from(run_dir, expected_resume, proc)
        in_checkpoint = kills % 3 == 2  # every third kill lands inside a checkpoint write
        if kills < args.kills and _kill(proc, run_dir, max(0.0, kill_at - time.monotonic()), in_checkpoint):
            kills += 1
            done = _steps(run_dir)
            # temporary folders this run started writing (older ones are leftovers of earlier kills)
            tmp = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*") if p.stat().st_mtime >= started)
            complete = _complete_checkpoints(run_dir)
            expected_resume = complete[-1] if complete else None
            log.append({"kill": kills, "target": "checkpoint write" if in_checkpoint else "any moment",
                        "last_logged_step": done[-1] if done else 0, "tmp_written": tmp, "resume_from": expected_resume})
            continue
        proc.wait()
        if proc.returncode != 0:
            raise SystemExit(f"a run failed (rc {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        break
    steps = _steps(run_dir)
    result = {
        "kills": kills, "kills_inside_checkpoint_write": sum(bool(e["tmp_written"]) for e in log),
        "wall_s": round(time.perf_counter() - start, 1), "num_steps_logged": len(steps),
        "continuous": steps == list(range(1, args.steps + 1)),
        "checkpoints_left": sorted(p.name for p in (run_dir / "checkpoints").iterdir()), "log": log, "run_dir": str(run_dir),
    }
    straight = _matches_straight(run_dir, args.steps, mode)
    result["matches_straight_run"] = straight["metrics"] and straight["weights_max_abs_diff"] == 0.0 and straight["ledger"]
    result["vs_straight_run"] = straight
    emit(result, dtype=TINY_RUN_DTYPE, indent=1)
    if not result["continuous"] or not result["matches_straight_run"]:
        raise SystemExit("metrics.jsonl steps are not 1..N exactly once, or the run differs from the run never killed "
                         "(metrics, final weights or ledger)")


_COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "async/ledger_trained", "async/carried_tokens",
             "async/staleness_token_mean")


def _matches_straight(run_dir: Path, steps: int, mode: list[str]) -> dict:
    """The killed-and-resumed run against the same run never killed: metrics step by step
    (``metrics``), the final checkpoint's weights (``weights``: largest absolute difference of any
    parameter, 0.0 when bitwise equal) and the ledger of drawn prompts (``ledger``: each prompt's
    fate, trained at which step, equal; ``trained_once``: no prompt trained twice)."""
    straight = run_dir.parent / "straight"
    subprocess.run([sys.executable, "-m", "tests.diagnostics.tiny_run", str(straight), str(steps), "train.save_every=1",
                    "train.keep_last=2", *mode], cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (run_dir, straight)]
    final = [d / "checkpoints" / f"step_{steps}" for d in (run_dir, straight)]
    weights = [weights_state_dict(f) for f in final]
    diff = max((a - weights[1][k]).abs().max().item() for k, a in weights[0].items()) if weights[0].keys() == weights[1].keys() else None
    ledgers = [json.loads((f / "trainer_state.json").read_text()).get("rollout", {}).get("ledger") for f in final]
    trained = [state for state in (ledgers[0] or {"states": []})["states"] if state.startswith("trained")]
    return {"metrics": all(abs(a[key] - b[key]) <= 1e-6 for a, b in zip(*lines) for key in _COMPARED if key in a),
            "weights_max_abs_diff": diff, "ledger": ledgers[0] == ledgers[1], "ledger_present": ledgers[0] is not None,
            "num_trained_in_ledger": len(trained)}


def _check_resumed_from(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    """Wait until the restarted run notes where it resumed; it must be the newest complete checkpoint."""
    note = run_dir / "resumed.txt"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if note.is_file() and f"after step {step}\n" in note.read_text() + "\n":
            return
        time.sleep(0.01)
    text = note.read_text() if note.is_file() else "(no resumed.txt)"
    raise SystemExit(f"the restarted run did not resume from step_{step}, the newest complete checkpoint: {text}")


if __name__ == "__main__":
    main()
