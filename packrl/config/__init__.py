"""Typed run configuration: dataclass schema, YAML presets, dotlist overrides."""

from packrl.config.load import check_config, load_config, preset_names, to_yaml
from packrl.config.relations import config_problems
from packrl.config.schema import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from packrl.errors import ConfigError, ConfigProblem

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "ConfigProblem",
    "DataConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "check_config",
    "config_problems",
    "load_config",
    "preset_names",
    "to_yaml",
]
