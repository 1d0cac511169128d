"""Training from a command line: `packrl train`, `packrl sft` and `packrl verl` share how a run's end is reported."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packrl.config import RunConfig


def train_and_report(cfg: RunConfig, command: str, run: Callable[[RunConfig], Path] | None = None) -> int:
    """Train ``cfg`` with ``run`` (default: RL, `packrl.trainer.loop.train`); failures become one
    message on stderr prefixed with ``command``, not a traceback.

    Returns:
        0 done (RUN_DIR printed), 2 a data, model, reward, output or step failure, 130 interrupted.
    """
    from packrl.trainer.loop import train

    sys.stdout.flush()
    try:
        run_dir = (run or train)(cfg)
    except (ValueError, OSError, RuntimeError) as err:
        notes = " ".join(getattr(err, "__notes__", []))
        print(f"{command}: {err}" + (f" {notes}" if notes else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        where = " ".join(getattr(err, "__notes__", [])) or "before the run directory was made"
        print(f"{command}: interrupted {where}", file=sys.stderr)
        return 130
    print(f"run finished: {run_dir}")
    return 0
