"""Named stage timers: ``with stage_timer(timing, "gen"):`` records wall seconds as ``timing["gen"]``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stage_timer(timing: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block, in seconds, to ``timing[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
