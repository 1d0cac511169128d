"""Read a model's config (never its weights when avoidable) from any form of ``model.path``, and
apply ``model.rope_scaling`` to it (`apply_rope_scaling`), so the context a run will have is known
before any weight is loaded."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrl.errors import KeyedValueError
from packrl.models.modality import MODALITIES, is_multimodal, modality_of

if TYPE_CHECKING:
    from packrl.config.schema import LoraConfig, ModelConfig, RopeScalingConfig
    from packrl.models.resolve import ResolvedModel


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
    from packrl.models.resolve import resolve_model

    return read_model_config(resolve_model(path, weights=False), path)


def read_model_config(resolved: ResolvedModel, path: str) -> Any:
    """The `transformers.PretrainedConfig` of a resolved model, its ``config.json`` checked first
    (`check_config_file`) so a broken file is reported as such, not as a library traceback.

    Args:
        resolved: from `packrl.models.resolve.resolve_model`.
        path: the ``model.path`` value, for messages.

    Raises:
        ModelConfigFileError: ``config.json`` is not valid JSON, a field packrl reads has the wrong
            type, or transformers' config class refuses a field (its strict validation).
        ValueError: the config cannot be read otherwise (e.g. a GGUF header without ``gguf``).
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    check_config_file(resolved, path)
    try:
        return AutoConfig.from_pretrained(resolved.model_dir, **resolved.load_kwargs())
    except StrictDataclassError as err:
        file = resolved.model_dir / "config.json"
        said = " ".join(str(err).split())
        named = re.search(r"field '([^']+)'", said)
        field = named.group(1) if named else None
        where = f"the field {field}" if field else "the field the message names"
        raise ModelConfigFileError(
            path, file, field, f"transformers refuses its config file {file}: {said}",
            f"correct {where} in {file} (the type or value the message asks for), or copy that config.json again "
            "from the model's source",
        ) from err
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"cannot read the model config of model.path={path!r} from {resolved.source}: {err}. "
            "Set model.path to a local model directory, a .gguf file or a reachable hub id"
        ) from err


class ModelConfigFileError(ValueError):
    """A model's ``config.json`` that is not the config it should be: not valid JSON (often a
    truncated copy or download), or a field with the wrong type.

    Attributes:
        path: the ``model.path`` value.
        file: the ``config.json``.
        field: the dotted field at fault (``text_config.hidden_size``); None when the file does
            not parse.
        problem: what is wrong, naming the file, the field and the value seen.
        fix: what to change in the file.
    """

    def __init__(self, path: str, file: Path, field: str | None, problem: str, fix: str):
        self.path, self.file, self.field, self.problem, self.fix = path, file, field, problem, fix
        super().__init__(f"model.path={path!r}: {problem}; fix: {fix}")


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
"""The sizes packrl reads from a model config (the memory estimate, the model context)."""
_NULLABLE = ("intermediate_size", "num_key_value_heads", "head_dim")
"""Sizes a config may leave null: packrl and transformers then derive them from the others."""
_ROPE_SECTIONS = ("rope_scaling", "rope_parameters")


