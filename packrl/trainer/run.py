"""A run's side effects: RUN_DIR, logs, metrics.jsonl, progress bar, schedules, validation."""

from __future__ import annotations

import json
import logging
import math
import random
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from packrl.config.load import to_yaml
from packrl.config.schema import RunConfig
from packrl.diagnostics.loggers import ConfigRecord, build_loggers
from packrl.seqlen.prompt_policy import PromptAccounting
from packrl.trainer.restarts import RESTARTS_FILE, RestartLog

logger = logging.getLogger("packrl")

class AccountedRows(Protocol):
    """Data whose every input row is accounted for (`packrl.data.dataset.PromptDataset`,
    `packrl.data.traces.Traces`)."""

    @property
    def accounting(self) -> PromptAccounting:
        """Every input row's outcome."""
        ...

    def accounting_dict(self) -> dict[str, Any]: ...


def due(step: int, every: int, total: int) -> bool:
    """True on every ``every``-th step and on the last one (``every`` 0 = only the last)."""
    return step == total or (every > 0 and step % every == 0)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (torch's seeds every CUDA device too). The loop
    calls it before every step with a seed derived from ``train.seed`` and the step, which is what
    lets a resumed run draw exactly what the uninterrupted run drew without saving RNG states."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _json_number(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


class _ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


class _OneLine(logging.Filter):
    """A library's record as one line (a captured warning also quotes its source line); packrl's
    own records pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("packrl"):
            return True
        lines = record.getMessage().strip().splitlines()
        record.msg, record.args = (lines[0] if lines else ""), ()
        return True


def _detach_run_handlers() -> None:
    """Remove and close the handlers a `Run` attached (marked ``_packrl_run``) from the
    ``packrl`` logger and the libraries' loggers."""
    from packrl.models.quiet import LIBRARY_LOGGERS

    for owner in (logging.getLogger("packrl"), *(logging.getLogger(name) for name in LIBRARY_LOGGERS)):
        for handler in [h for h in owner.handlers if getattr(h, "_packrl_run", False)]:
            owner.removeHandler(handler)
            handler.close()


class Run:
    """RUN_DIR (``train.out_dir`` or ``runs/<timestamp>``) with ``config.yaml``, ``train.log``,
    ``metrics.jsonl`` (one JSON object per step) and the loggers of ``train.loggers`` (``console``:
    a live progress bar of ``total_steps``: ``train.total_steps`` unless the recipe counts its own,
    as `packrl sft` does with ``sft.total_steps``). With ``trainer.max_restarts > 0`` it holds
    ``restarts``, the run's `packrl.trainer.restarts.RestartLog` (``RUN_DIR/restarts.jsonl``), and
    every step also logs ``train/restarts``, the lines of restarts.jsonl so far."""

    def __init__(self, cfg: RunConfig, total_steps: int | None = None):
        self.cfg = cfg
        self.last_step: int | None = None  # the step metrics.jsonl ends at (set by log_step and truncate_metrics)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = Path(cfg.train.out_dir or f"runs/{stamp}-{secrets.token_hex(2)}").expanduser().resolve()
        if cfg.train.resume is None and (self.dir / "metrics.jsonl").is_file() and (self.dir / "metrics.jsonl").stat().st_size:
            raise ValueError(f"train.out_dir={str(self.dir)!r} already holds a run (metrics.jsonl); set train.resume=auto to "
                             "continue it, or choose a new train.out_dir")
        config = ConfigRecord(to_yaml(cfg), asdict(cfg))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(config.yaml)
        except OSError as err:
            raise ValueError(f"train.out_dir={str(self.dir)!r} cannot be written ({err}); choose a writable train.out_dir") from err
        self._setup_logging()
        self.metrics_path = self.dir / "metrics.jsonl"
        self.loggers = build_loggers(cfg.train, self.dir, config, total_steps)
        self.restarts = RestartLog(self.dir / RESTARTS_FILE) if cfg.trainer.max_restarts > 0 else None

    def _setup_logging(self) -> None:
        """packrl's records to train.log (warnings also to the console, above the bar); the
        libraries' bars off and their warnings to train.log only (`packrl.models.quiet`)."""
        from packrl.models.quiet import LIBRARY_LOGGERS, quiet_libraries

        quiet_libraries()
        _detach_run_handlers()
        root = logging.getLogger("packrl")
        root.setLevel(logging.INFO)
        libraries = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
        handler = logging.FileHandler(self.dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_OneLine())
        console = _ConsoleHandler(logging.WARNING)  # warnings also reach the terminal, above the progress bar
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        for h in (handler, console):
            setattr(h, "_packrl_run", True)  # a marker, read back with getattr to detach the run's handlers
            root.addHandler(h)
        for library in libraries:
            library.addHandler(handler)

    def note(self, name: str, text: str) -> None:
        """Log ``text`` and keep it as ``RUN_DIR/<name>``."""
        (self.dir / name).write_text(text + "\n")
        logger.info("%s:\n%s", name, text)
        tqdm.write(text, file=sys.stderr)

    def write_json(self, name: str, data: Any) -> None:
        (self.dir / name).write_text(json.dumps(data, indent=2, default=lambda o: asdict(o)))

    def write_accounting(self, note: str, splits: Mapping[str, AccountedRows], detail: str = "") -> None:
        """Every input row of each split, kept / truncated / filtered / rejected with the reason,
        the same for every recipe (RL's prompts, SFT's traces): the first split's summary (and
        ``detail``) as ``RUN_DIR/<note>`` and every split's rows (`AccountedRows.accounting_dict`,
        `packrl.data.prompts.accounting_dict`) in ``RUN_DIR/data_accounting.json``."""
        name, first = next(iter(splits.items()))
        self.note(note, f"{name}: {first.accounting.summary()}" + (f"; {detail}" if detail else ""))
        self.write_json("data_accounting.json", {key: rows.accounting_dict() for key, rows in splits.items()})

    def start_steps(self, done_steps: int) -> None:
        """The steps begin after ``done_steps`` completed ones: loggers that draw (the console's
        progress bar) start drawing."""
        for sink in self.loggers:
            start = getattr(sink, "start", None)  # optional: not part of the MetricLogger protocol
            if callable(start):
                start(done_steps)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Append one line to metrics.jsonl and pass the metrics to every logger. The first step
        logged after a restart completes its record (its start: now less ``timing_s/step``)."""
        if self.restarts is not None:
            self.restarts.step_began(time.time() - float(metrics.get("timing_s/step", 0.0)))
            metrics = metrics | {"train/restarts": float(len(self.restarts))}
        record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self.last_step = step
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("step %d %s", step, json.dumps(record))
        for sink in self.loggers:
            sink.log(step, metrics)

    def truncate_metrics(self, last_step: int) -> None:
        """Keep the metrics.jsonl lines of steps <= ``last_step`` (a resumed run redoes the rest)."""
        if not self.metrics_path.is_file():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= last_step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self.last_step = last_step

    def close(self) -> None:
        """Close the loggers and stop writing packrl's and the libraries' records to this run's
        train.log and console: after the run its folder may be moved or deleted."""
        for sink in self.loggers:
            sink.close()
        _detach_run_handlers()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        self.close()  # also on errors, so a message never lands on the progress bar's line
        if isinstance(exc, Exception):  # the traceback goes to train.log; the console gets one line
            import traceback

            where = f"after step {self.last_step} was logged" if self.last_step is not None else "before any step was logged"
            with (self.dir / "train.log").open("a") as f:
                f.write(f"failed {where}:\n" + "".join(traceback.format_exception(exc)))
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"({where}; traceback in {self.dir / 'train.log'})")
        elif isinstance(exc, KeyboardInterrupt) and hasattr(exc, "add_note"):
            exc.add_note(self._kept())

    def _kept(self) -> str:
        """What an interrupted run leaves: the last logged step and the newest checkpoint."""
        from packrl.worker.checkpoint import resume_candidates

        last = self.last_step
        if last is None:
            return f"before any step completed; {self.dir} holds no step"
        saved = resume_candidates(self.dir, "auto")
        if not saved:
            return (f"after step {last}; its metrics are in {self.dir / 'metrics.jsonl'}, and no checkpoint was saved "
                    f"(train.save_every={self.cfg.train.save_every})")
        return (f"after step {last}; its metrics are in {self.dir / 'metrics.jsonl'}, the newest checkpoint is {saved[0]} "
                f"(continue with train.resume=auto train.out_dir={self.dir})")
