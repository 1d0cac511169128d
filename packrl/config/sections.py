"""Calling a config check with the sections it reads, named by its parameters.

A cross-field rule (`packrl.config.relations`, `packrl.config.sft_rules`) or a registered part's
config check (`packrl.registry.Registry.config_problems`) names the `RunConfig` sections it reads
as its parameters, e.g. ``def mini_batches(train: TrainConfig, data: DataConfig)``, and gets those
sections and nothing else, so what a rule depends on is in its signature. A check that reads the
whole config names its one parameter ``cfg`` (a plugin's check written before this, or one that
needs every section).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

R = TypeVar("R")

WHOLE_CONFIG = "cfg"
"""The parameter name that receives the whole `RunConfig`."""


@cache
def _parameter_names(function: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def call_with_sections(function: Callable[..., R], cfg: Any) -> R:
    """``function`` called with the sections of ``cfg`` (a `RunConfig`) its parameters name, by
    keyword (``cfg``: the whole config).

    Raises:
        TypeError: a parameter of ``function`` names neither a section of ``cfg`` nor ``cfg``
            (a mistake in the check's code, reported with the sections there are).
    """
    sections = {field.name for field in dataclasses.fields(cfg)}
    arguments: dict[str, Any] = {}
    for name in _parameter_names(function):
        if name == WHOLE_CONFIG:
            arguments[name] = cfg
        elif name in sections:
            arguments[name] = getattr(cfg, name)
        else:
            raise TypeError(f"config check {function.__qualname__} takes parameter {name!r}, which is not a section of the "
                            f"config: name sections ({', '.join(sorted(sections))}) or the whole config ({WHOLE_CONFIG})")
    return function(**arguments)
