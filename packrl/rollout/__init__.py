"""Rollout: the engine contract (`SamplingParams`, `RolloutEngine`) and the transformers engine
(`HFEngine`).

Names are imported on first use, so building sampling parameters does not load transformers.
"""

from packrl._lazy import lazy_exports

_EXPORTS = {
    "SamplingParams": "engine",
    "RolloutEngine": "engine",
    "HFEngine": "hf_engine",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports("packrl.rollout", _EXPORTS)