def check_config_file(resolved: ResolvedModel, path: str) -> None:
    """Check the ``config.json`` of a resolved model directory before transformers reads it.

    The file must be a JSON object, and the fields packrl reads must have their types:
    `_POSITIVE_INTS` positive integers (``num_key_value_heads``, ``head_dim`` and
    ``intermediate_size`` may be null), ``rope_theta`` a number, ``model_type`` a string, the
    RoPE sections (``rope_scaling``, ``rope_parameters``, also per layer type) objects or null with
    a numeric ``factor``, a positive integer ``original_max_position_embeddings`` and a string
    ``rope_type``/``type``; the same inside ``text_config``. transformers >= 5 validates its own
    fields too (`read_model_config` reports that); earlier versions keep ``"hidden_size": "576"``
    as a string, which would break far from the file. A ``.gguf`` (no ``config.json``) is not
    checked.

    Raises:
        ModelConfigFileError: the file is not valid UTF-8 JSON, not an object, or a field above
            has the wrong type; the message names the file, the field, the value and the fix.
    """
    file = resolved.model_dir / "config.json"
    if resolved.gguf_file is not None or not file.is_file():
        return
    text = file.read_bytes().decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        cut = "; it ends before its closing brace, as a truncated copy does" if not text.rstrip().endswith("}") else ""
        raise ModelConfigFileError(
            path, file, None, f"its config file {file} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}"
            f"{cut})",
            "copy or download that config.json again from the model's source (it must parse as one JSON object)",
        ) from err
    if not isinstance(data, dict):
        raise ModelConfigFileError(path, file, None, f"its config file {file} holds a JSON "
                                   f"{type(data).__name__}, not an object of fields",
                                   "copy or download that config.json again from the model's source")
    wrong = _wrong_fields(data, "")
    if wrong:
        field, value, expected = wrong[0]
        more = f" (also wrong: {', '.join(w[0] for w in wrong[1:])})" if len(wrong) > 1 else ""
        raise ModelConfigFileError(path, file, field, f"its config file {file} has {field}={value!r} "
                                   f"({_json_type(value)}), where {expected} is expected{more}",
                                   _type_fix(file, field, value, expected))


def _wrong_fields(data: dict[str, Any], prefix: str) -> list[tuple[str, Any, str]]:
    """``(dotted field, value, what was expected)`` for each field of `check_config_file` with the wrong type."""
    wrong = []
    for key in _POSITIVE_INTS:
        value = data.get(key)
        if key in data and not (_is_positive_int(value) or value is None and key in _NULLABLE):
            wrong.append((prefix + key, value, "a positive integer" + (" or null" if key in _NULLABLE else "")))
    if "rope_theta" in data and not _is_number(data["rope_theta"]):
        wrong.append((prefix + "rope_theta", data["rope_theta"], "a number"))
    if "model_type" in data and not isinstance(data["model_type"], str):
        wrong.append((prefix + "model_type", data["model_type"], "a string"))
    for key in _ROPE_SECTIONS:
        wrong += _wrong_rope(data.get(key), prefix + key)
    text = data.get("text_config")
    if isinstance(text, dict):
        wrong += _wrong_fields(text, prefix + "text_config.")
    elif "text_config" in data and text is not None:
        wrong.append((prefix + "text_config", text, "an object or null"))
    return wrong


def _wrong_rope(section: Any, field: str) -> list[tuple[str, Any, str]]:
    if section is None:
        return []
    if not isinstance(section, dict):
        return [(field, section, "an object or null")]
    if section and all(isinstance(v, dict) for v in section.values()):  # per layer type
        return [w for name, sub in section.items() for w in _wrong_rope(sub, f"{field}.{name}")]
    wrong = []
    if section.get("factor") is not None and not _is_number(section["factor"]):
        wrong.append((f"{field}.factor", section["factor"], "a number"))
    original = section.get("original_max_position_embeddings")
    if original is not None and not _is_positive_int(original):
        wrong.append((f"{field}.original_max_position_embeddings", original, "a positive integer"))
    for key in ("rope_type", "type"):
        if section.get(key) is not None and not isinstance(section[key], str):
            wrong.append((f"{field}.{key}", section[key], "a string"))
    return wrong


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", float: "a number", int: "an integer", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _type_fix(file: Path, field: str, value: Any, expected: str) -> str:
    """Write the number a quoted number meant; otherwise set the field to what is expected."""
    key = field.rsplit(".", 1)[-1]
    if isinstance(value, str) and "a string" not in expected:
        try:
            number = json.loads(value.strip())
        except json.JSONDecodeError:
            number = None
        if _is_number(number) and (_is_int(number) or "a number" in expected):
            return f"write it as a JSON number without quotes in {file}: \"{key}\": {json.dumps(number)}"
    if isinstance(value, float) and value.is_integer() and "integer" in expected:
        return f"write it as an integer in {file}: \"{key}\": {int(value)}"
    return f"set {field} in {file} to {expected} (the value the model's source publishes)"


