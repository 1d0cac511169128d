"""Rollout: the engine contract (`SamplingParams`, `RolloutEngine`) and the transformers engine
(`HFEngine`).

Names are imported on first use, so building sampling parameters does not load transformers.
"""

from importlib import import_module

_EXPORTS = {
    "SamplingParams": "engine",
    "RolloutEngine": "engine",
    "HFEngine": "hf_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'packrl.rollout' has no attribute {name!r}")
    return getattr(import_module(f"packrl.rollout.{_EXPORTS[name]}"), name)
