"""``RUN_DIR/trace.json``: a Chrome trace-event file (opens in Perfetto or chrome://tracing).

Format: the JSON object form ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` of complete
events ``{"name", "cat", "ph": "X", "ts", "dur", "pid": 1, "tid": 1, "args"}``, ``ts`` and ``dur``
in microseconds (float) from the tracer's start. Per step: one ``step`` span (cat ``step``), one
span per stage (cat ``stage``: gen, reward, old_log_prob, ref, adv, update_actor; args ``step``,
``num_sequences``, ``num_tokens``) and one per update micro-batch (cat ``microbatch``; args
``step``, ``num_sequences``, ``num_tokens`` real tokens, ``num_positions`` pack positions).
All spans run on one thread (tid 1), so the viewers nest micro-batches inside update_actor. With
data-parallel workers (``trainer.num_workers > 1``) the micro-batch spans are the workers': each
rank's on its own thread (tid ``2 + rank``, named ``rank N`` by a metadata event, args add
``rank``), and ``otherData.ray_timeline`` names Ray's own timeline file in RUN_DIR. With sequence
parallelism (``trainer.sequence_parallel_size > 1``) every micro-batch span holds an
``all_to_all`` span (cat ``all_to_all``; args ``num_exchanges``): the micro-batch's forward
all-to-alls, which interleave with its compute, summed and drawn from the micro-batch's start.

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

    def all_to_all(self, seconds: float, num_exchanges: int) -> None:
        """The last micro-batch's summed forward all-to-all time (sequence parallelism); nothing here."""

    def add_worker_spans(self, rank: int, spans: list[RemoteSpan]) -> None:
        """Micro-batch spans a data-parallel worker recorded (`SpanRecorder`); nothing here."""

    def link(self, key: str, file_name: str) -> None:
        """Name a companion file of the trace (e.g. Ray's timeline) in its ``otherData``; nothing here."""


RemoteSpan = tuple[float, float, dict[str, Any]]
"""A span recorded in another process: wall-clock start and end (``time.time()``, seconds) and
args (``args["name"]``: the span's name when it is not ``microbatch``)."""


class SpanRecorder(NullTracer):
    """The tracer of a data-parallel worker: records micro-batch spans on the wall clock, for the
    controller's `Tracer.add_worker_spans` (workers may run on other machines)."""

    def __init__(self) -> None:
        self.spans: list[RemoteSpan] = []

    @contextmanager
    def microbatch(self, *, num_sequences: int, num_tokens: int, num_positions: int) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.spans.append((start, time.time(), {"num_sequences": num_sequences, "num_tokens": num_tokens,
                                                    "num_positions": num_positions}))

    def all_to_all(self, seconds: float, num_exchanges: int) -> None:
        start = self.spans[-1][0]
        self.spans.append((start, start + seconds, {"name": "all_to_all", "num_exchanges": num_exchanges}))


class Tracer(NullTracer):
    """Collects spans and rewrites ``path`` after every step.

    Args:
        path: where the trace goes (``RUN_DIR/trace.json``).
    """

    def __init__(self, path: Path):
        self.path = path
        self.origin = time.perf_counter()
        self.wall_origin = time.time()  # the same moment on the wall clock, for workers' spans
        self.events: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # micro-batch spans of the step in progress
        self.other: dict[str, str] = {}
        self._named_ranks: set[int] = set()

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

    def all_to_all(self, seconds: float, num_exchanges: int) -> None:
        """An ``all_to_all`` span inside the last micro-batch span: its summed forward all-to-alls."""
        last = self._pending[-1]
        start = self.origin + last["ts"] / 1e6
        self._pending.append(self._event("all_to_all", "all_to_all", start, start + seconds, {"num_exchanges": num_exchanges})
                             | {"tid": last["tid"]})

    def add_worker_spans(self, rank: int, spans: list[RemoteSpan]) -> None:
        """Add a worker's micro-batch spans to the step in progress, on thread ``2 + rank`` (named
        ``rank N``), placed by wall clock (machines' clocks are assumed in sync)."""
        tid = 2 + rank
        if rank not in self._named_ranks:
            self._named_ranks.add(rank)
            self.events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"rank {rank}"}})
        shift = self.origin - self.wall_origin
        for start, end, args in spans:
            name = args.get("name", "microbatch")
            args = {key: value for key, value in args.items() if key != "name"}
            event = self._event(name, name, start + shift, end + shift, {"rank": rank, **args})
            self._pending.append(event | {"tid": tid})

    def link(self, key: str, file_name: str) -> None:
        self.other[key] = file_name
        self.write()

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
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}
                                  | ({"otherData": self.other} if self.other else {})))
        os.replace(tmp, self.path)


def build_tracer(enabled: bool, run_dir: Path) -> NullTracer:
    """`Tracer` writing ``run_dir/trace.json`` when ``train.trace`` is on, else `NullTracer`."""
    return Tracer(run_dir / TRACE_FILE) if enabled else NullTracer()
