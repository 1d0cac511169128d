"""The record of a run's automatic restarts: ``RUN_DIR/restarts.jsonl``, one `RestartRecord` per
line, written by one `RestartLog` (`packrl.trainer.recovery` adds each restart, the run's
`packrl.trainer.run.Run` reports the first step logged after it).

A line is written when the restart happens, so a run that fails again before its next step still
has it, with ``startup_s`` and ``seconds_lost`` null; the first step logged after the restart
fills them in (the file rewritten whole, atomically). Lines written by an earlier process of the
same RUN_DIR (a run resumed by hand after its restarts) are kept as they were read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

RESTARTS_FILE = "restarts.jsonl"
"""One line per automatic restart of the run."""


@dataclass(frozen=True)
class RestartRecord:
    """One automatic restart, as its line of restarts.jsonl holds it (docs/distributed.md).

    Attributes:
        restart: 1, 2, ... within the process that restarted (``trainer.max_restarts`` counts these).
        detected_at: when the failure was detected, UTC ISO 8601 with milliseconds.
        failed: what died, where and why: `packrl.distributed.health.WorkerLost.to_json` (``role``,
            ``actor_name``, ``actor_id``, ``node_id``, ``node_ip``, ``pid``, ``stage``, ``step``,
            ``kind``, ``cause``).
        resumed_from: the checkpoint the next attempt resumes from; None: it starts at step 1.
        resumed_step: that checkpoint's step (0 for none).
        last_logged_step: the last step metrics.jsonl held at the failure.
        steps_redone: logged steps thrown away, ``max(0, last_logged_step - resumed_step)``.
        work_lost_s: seconds from the checkpoint (or the attempt's start, if later) to the failure.
        teardown_s: seconds from the failure until the group was torn down.
        waited_s: seconds waited for the cluster to hold the run again.
        startup_s: seconds from the restart until the resumed run's first step began (the new
            group and the checkpoint load); None until that step is logged.
        seconds_lost: ``work_lost_s + teardown_s + waited_s + startup_s``; None until then.
    """

    restart: int
    detected_at: str
    failed: dict[str, Any]
    resumed_from: str | None
    resumed_step: int
    last_logged_step: int
    steps_redone: int
    work_lost_s: float
    teardown_s: float
    waited_s: float
    startup_s: float | None = None
    seconds_lost: float | None = None

    def started(self, startup_s: float) -> RestartRecord:
        """This record with the resumed run's start-up (rounded to ms) and the seconds lost in all."""
        startup = round(max(0.0, startup_s), 3)
        return replace(self, startup_s=startup, seconds_lost=round(self.work_lost_s + self.teardown_s + self.waited_s + startup, 3))

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object, keys in the order of the attributes."""
        return asdict(self)


class RestartLog:
    """``RUN_DIR/restarts.jsonl`` and its one writer.

    Args:
        path: the file; the lines it already holds (an earlier process's restarts) are kept and counted.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._earlier = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        self.records: list[RestartRecord] = []
        """This process's restarts, in order."""
        self._pending: tuple[int, float] | None = None  # (index in records, when the next attempt began)

    def __len__(self) -> int:
        """Restarts of the run so far, earlier processes' included (``train/restarts``)."""
        return len(self._earlier) + len(self.records)

    def add(self, record: RestartRecord, relaunched_at: float) -> None:
        """Append ``record`` as a line now; the first step that begins after ``relaunched_at``
        (unix seconds: when the next attempt started) completes it (`step_began`)."""
        self.records.append(record)
        self._pending = (len(self.records) - 1, relaunched_at)
        with self.path.open("a") as f:
            f.write(json.dumps(record.to_json()) + "\n")

    def step_began(self, began: float) -> None:
        """A step that began at ``began`` (unix seconds) was logged: the restart waiting for its
        first step gets its ``startup_s`` and ``seconds_lost`` (the file rewritten); nothing otherwise."""
        if self._pending is None:
            return
        index, relaunched_at = self._pending
        self._pending = None
        self.records[index] = self.records[index].started(began - relaunched_at)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in [*self._earlier, *(json.dumps(r.to_json()) for r in self.records)]))
        os.replace(tmp, self.path)
