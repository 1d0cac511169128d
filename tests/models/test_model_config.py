"""Reading a model's config without its weights."""

from __future__ import annotations

import pytest

from packrl.models.model_config import load_model_config
from packrl.seqlen.budgets import model_context_tokens
from tests.conftest import SMOLLM_DIR


@pytest.fixture
def smollm_dir():
    if not (SMOLLM_DIR / "config.json").is_file():
        pytest.skip(f"no SmolLM2 files under {SMOLLM_DIR}")
    return SMOLLM_DIR


def test_model_dir(smollm_dir):
    cfg = load_model_config(str(smollm_dir))
    assert cfg.hidden_size == 576 and model_context_tokens(cfg) == (8192, 1.0)


def test_gguf_header_only(smollm_dir):
    cfg = load_model_config(str(smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert cfg.num_hidden_layers == 30 and model_context_tokens(cfg)[0] == 8192


@pytest.mark.parametrize("name", ["missing.gguf", "no_such_dir/"])
def test_missing_paths_name_the_key(tmp_path, name):
    with pytest.raises(ValueError, match="model.path="):
        load_model_config(str(tmp_path / name))


def test_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_model_config(str(tmp_path))
