"""Named stage timers: ``with stage_timer(timing, "gen"):`` records wall seconds as ``timing["gen"]``.

Given a ``spans`` list, the timer also appends ``(name, start_s, end_s)`` read from
`time.perf_counter`, the clock `packrl.diagnostics.trace.Tracer` uses for micro-batch spans,
so a stage span and the micro-batch spans inside it nest exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

Span = tuple[str, float, float]
"""(stage name, start, end): `time.perf_counter` seconds."""


@contextmanager
def stage_timer(timing: dict[str, float], name: str, spans: list[Span] | None = None) -> Iterator[None]:
    """Add the wall time of the block, in seconds, to ``timing[name]``; append its span to ``spans``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        timing[name] = timing.get(name, 0.0) + end - start
        if spans is not None:
            spans.append((name, start, end))
