"""The loggers of ``train.loggers``: chosen from the ``train`` section; the backends that record the
config record the one the run writes to RUN_DIR/config.yaml (`ConfigRecord`)."""

from __future__ import annotations

import sys
import types
from dataclasses import asdict, replace

import pytest

from packrl.config import load_config
from packrl.config.load import to_yaml
from packrl.diagnostics.loggers import ConfigRecord, ConsoleLogger, MlflowLogger, WandbLogger, build_loggers
from packrl.trainer.run import Run


def _fake_backends(monkeypatch: pytest.MonkeyPatch) -> dict:
    """mlflow and wandb modules that keep what they are given."""
    seen: dict = {}
    mlflow = types.SimpleNamespace(start_run=lambda run_name: seen.update(mlflow_run=run_name),
                                   log_text=lambda text, name: seen.update({f"mlflow/{name}": text}),
                                   log_metrics=lambda metrics, step: None, end_run=lambda: None)
    run = types.SimpleNamespace(log=lambda metrics, step: None, finish=lambda: None)
    wandb = types.SimpleNamespace(init=lambda **kwargs: seen.update(wandb=kwargs) or run)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return seen


def test_loggers_are_chosen_from_the_train_section_and_record_the_config(tmp_path, monkeypatch):
    seen = _fake_backends(monkeypatch)
    cfg = load_config("demo")
    record = ConfigRecord(to_yaml(cfg), asdict(cfg))
    train = replace(cfg.train, loggers=["jsonl", "console", "mlflow", "wandb"])  # the packages checked at load are faked here
    loggers = build_loggers(train, tmp_path, record, total_steps=7)
    assert [type(sink) for sink in loggers] == [ConsoleLogger, MlflowLogger, WandbLogger]
    assert loggers[0].total_steps == 7
    assert build_loggers(replace(train, loggers=["console"]), tmp_path, record)[0].total_steps == cfg.train.total_steps
    assert seen["mlflow/config.yaml"] == to_yaml(cfg)
    assert seen["wandb"]["config"] == asdict(cfg) and seen["wandb"]["name"] == tmp_path.name
    with pytest.raises(ValueError, match=r"train.loggers=\['nope'\] names unknown loggers \['nope'\]"):
        build_loggers(replace(train, loggers=["nope"]), tmp_path, record)


def test_the_run_records_the_config_it_writes(tmp_path, monkeypatch):
    seen = _fake_backends(monkeypatch)
    cfg = load_config("demo", [f"train.out_dir={tmp_path / 'run'}"])
    cfg = replace(cfg, train=replace(cfg.train, loggers=["jsonl", "mlflow"]))
    with Run(cfg) as run:
        assert seen["mlflow/config.yaml"] == (run.dir / "config.yaml").read_text() == to_yaml(cfg)
