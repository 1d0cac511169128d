"""``RUN_DIR/trace.json``: a Chrome trace-event file (opens in Perfetto or chrome://tracing).

Format: the JSON object form ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` of complete
events ``{"name", "cat", "ph": "X", "ts", "dur", "pid": 1, "tid": 1, "args"}``, ``ts`` and ``dur``
in microseconds (float) from the tracer's start. Per step: one ``step`` span (cat ``step``), one
span per stage (cat ``stage``: gen, reward, old_log_prob, ref, adv, update_actor; args ``step``,
``num_sequences``, ``num_tokens``) and one per update micro-batch (cat ``microbatch``; args
``step``, ``num_sequences``, ``num_tokens`` real tokens, ``num_positions`` pack positions).
All spans run on one thread (tid 1), so the viewers nest micro-batches inside update_actor.

The whole file is rewritten after every step (temporary file + `os.replace`), so it is valid
JSON at any moment, also after ``kill -9``. Cost: one JSON dump of the events so far, about
1 ms per 1,000 events.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packrl.diagnostics.timers import Span

TRACE_FILE = "trace.json"


class NullTracer:
    """The tracer of ``train.trace=false``: records nothing, writes nothing."""

    @contextmanager
    def microbatch(self, *, num_sequences: int, num_tokens: int, num_positions: int) -> Iterator[None]:
        yield

    def end_step(self, step: int, spans: list[Span], *, num_sequences: int, num_tokens: int) -> None:
        pass


class Tracer(NullTracer):
    """Collects spans and rewrites ``path`` after every step.

    Args:
        path: where the trace goes (``RUN_DIR/trace.json``).
    """

    def __init__(self, path: Path):
        self.path = path
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # micro-batch spans of the step in progress

    def _event(self, name: str, cat: str, start: float, end: float, args: dict[str, Any]) -> dict[str, Any]:
        ts = round((start - self.origin) * 1e6, 3)
        dur = max(0.0, round((end - self.origin) * 1e6 - ts, 3))
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}

    @contextmanager
    def microbatch(self, *, num_sequences: int, num_tokens: int, num_positions: int) -> Iterator[None]:
        """Time one update micro-batch (forward + backward)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            args = {"num_sequences": num_sequences, "num_tokens": num_tokens, "num_positions": num_positions}
            self._pending.append(self._event("microbatch", "microbatch", start, time.perf_counter(), args))

    def end_step(self, step: int, spans: list[Span], *, num_sequences: int, num_tokens: int) -> None:
        """Add the step's stage spans (from `stage_timer`) and its micro-batch spans, then
        rewrite the file. ``num_sequences``/``num_tokens``: the step's sequences and their
        prompt + response tokens, the work every stage handles."""
        for name, start, end in spans:
            args = {"step": step, "num_sequences": num_sequences, "num_tokens": num_tokens}
            self.events.append(self._event(name, "step" if name == "step" else "stage", start, end, args))
        for event in self._pending:
            event["args"] = {"step": step, **event["args"]}
        self.events += self._pending
        self._pending = []
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.path)


def build_tracer(enabled: bool, run_dir: Path) -> NullTracer:
    """`Tracer` writing ``run_dir/trace.json`` when ``train.trace`` is on, else `NullTracer`."""
    return Tracer(run_dir / TRACE_FILE) if enabled else NullTracer()
