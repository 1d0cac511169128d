"""Read a model's config (never its weights) from a local dir, a `.gguf` file or a hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_model_config(path: str) -> Any:
    """The `transformers.PretrainedConfig` of ``model.path``.

    Args:
        path: a model directory with ``config.json``, a ``.gguf`` file (read through
            transformers' GGUF support, which needs the ``gguf`` package), or a hub id
            (local cache first; the hub when online).

    Returns:
        The config; nothing but the config file or the GGUF header is read.

    Raises:
        ValueError: the path does not exist, has no config, or cannot be read; the message
            names ``model.path`` and the value.
    """
    from transformers import AutoConfig

    p = Path(path).expanduser()
    try:
        if p.suffix == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"no such file {p}")
            return AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise FileNotFoundError(f"{p} has no config.json")
            return AutoConfig.from_pretrained(p)
        if p.is_absolute() or path.startswith((".", "~")):
            raise FileNotFoundError(f"no such directory {p}")
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"cannot read the model config of model.path={path!r}: {err}. "
            "Set model.path to a local model directory, a .gguf file or a reachable hub id"
        ) from err
