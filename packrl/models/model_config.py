"""Read a model's config (never its weights when avoidable) from any form of ``model.path``, and
apply ``model.rope_scaling`` to it (`apply_rope_scaling`), so the context a run will have is known
before any weight is loaded."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packrl.config.schema import RopeScalingConfig


def load_model_config(path: str) -> Any:
    """The `transformers.PretrainedConfig` of ``model.path``.

    Args:
        path: anything `packrl.models.resolve.resolve_model` accepts: a model directory with
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

    from packrl.models.resolve import resolve_model

    resolved = resolve_model(path, weights=False)
    try:
        return AutoConfig.from_pretrained(resolved.model_dir, **resolved.load_kwargs())
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"cannot read the model config of model.path={path!r} from {resolved.source}: {err}. "
            "Set model.path to a local model directory, a .gguf file or a reachable hub id"
        ) from err


def check_text_model(config: Any, path: str) -> None:
    """Refuse a multimodal checkpoint (a vision tower beside the language model): packrl trains
    causal LMs on text, and transformers would build only the text model from such a config,
    leaving the checkpoint's ``model.language_model.*`` weights unused (a random policy).

    Raises:
        ValueError: the config has a ``vision_config``; the message names the text model type
            that trains instead.
    """
    if getattr(config, "vision_config", None) is None:
        return
    text = getattr(config, "text_config", None)
    text_type = getattr(text, "model_type", None)
    instead = (f"a text-only checkpoint of the family (config.json with model_type {text_type!r}, e.g. the language model "
               "saved alone as its *ForCausalLM class)") if text_type else "a text-only checkpoint of the family"
    raise ValueError(f"model.path={path!r} is a multimodal checkpoint ({type(config).__name__}: a vision tower beside its "
                     f"language model); packrl does not train multimodal checkpoints yet (packrl audit counts their image "
                     f"tokens). Set model.path to {instead}")


_STRETCHING = ("linear", "dynamic", "yarn")


def apply_rope_scaling(config: Any, rope: RopeScalingConfig) -> Any:
    """A copy of a model config with ``model.rope_scaling`` applied; reads no weights.

    The RoPE types stretch the positions a model was trained on by ``factor``:

    - ``linear``: position interpolation, positions divided by ``factor`` (Chen et al. 2023,
      "Extending Context Window of Large Language Models via Positional Interpolation").
    - ``dynamic``: dynamic NTK, the RoPE base grows with the sequence once it passes
      ``max_position_embeddings`` (transformers' ``dynamic`` rope type).
    - ``yarn``: YaRN, NTK-by-parts interpolation plus an attention temperature of
      0.1 ln(factor) + 1 (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
      Language Models"), with ``original_max_position_embeddings`` = the model's
      ``max_position_embeddings``.

    The model context (`packrl.seqlen.budgets.model_context_tokens` of the result) becomes
    ``max_position_embeddings x factor``; ``max_position_embeddings`` itself is not changed.
    ``packrl preflight`` calls this on `load_model_config`'s result; `load_policy` builds the
    model from the result, so the RoPE frequencies are computed with the scaling.

    Args:
        config: a `transformers.PretrainedConfig` (transformers >= 5 keeps RoPE settings in
            ``rope_parameters``, earlier versions in ``rope_scaling``; both are handled).
        rope: the ``model.rope_scaling`` section.

    Returns:
        ``config`` itself when ``rope.type`` is ``none``, else a deep copy with the scaling set.

    Raises:
        ValueError: the config has no positive ``max_position_embeddings``; its RoPE settings are
            per layer type (nested) or already scaled (a RoPE type other than ``default``), which
            ``model.rope_scaling`` would silently replace; or ``factor`` is not > 1.
    """
    if rope.type == "none":
        return config
    where = "model.rope_scaling"
    max_pos = getattr(config, "max_position_embeddings", None)
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise ValueError(f"{where}.type={rope.type} needs the model config's max_position_embeddings, which is {max_pos!r}; "
                         f"set {where}.type=none or use a model whose config.json states it")
    if rope.type not in _STRETCHING or not rope.factor > 1.0:
        raise ValueError(f"{where}.type={rope.type!r} factor={rope.factor} cannot stretch the context: the type must be one of "
                         f"{', '.join(_STRETCHING)} and the factor > 1; set {where}.factor=2.0 or {where}.type=none")
    new_style = getattr(config, "rope_parameters", None) is not None
    current = dict((config.rope_parameters if new_style else getattr(config, "rope_scaling", None)) or {})
    if current and all(isinstance(v, dict) for v in current.values()):
        raise ValueError(f"the model config has RoPE settings per layer type ({', '.join(current)}), which {where} does not "
                         f"scale; set {where}.type=none")
    own_type = current.get("rope_type", current.get("type", "default"))
    if own_type not in ("default", None):
        raise ValueError(f"the model config already scales RoPE (rope_type={own_type!r}, factor={current.get('factor')}); "
                         f"{where}.type={rope.type} would replace it: set {where}.type=none to keep the model's own scaling")
    scaled = copy.deepcopy(config)
    params = {**current, "rope_type": rope.type, "factor": float(rope.factor)}
    params.pop("type", None)
    if rope.type == "yarn":
        params["original_max_position_embeddings"] = max_pos
    if new_style:
        scaled.rope_parameters = params
    else:
        scaled.rope_scaling = params
    return scaled
