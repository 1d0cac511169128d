"""Policies that take more than text: a model family's modality, found from its config's ``model_type``.

A multimodal family registers one `Modality` under each of its model types in `MODALITIES`
(``MODALITIES.register("qwen2_vl")(QWEN_VL)``); the built-in ones are listed here with the
module that registers them (`packrl.models.vision`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL), imported on
first lookup. Loading, worker set-up, preflight, the rollout engine and the packed forward ask
`modality_of(config)` and call what it declares; none of them names a modality. What a family
adds besides lives in its own modules: the prompt's extra inputs (a `packrl.types.ExtraInputs`),
the rows that carry them (`packrl.data`), and, where its encoder's load needs a budget of its
own, a grouped cap (`packrl.config.grouped_caps.grouped_cap_limits`).

So a second image family is one module (its `Modality`, or the built-in one's with its own
processor class) and its registration; another modality (audio) is that plus its inputs, its
rows and its cap. A user's family registers from a file named in ``trainer.plugins``.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packrl.capabilities import NoInfo
from packrl.registry import Registry

if TYPE_CHECKING:
    import torch

    from packrl.config.schema import ModelConfig, RunConfig
    from packrl.errors import ConfigProblem
    from packrl.seqlen.packing import Pack
    from packrl.types import ExtraInputs

_QWEN_VL = "packrl.models.vision"

MODALITIES = Registry("MODALITIES", "model.path", "multimodal model family",
                      {"qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "qwen3_vl": _QWEN_VL}, info=NoInfo)
"""HF ``model_type`` -> the `Modality` of that family."""


class Modality(Protocol):
    """What a multimodal family adds to a text policy, declared once for every part that asks.

    Attributes:
        name: the inputs it adds (``image``), as an engine declares taking them
            (`packrl.capabilities.EngineCapabilities.modalities`).
        encoder_module: the module name of its encoder inside the model (``visual``): LoRA's
            adapters leave it alone (`packrl.models.lora.apply_lora`).
        processor_files: its processor's config files, copied into every checkpoint.
        load_names: the grouped-cap loads its prompts' extra inputs report
            (`packrl.types.ExtraInputs.grouped_loads`; ``vision_patches``).
        shared_prompts_blocker: why its packs cannot share prompts (`packrl.worker.parts.shares_prompts`);
            "" where they can.
        preflight: ``"module:function"`` of its own pre-run notes and budget checks, imported only
            when preflight runs (`packrl.inspect.preflight`): ``function(model, data, train, room)
            -> (notes, problems)`` with the ``model``, ``data`` and ``train`` sections and the
            `packrl.config.budgets.PromptRoom` the model context leaves (None when unknown);
            "" for none.
    """

    name: str
    encoder_module: str
    processor_files: tuple[str, ...]
    load_names: tuple[str, ...]
    shared_prompts_blocker: str
    preflight: str

    def auto_class(self) -> Any:
        """The transformers auto class its checkpoints load with (``AutoModelForImageTextToText``)."""
        ...

    def prepare(self, model: torch.nn.Module, cfg: ModelConfig) -> None:
        """What loading does after the weights load, as the ``model`` section asks (freezing the encoder)."""
        ...

    def load_processor(self, model_dir: Path, model_type: str, tokenizer: Any) -> Any:
        """What renders its prompts and encodes their extra inputs, from the model's directory.

        Raises:
            ValueError: the directory lacks the processor's files (named, with the fix).
        """
        ...

    def run_problems(self, cfg: RunConfig, *, engine_modalities: Sequence[str], has_critic: bool) -> list[ConfigProblem]:
        """What its policy cannot run with yet, each naming its keys and its fix: the one list
        worker set-up and preflight read (``engine_modalities``: what the run's rollouts take,
        `packrl.rollout.engine.engine_capabilities`)."""
        ...

    def packed_forward(self, model: torch.nn.Module, pack: Pack, kwargs: dict[str, Any]) -> torch.Tensor:
        """Final hidden states of a pack with extra inputs, Shape [K, H] (`packrl.models.attention.packed_forward`)."""
        ...

    def check_prompts(self, model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                      extra_inputs: Sequence[ExtraInputs | None] | None) -> None:
        """Raise ValueError where a prompt's placeholders are not its extra inputs' tokens (the engine's check)."""
        ...

    def generate_inputs(self, model: torch.nn.Module, extra_inputs: Sequence[ExtraInputs], ids: torch.Tensor) -> dict[str, Any]:
        """The extra arguments of the model's ``generate`` for a batch whose rows ``ids``
        (Shape [b, P], int64) hold ``extra_inputs`` in row order (rows without any add none); empty
        when none holds any."""
        ...


def modality_of(config: Any) -> Modality | None:
    """The registered modality of a model config (by its ``model_type``); None for a text model.
    A multimodal config of a family not registered is refused where the model loads
    (`packrl.models.model_config.check_text_model`)."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or model_type not in MODALITIES or not is_multimodal(config):
        return None
    return MODALITIES[model_type]


def is_multimodal(config: Any) -> bool:
    """True for a config that holds its language model's config beside others (an encoder's):
    transformers' ``get_text_config()`` is then a part of it, not the config itself."""
    return config.get_text_config() is not config
