"""The libraries' own console output during a run, folded into packrl's log.

A training run's console holds one progress bar (``train.loggers`` ``console``) and packrl's own
notes and warnings above it. What transformers, huggingface_hub, peft and torch would print goes
elsewhere:

- progress bars: transformers' ``Loading weights`` (every ``from_pretrained``) and ``Writing
  model shards`` (every checkpoint), and the hub's download bars, are off
  (`transformers.utils.logging.disable_progress_bar`, which also calls
  `huggingface_hub.utils.disable_progress_bars`; ``HF_HUB_DISABLE_PROGRESS_BARS=1`` for the
  processes a run starts). The GGUF conversion's bar, which transformers draws with ``tqdm.auto``
  directly, goes to a buffer (`folded_bars`); the conversion is logged as one line.
- warnings (``warnings.warn``: deprecation notices and the like) become records of the
  ``py.warnings`` logger (`logging.captureWarnings`), each shown once per place as Python's
  filters decide; transformers' logger propagates to ``logging`` instead of printing.
  `packrl.trainer.run.Run` writes the records of `LIBRARY_LOGGERS` to ``RUN_DIR/train.log`` only.

`quiet_libraries` changes process-wide settings and is idempotent; a run calls it once at start,
and every worker process once when it is built.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator

LIBRARY_LOGGERS: tuple[str, ...] = ("py.warnings", "transformers", "huggingface_hub", "peft", "accelerate", "torch")
"""Loggers whose records a run writes to ``RUN_DIR/train.log`` and not to the console."""


def quiet_libraries() -> None:
    """Turn the libraries' progress bars off and route their warnings through ``logging``
    (see the module docstring)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read at import by processes started later (Ray workers)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if warnings.showwarning is not getattr(logging, "_showwarning", None):
        # capture was switched on before and the hook since restored (warnings.catch_warnings
        # does that on exit): captureWarnings(True) alone would then do nothing
        logging.captureWarnings(False)
    logging.captureWarnings(True)


@contextlib.contextmanager
def folded_bars(log: logging.Logger, what: str) -> Iterator[None]:
    """After `quiet_libraries`, send what a library writes to ``sys.stderr`` inside the block (a
    bar it draws with ``tqdm.auto`` itself) to a buffer and log its last line at DEBUG as
    ``<what>: <line>``; before it (``packrl preflight``, a script), leave the console alone.
    Exceptions pass through."""
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        lines = [part.strip() for part in buffer.getvalue().replace("\r", "\n").splitlines() if part.strip()]
        if lines:
            log.debug("%s: %s", what, lines[-1][:300])
