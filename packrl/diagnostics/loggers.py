"""Step-metric loggers chosen by ``train.loggers``. ``RUN_DIR/metrics.jsonl`` is written by
`packrl.trainer.run.Run` whatever the choice; these are extra destinations.

- ``jsonl``: ``RUN_DIR/metrics.jsonl``, written by `packrl.trainer.run.Run` in any case.
- ``console``: the progress bar, with score, mean response length and clip ratio.
- ``tensorboard``: ``RUN_DIR/tensorboard`` through `torch.utils.tensorboard` (package ``tensorboard``).
- ``wandb``: a Weights & Biases run in project ``packrl`` (its own settings: ``WANDB_*`` variables).
- ``mlflow``: an MLflow run (its own settings: ``MLFLOW_TRACKING_URI``).

A missing package is a config problem raised before any model loads (`TrainConfig.problems`).
The backends that record the run's config (tensorboard, wandb, mlflow) get it as a `ConfigRecord`,
made once by the run, not the `RunConfig` itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from packrl.config.schema import TrainConfig


class MetricLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ConfigRecord:
    """The resolved run config as the backends record it.

    Attributes:
        yaml: its YAML text (``RUN_DIR/config.yaml``, `packrl.config.load.to_yaml`).
        values: the same as nested plain values (``dataclasses.asdict`` of the config).
    """

    yaml: str
    values: dict[str, Any]


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics (the backends reject NaN, inf and text)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class ConsoleLogger:
    """The progress bar on stderr, at the number of the step last logged. The bar is drawn when
    the steps begin (`start`, or the first `log`), after the run's notes (model.txt, budgets.txt),
    so no multi-line note is ever written while a bar holds the terminal's last line."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self._bar: Any = None

    @property
    def bar(self) -> Any:
        if self._bar is None:
            self._bar = tqdm(total=self.total_steps, desc="packrl", unit="step", dynamic_ncols=True, file=sys.stderr)
        return self._bar

    def start(self, done_steps: int = 0) -> None:
        """Draw the bar, at ``done_steps`` (a resumed run starts past 0)."""
        self.bar.update(done_steps - self.bar.n)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "sft/loss" in metrics:  # a packrl sft step: no rollout to show
            self.bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}", tokens=f"{metrics.get('sft/num_tokens', 0.0):.0f}")
        else:
            self.bar.set_postfix(
                score=f"{metrics.get('critic/score/mean', 0.0):.3f}",
                resp_len=f"{metrics.get('response_length/mean', 0.0):.0f}",
                clip=f"{metrics.get('response_length/clip_ratio', 0.0):.2f}",
            )
        self.bar.update(step - self.bar.n)  # the step's own number: a resumed run starts past 0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class TensorBoardLogger:
    """Scalars under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``), the resolved
    config as text."""

    def __init__(self, run_dir: Path, config: ConfigRecord):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + config.yaml + "\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, config: ConfigRecord):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="packrl", name=run_dir.name, dir=str(run_dir), config=config.values)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, run_dir: Path, config: ConfigRecord):
        import mlflow

        self.mlflow = mlflow
        mlflow.start_run(run_name=run_dir.name)
        mlflow.log_text(config.yaml, "config.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(_numbers(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def build_loggers(train: TrainConfig, run_dir: Path, config: ConfigRecord, total_steps: int | None = None) -> list[MetricLogger]:
    """One logger per name in ``train.loggers`` (``train``: the ``train`` section), in order; the
    console's bar counts ``total_steps`` (None: ``train.total_steps``); the backends that record
    the config record ``config``.

    Raises:
        ValueError: an unknown name (the config loader rejects those first).
    """
    makers: dict[str, Callable[[], MetricLogger]] = {
        "console": lambda: ConsoleLogger(train.total_steps if total_steps is None else total_steps),
        "tensorboard": lambda: TensorBoardLogger(run_dir, config),
        "wandb": lambda: WandbLogger(run_dir, config),
        "mlflow": lambda: MlflowLogger(run_dir, config),
    }
    names = [name for name in train.loggers if name != "jsonl"]  # Run writes metrics.jsonl itself
    unknown = [name for name in names if name not in makers]
    if unknown:
        raise ValueError(f"train.loggers={train.loggers!r} names unknown loggers {unknown}; choose from jsonl, {', '.join(makers)}")
    return [makers[name]() for name in names]
