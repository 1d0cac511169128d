"""Read a model's config (never its weights when avoidable) from any form of ``model.path``."""

from __future__ import annotations

from typing import Any


def load_model_config(path: str) -> Any:
    """The `transformers.PretrainedConfig` of ``model.path``.

    Args:
        path: anything `packrl.models.loading.resolve_model` accepts: a model directory with
            ``config.json``, a ``.gguf`` file (its header is read through transformers' GGUF
            support, which needs the ``gguf`` package), a hub id (HF cache first, then the hub;
            only the small json/text files are fetched), or the alias ``smollm2-135m-instruct``
            (its packrl cache or HF cache when present; otherwise it is resolved fully, which
            downloads and converts the weights once).

    Returns:
        The config.

    Raises:
        ValueError: the path does not resolve, has no config, or cannot be read; the message
            names ``model.path`` and the value.
    """
    from transformers import AutoConfig

    from packrl.models.loading import resolve_model

    resolved = resolve_model(path, weights=False)
    try:
        return AutoConfig.from_pretrained(resolved.model_dir, **resolved.load_kwargs())
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"cannot read the model config of model.path={path!r} from {resolved.source}: {err}. "
            "Set model.path to a local model directory, a .gguf file or a reachable hub id"
        ) from err
