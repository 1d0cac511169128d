"""A vision-language model's processor (image processor + tokenizer + chat template), loaded
from the model's own directory.

``AutoProcessor`` is tried first. Where it cannot build the processor (transformers' Qwen-VL
processors also build a video processor, which needs torchvision: on a CPU-only torch the PyPI
torchvision is a CUDA build that cannot load), the processor is assembled from the directory's
image processor (the Pillow one), the policy's tokenizer and its chat template, as the family's
processor class without video (`image_only_processor`). Images are what packrl trains on; a
video part in a row is refused by the data path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def image_only_processor(model_type: str, image_processor: Any, tokenizer: Any, chat_template: str | None) -> Any:
    """The processor class of ``model_type`` with an image processor and a tokenizer, no video
    processor: the same prompt ids and pixel values for images.

    Raises:
        ValueError: ``model_type`` is not a family packrl knows the processor of.
    """
    import transformers
    from transformers.processing_utils import ProcessorMixin

    if model_type not in _PROCESSOR_CLASSES:
        raise ValueError(f"no processor known for model_type {model_type!r}; packrl builds those of {sorted(_PROCESSOR_CLASSES)}")
    base = getattr(transformers, _PROCESSOR_CLASSES[model_type])

    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **_: Any) -> None:
            for kind in ("image", "video"):
                token = getattr(tokenizer, f"{kind}_token", None) or f"<|{kind}_pad|>"
                setattr(self, f"{kind}_token", token)
                setattr(self, f"{kind}_token_id", tokenizer.convert_tokens_to_ids(token))
            for kind in ("start", "end"):
                token = getattr(tokenizer, f"vision_{kind}_token", None) or f"<|vision_{kind}|>"
                setattr(self, f"vision_{kind}_token", token)
                setattr(self, f"vision_{kind}_token_id", tokenizer.convert_tokens_to_ids(token))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"{_PROCESSOR_CLASSES[model_type]}ImageOnly"
    return ImageOnlyProcessor(image_processor, tokenizer, chat_template=chat_template)


def load_processor(model_dir: str | Path, model_type: str, tokenizer: Any) -> Any:
    """The processor of the vision-language model in ``model_dir`` (module docstring).

    Args:
        model_type: the model config's ``model_type``.
        tokenizer: the policy's tokenizer (its chat template renders image parts).

    Raises:
        ValueError: the directory has no image processor config (named, with the fix).
    """
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        if hasattr(processor, "image_processor"):
            return processor
    except (ImportError, OSError, ValueError, AttributeError, TypeError):
        pass  # assembled below from the image processor alone
    try:
        image_processor = AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(f"cannot load an image processor from {str(model_dir)!r} ({err}); a vision-language model.path needs "
                         "its preprocessor_config.json or processor_config.json beside config.json") from err
    return image_only_processor(model_type, image_processor, tokenizer, getattr(tokenizer, "chat_template", None))