def load_model_context(model: ModelConfig) -> int:
    """The context in tokens a run of the ``model`` section gets, from the config alone: as
    `packrl.models.loading.load_policy` builds it (``model.rope_scaling`` applied to a text
    model; a multimodal model's language model as its config states it), measured by
    `packrl.seqlen.budgets.model_context_tokens`.

    Raises:
        ValueError: as `load_model_config`, `apply_rope_scaling` and `model_context_tokens`.
    """
    config = load_model_config(model.path)
    check_text_model(config, model.path)  # then a multimodal config is a registered family's
    return context_of(config, model)


def context_of(config: Any, model: ModelConfig) -> int:
    """The context in tokens a run of the ``model`` section gets from the model config ``config``
    (a text model or a registered multimodal family, `check_text_model`): ``model.rope_scaling``
    applied to a text model, a multimodal model's language model as its config states it,
    measured by `packrl.seqlen.budgets.model_context_tokens`.

    Raises:
        ValueError: as `apply_rope_scaling` and `model_context_tokens`.
    """
    from packrl.seqlen.budgets import model_context_tokens

    scaled = config if is_multimodal(config) else apply_rope_scaling(config, model.rope_scaling)
    return model_context_tokens(scaled)[0]


def check_text_model(config: Any, path: str) -> None:
    """Refuse a multimodal checkpoint of a family packrl does not train (an encoder beside the
    language model, its ``model_type`` not in `packrl.models.modality.MODALITIES`): transformers
    would build only the text model from such a config, leaving the checkpoint's
    ``model.language_model.*`` weights unused.

    Raises:
        KeyedValueError: (a ValueError, key ``model.path``) such a config; the message names the
            families that train and the text model type of the checkpoint's family.
    """
    if not is_multimodal(config) or config.model_type in MODALITIES:
        return
    text_type = getattr(config.get_text_config(), "model_type", None)
    instead = (f"a text-only checkpoint of the family (config.json with model_type {text_type!r}, e.g. the language model "
               "saved alone as its *ForCausalLM class)") if text_type else "a text-only checkpoint of the family"
    raise KeyedValueError("model.path", f"model.path={path!r} is a multimodal checkpoint ({type(config).__name__}: an encoder "
                          f"beside its language model); packrl trains the multimodal families {', '.join(MODALITIES.names())} "
                          "only (registered in packrl.models.modality.MODALITIES: their packing and their processors' token "
                          "counts)", f"set model.path to one of those, or to {instead}")


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
        raise KeyedValueError(f"{where}.type", f"{where}.type={rope.type} needs the model config's max_position_embeddings, "
                              f"which is {max_pos!r}", f"set {where}.type=none or use a model whose config.json states it")
    if rope.type not in _STRETCHING or not rope.factor > 1.0:
        raise KeyedValueError(f"{where}.type", f"{where}.type={rope.type!r} factor={rope.factor} cannot stretch the context: "
                              f"the type must be one of {', '.join(_STRETCHING)} and the factor > 1",
                              f"set {where}.factor=2.0 or {where}.type=none")
    new_style = getattr(config, "rope_parameters", None) is not None
    current = dict((config.rope_parameters if new_style else getattr(config, "rope_scaling", None)) or {})
    if current and all(isinstance(v, dict) for v in current.values()):
        raise KeyedValueError(f"{where}.type", f"the model config has RoPE settings per layer type ({', '.join(current)}), "
                              f"which {where} does not scale", f"set {where}.type=none")
    own_type = current.get("rope_type", current.get("type", "default"))
    if own_type not in ("default", None):
        raise KeyedValueError(f"{where}.type", f"the model config already scales RoPE (rope_type={own_type!r}, factor="
                              f"{current.get('factor')}); {where}.type={rope.type} would replace it",
                              f"set {where}.type=none to keep the model's own scaling")
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


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's sizes, counted from its config alone (no weights): what the memory estimate
    (`packrl.inspect.memory`) and the checkpoint size (`packrl.worker.checkpoint.checkpoint_bytes`)
    need.

    Attributes:
        num_params: unique parameters (tied embeddings counted once).
        num_matmul_params: parameters of the decoder layers' Linear modules (the weights cast
            per matmul under autocast).
        num_lora_params: adapter parameters for the configured LoRA (0 when off).
        num_lora_modules: Linear modules that get an adapter (0 when LoRA is off).
        largest_param: elements of the largest single parameter.
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
        vocab_size: the architecture (``H, I, L, h, g, d, V``).
    """

    num_params: int
    num_matmul_params: int
    num_lora_params: int
    num_lora_modules: int
    largest_param: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, model_config: Any, lora: LoraConfig | None = None, path: str = "") -> ModelShape:
        """Instantiate the architecture on torch's ``meta`` device (no memory, no weights) and
        count its parameters and LoRA targets. An attention-free model (Mamba) has
        ``num_heads = num_kv_heads = head_dim = 0``: no KV cache, and its layers' activations are
        counted by the MLP term over its ``intermediate_size`` (an approximation).

        Raises:
            ValueError: a multimodal checkpoint (`packrl.models.model_config.check_text_model`),
                the architecture cannot be built from the config, or ``model.lora.target_modules``
                matches no Linear module (the message lists them).
        """
        import torch
        from transformers import AutoModelForCausalLM

        check_text_model(model_config, path)
        modality = modality_of(model_config)
        try:
            with torch.device("meta"):
                model = (AutoModelForCausalLM if modality is None else modality.auto_class()).from_config(model_config)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"cannot build the model architecture from its config ({type(model_config).__name__}): {err}") from err
        params = {id(p): p for p in model.parameters()}
        head = model.get_output_embeddings()
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
        lora_params, lora_modules = 0, 0
        if lora is not None and lora.rank > 0:
            encoder = "" if modality is None else f".{modality.encoder_module}."
            targets = [(n, m) for n, m in linears if _lora_targets(n, lora.target_modules) and not (encoder and encoder in f".{n}.")]
            if not targets:
                names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
                raise KeyedValueError("model.lora.target_modules", f"model.lora.target_modules={lora.target_modules} matches "
                                      f"no Linear module of the model; its Linear modules are named {', '.join(names)}",
                                      "set model.lora.target_modules to names the model has (or [all-linear])")
            lora_params = sum(lora.rank * (m.in_features + m.out_features) for _, m in targets)
            lora_modules = len(targets)
        model_config = model_config.get_text_config()  # the shape of the language model (the config itself for a text one)
        hidden = _attr(model_config, "hidden_size")
        heads = _attr(model_config, "num_attention_heads") if getattr(model_config, "num_attention_heads", None) is not None else 0
        return cls(
            num_params=sum(p.numel() for p in params.values()),
            num_matmul_params=sum(m.weight.numel() for _, m in linears),
            num_lora_params=lora_params,
            num_lora_modules=lora_modules,
            largest_param=max(p.numel() for p in params.values()),
            hidden_size=hidden,
            intermediate_size=getattr(model_config, "intermediate_size", None) or 4 * hidden,
            num_layers=_attr(model_config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=(getattr(model_config, "head_dim", None) or hidden // heads) if heads else 0,
            vocab_size=_attr(model_config, "vocab_size"),
        )

    def kv_bytes_per_token(self, compute_bytes: int) -> int:
        """Bytes one token's keys and values take over all layers: ``2 L g d c``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * compute_bytes


def _attr(config: Any, key: str) -> int:
    value = getattr(config, key, None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"the model config has {key}={value!r}, not a positive integer; the memory estimate needs it")
    return value


def _lora_targets(name: str, targets: list[str]) -> bool:
    """peft's matching of a module name against ``target_modules`` (exact or dotted suffix)."""
    if targets == ["all-linear"]:
        return True
    return any(name == t or name.endswith("." + t) for t in targets)
