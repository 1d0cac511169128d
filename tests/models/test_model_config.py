"""Reading a model's config without its weights."""

from __future__ import annotations

import pytest

from packrl.models.model_config import load_model_config
from packrl.seqlen.budgets import model_context_tokens
from tests.conftest import SMOLLM_DIR, skip_without_shared


@pytest.fixture
def smollm_dir():
    skip_without_shared(SMOLLM_DIR / "config.json")
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


def _copy_config_only(src, dst, **edits):
    """A model dir with SmolLM2's tokenizer and config.json (no weights); ``edits`` replace fields."""
    import json
    import shutil

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | edits, indent=2))
    return dst


def _reads(path):
    """What `load_model_config` (preflight, checkpoints), the tokenizer load (the first read of
    ``packrl train``) and preflight say about ``model.path=path``: ``(error, error, problem)``."""
    from packrl.config.schema import ModelConfig
    from packrl.inspect.preflight import preflight
    from packrl.models.loading import load_policy_tokenizer
    from packrl.models.model_config import ModelConfigFileError

    with pytest.raises(ModelConfigFileError) as config_err:
        load_model_config(str(path))
    with pytest.raises(ModelConfigFileError) as tokenizer_err:
        load_policy_tokenizer(ModelConfig(path=str(path)))
    problems = [p for p in preflight("demo", [f"model.path={path}"]).problems if p.key == "model.path"]
    assert len(problems) == 1
    return config_err.value, tokenizer_err.value, problems[0]


def test_a_quoted_size_names_the_file_the_field_and_the_fix(smollm_dir, tmp_path):
    model = _copy_config_only(smollm_dir, tmp_path / "m", hidden_size="576")
    file = model / "config.json"
    config_err, tokenizer_err, problem = _reads(model)
    expected = (f"model.path={str(model)!r}: its config file {file} has hidden_size='576' (a string), where a positive "
                f'integer is expected; fix: write it as a JSON number without quotes in {file}: "hidden_size": 576')
    assert str(config_err) == expected and str(tokenizer_err) == expected
    assert config_err.field == "hidden_size" and config_err.file == file
    assert str(problem) == expected  # preflight: key model.path, the same problem and fix


@pytest.mark.parametrize(("edits", "field", "fix"), [
    ({"num_hidden_layers": 30.0}, "num_hidden_layers", '"num_hidden_layers": 30'),
    ({"max_position_embeddings": None}, "max_position_embeddings", "to a positive integer"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "rope_parameters.factor", '"factor": 4'),
    ({"text_config": {"vocab_size": "big"}}, "text_config.vocab_size", "text_config.vocab_size in"),
])
def test_each_field_packrl_reads_is_type_checked(smollm_dir, tmp_path, edits, field, fix):
    from packrl.models.model_config import ModelConfigFileError

    model = _copy_config_only(smollm_dir, tmp_path / "m", **edits)
    with pytest.raises(ModelConfigFileError, match=f"config.json has {field}=") as err:
        load_model_config(str(model))
    assert err.value.field == field and fix in err.value.fix


def test_a_field_transformers_validates_is_named_with_its_file(smollm_dir, tmp_path):
    """A field packrl does not read: transformers' strict config classes (>= 5) refuse it; the
    message still names the file and the field (an older transformers keeps the string)."""
    import transformers

    from packrl.models.model_config import ModelConfigFileError

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers < 5 does not validate config field types")
    model = _copy_config_only(smollm_dir, tmp_path / "m", rms_norm_eps="tiny")
    with pytest.raises(ModelConfigFileError) as err:
        load_model_config(str(model))
    assert f"refuses its config file {model / 'config.json'}" in str(err.value)
    assert "Field 'rms_norm_eps' expected float, got str (value: 'tiny')" in str(err.value)
    assert err.value.fix.startswith("correct the field rms_norm_eps in ")


def test_a_truncated_config_is_not_reported_as_a_tokenizer_problem(smollm_dir, tmp_path):
    model = _copy_config_only(smollm_dir, tmp_path / "m")
    file = model / "config.json"
    file.write_text(file.read_text()[:300])
    config_err, tokenizer_err, problem = _reads(model)
    expected = (f"model.path={str(model)!r}: its config file {file} is not valid JSON (Unterminated string starting at: "
                "line 14 column 3; it ends before its closing brace, as a truncated copy does); fix: copy or download "
                "that config.json again from the model's source (it must parse as one JSON object)")
    assert str(config_err) == expected and str(tokenizer_err) == expected and str(problem) == expected
    assert "tokenizer" not in expected


def test_the_model_context_of_a_run_includes_its_rope_scaling(smollm_dir):
    from packrl.config.schema import ModelConfig, RopeScalingConfig
    from packrl.models.model_config import load_model_context

    assert load_model_context(ModelConfig(path=str(smollm_dir))) == 8192
    assert load_model_context(ModelConfig(path=str(smollm_dir), rope_scaling=RopeScalingConfig(type="yarn", factor=2.0))) == 16384
