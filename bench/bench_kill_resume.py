"""Kill the trainer with SIGKILL at random moments and resume each time (tiny random model, CPU).

A subprocess trains `tests/diagnostics/tiny_run.py` for ``--steps`` steps with a checkpoint every
step (`train.save_every=1`, `train.keep_last=2`) and `train.resume=auto`; this script kills it
with SIGKILL after a random delay (``--kills`` times; delays drawn up to about two steps, so kills
land in generation, the update and checkpoint writes alike), then starts it again, until a run
finishes. Checks after every restart: the resumed run starts right after its newest complete
checkpoint; no `.tmp-step_N` folder is ever chosen; and at the end metrics.jsonl holds steps
1..N exactly once, in order. Prints one JSON object.

Command (repository root; about 2 minutes)::

    python bench/bench_kill_resume.py [--kills 10] [--steps 80] [--seed 0]
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


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="packrl-kill-")) / "run"
    cmd = [sys.executable, "-m", "tests.diagnostics.tiny_run", str(run_dir), str(args.steps),
           "train.save_every=1", "train.keep_last=2", "train.resume=auto"]
    kills, restarts, log = 0, 0, []
    start = time.perf_counter()
    while True:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < args.kills:
            delay = rng.uniform(2.5, 6.0)  # interpreter + imports take ~2.5 s; a tiny step ~0.3 s
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                done = _steps(run_dir)
                tmp = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*")) if (run_dir / "checkpoints").is_dir() else []
                log.append({"kill": kills, "after_s": round(delay, 2), "last_logged_step": done[-1] if done else 0, "tmp_left": tmp})
                restarts += 1
                continue
        else:
            proc.wait()
        if proc.returncode != 0:
            raise SystemExit(f"a run failed (rc {proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        break
    steps = _steps(run_dir)
    result = {
        "kills": kills, "restarts": restarts, "wall_s": round(time.perf_counter() - start, 1),
        "steps_logged": steps, "continuous": steps == list(range(1, args.steps + 1)),
        "checkpoints_left": sorted(p.name for p in (run_dir / "checkpoints").iterdir()), "log": log, "run_dir": str(run_dir),
    }
    print(json.dumps(result, indent=1))
    if not result["continuous"]:
        raise SystemExit("metrics.jsonl steps are not 1..N exactly once")


if __name__ == "__main__":
    main()
