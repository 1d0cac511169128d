"""Observability overhead: the demo step with every per-step output on vs off, in one process.

On: ``train.dump_rollouts=true``, ``train.trace=true`` and ``train.loggers=[console,tensorboard]``
(tensorboard when installed). Off: ``train.dump_rollouts=false``, ``train.trace=false``,
``train.loggers=[console]``. The ``bucket/*`` metrics have no switch and run in both arms; the
mismatch metrics need ``rollout.return_logprobs=true``, which adds the old-log-prob forward and is
left out of both.

Each run trains the demo preset (SmolLM2-135M-Instruct) for ``--steps`` steps from the same
weights and seed, so every run generates the same responses; the arms alternate run by run
(off, on, on, off, off, on for 3 rounds) to cancel drift in machine load. Prints one JSON object:
per run the wall time of the whole ``train()`` call (files included), the step times
(``perf/time_per_step``) and the mean response length (equal across runs when they did the same
work); ``ratio`` = total wall on / total wall off (target <= 1.05) and ``ratio_step`` = the same
for the step times alone. The JSON also names the host (``host``) and the compute dtype
(``dtype``: ``model.dtype`` as configured, ``auto`` unless an override sets it, and what it
resolved to here).

Command (3 one-step runs per arm; about 2 minutes on 2 idle CPU cores)::

    python bench/bench_observability.py [--steps 1] [--rounds 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import emit  # noqa: E402
from packrl.config import load_config  # noqa: E402
from packrl.distributed.local import local_group  # noqa: E402
from packrl.models.loading import load_policy  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402

ON = ["train.dump_rollouts=true", "train.trace=true"]
OFF = ["train.dump_rollouts=false", "train.trace=false", "train.loggers=[console]"]


def _on_overrides() -> list[str]:
    loggers = "[console,tensorboard]" if importlib.util.find_spec("tensorboard") else "[console]"
    return [*ON, f"train.loggers={loggers}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="each round runs both arms; the order alternates")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides of the demo preset")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="packrl-observability-"))
    base = ["data.val_files=[]", f"train.total_steps={args.steps}", *args.overrides]
    arms = {"off": OFF, "on": _on_overrides()}
    base_model = load_config("demo", base).model
    model, tokenizer = load_policy(base_model)
    initial = copy.deepcopy(model.state_dict())
    runs: list[dict] = []
    for r in range(args.rounds):
        for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
            cfg = load_config("demo", [*base, *arms[arm], f"train.out_dir={out / f'{r}-{arm}'}"])
            model.load_state_dict(initial)
            workers = local_group(cfg, model, tokenizer)
            start = time.perf_counter()
            run_dir = train(cfg, workers)
            wall = time.perf_counter() - start
            lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            runs.append({"arm": arm, "wall_s": round(wall, 3),
                         "step_s": [round(x["perf/time_per_step"], 3) for x in lines],
                         "response_length_mean": [x["response_length/mean"] for x in lines]})
    total = {arm: sum(x["wall_s"] for x in runs if x["arm"] == arm) for arm in arms}
    steps = {arm: sum(sum(x["step_s"]) for x in runs if x["arm"] == arm) for arm in arms}
    emit({
        "bench": "observability", "steps_per_run": args.steps, "rounds": args.rounds, "on": arms["on"],
        "runs": runs, "total_on_s": round(total["on"], 3), "total_off_s": round(total["off"], 3),
        "ratio": round(total["on"] / total["off"], 4), "ratio_step": round(steps["on"] / steps["off"], 4), "target": 1.05,
    }, dtype=base_model.dtype)


if __name__ == "__main__":
    main()
