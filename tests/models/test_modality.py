"""Multimodal families are found by their config's model_type (`packrl.models.modality.MODALITIES`):
the built-in Qwen-VL families, none for a text model, a refusal for a multimodal checkpoint of an
unregistered family, and a family registered from a plugin file, which loading then accepts."""

from __future__ import annotations

import pytest

from packrl.models.modality import MODALITIES, modality_of
from packrl.models.model_config import check_text_model
from packrl.registry import import_plugins

PLUGIN = '''
from packrl.models.modality import MODALITIES
from packrl.models.vision import QwenVL


class OtherVL(QwenVL):
    """Another image family of the Qwen-VL layout: its own encoder name and processor files."""

    encoder_module = "vision_tower"
    processor_files = ("preprocessor_config.json",)


MODALITIES.register("test_other_vl")(OtherVL())
'''


def _config(model_type: str):
    from transformers import LlavaConfig

    config = LlavaConfig()  # a language model beside a vision encoder
    config.model_type = model_type
    return config


def test_the_built_in_families_and_a_text_model():
    from transformers import LlamaConfig, Qwen2VLConfig, Qwen3VLConfig

    from packrl.models.vision import QWEN_VL

    assert modality_of(Qwen2VLConfig()) is QWEN_VL and modality_of(Qwen3VLConfig()) is QWEN_VL
    assert QWEN_VL.name == "image" and QWEN_VL.load_names == ("vision_patches",)
    assert modality_of(LlamaConfig()) is None
    check_text_model(Qwen2VLConfig(), "qwen")  # registered: accepted
    check_text_model(LlamaConfig(), "llama")


def test_an_unregistered_multimodal_family_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"is a multimodal checkpoint \(LlavaConfig: an encoder beside its language model\); "
                                         r"packrl trains the multimodal families .*qwen2_vl.*model_type 'llama'"):
        check_text_model(_config("test_unregistered_vl"), "some/llava")
    assert modality_of(_config("test_unregistered_vl")) is None


def test_a_family_registered_from_a_plugin_file_is_found_by_its_model_type(tmp_path):
    path = tmp_path / "other_vl.py"
    path.write_text(PLUGIN)
    assert import_plugins([str(path)]) == []
    config = _config("test_other_vl")
    check_text_model(config, "other/vl")  # no longer refused
    family = modality_of(config)
    assert family is MODALITIES["test_other_vl"] and type(family).__name__ == "OtherVL"
    assert (family.name, family.encoder_module, family.processor_files) == ("image", "vision_tower", ("preprocessor_config.json",))
    assert "test_other_vl" in MODALITIES.names()
