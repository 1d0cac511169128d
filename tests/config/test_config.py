"""The typed config: presets, dotlist overrides, and one error that lists every problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrl.config import ConfigError, RunConfig, config_problems, load_config, preset_names, to_yaml


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_loads_and_validates(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, RunConfig)
    assert config_problems(cfg) == []


def test_defaults_are_valid():
    assert config_problems(RunConfig()) == []


def test_overrides_apply_with_yaml_types():
    cfg = load_config(
        "demo",
        ["data.max_prompt_tokens=1024", "data.overlong_prompt=middle", "rollout.n=4",
         "train.max_tokens_per_microbatch=16384", "train.max_tokens_per_logprob_microbatch=16384",
         "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=512",
         "model.path=/models/x", "train.balance_microbatches=false"],
    )
    assert cfg.data.max_prompt_tokens == 1024 and cfg.data.overlong_prompt == "middle"
    assert cfg.rollout.n == 4 and cfg.algorithm.loss_scale_factor == 512
    assert cfg.model.path == "/models/x" and cfg.train.balance_microbatches is False


def test_the_length_keys_exist_under_their_documented_names():
    cfg = load_config()
    for key in ("data.max_prompt_tokens", "data.overlong_prompt", "rollout.max_response_tokens", "rollout.n",
                "train.max_tokens_per_microbatch", "train.max_tokens_per_logprob_microbatch",
                "algorithm.loss_agg_mode", "model.path"):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


def test_every_problem_is_reported_at_once_with_key_value_and_fix():
    with pytest.raises(ConfigError) as err:
        load_config("demo", [
            "data.max_prompt_token=5",            # unknown key (typo)
            "rollout.n=abc",                      # wrong type
            "algorithm.loss_agg_mode=token_mean", # bad choice
            "data.overlong_prompt=truncate",      # bad choice
            "train.logits_chunk_tokens=0",        # out of range
            "train.max_tokens_per_microbatch=100",  # relation: < prompt + response (128 + 64)
        ])
    problems = {p.key: p for p in err.value.problems}
    assert set(problems) == {
        "data.max_prompt_token", "rollout.n", "algorithm.loss_agg_mode", "data.overlong_prompt",
        "train.logits_chunk_tokens", "train.max_tokens_per_microbatch",
    }
    assert "data.max_prompt_tokens" in problems["data.max_prompt_token"].fix
    assert "token-mean" in problems["algorithm.loss_agg_mode"].fix
    assert problems["train.max_tokens_per_microbatch"].value == 100
    assert "192" in problems["train.max_tokens_per_microbatch"].message
    text = str(err.value)
    assert text.startswith("6 config problem(s)") and all(k in text for k in problems)


def test_misplaced_key_suggests_the_right_section():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["train.max_prompt_tokens=64"])
    assert "data.max_prompt_tokens" in str(err.value)


@pytest.mark.parametrize(("typed", "meant"), [
    ("rollout.max_turns", "rollout.multi_turn.max_turns"),      # the right name one section down
    ("train.max_prompt_tokens", "data.max_prompt_tokens"),      # the right name in another section
    ("rollout.max_respons_tokens", "rollout.max_response_tokens"),  # a misspelling
])
def test_an_unknown_key_names_the_key_it_most_likely_meant(typed, meant):
    with pytest.raises(ConfigError) as err:
        load_config("demo", [f"{typed}=3"])
    assert err.value.problems[0].fix == f"did you mean {meant}?"


def test_model_dtype_defaults_to_auto_and_no_preset_pins_bf16():
    from packrl.config.load import preset_names

    assert load_config(None, []).model.dtype == "auto"
    for preset in preset_names():
        assert load_config(preset, []).model.dtype == "auto", preset


def test_relation_problems_are_not_reported_for_keys_that_did_not_parse():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["data.max_prompt_tokens=lots"])
    assert [p.key for p in err.value.problems] == ["data.max_prompt_tokens"]


@pytest.mark.parametrize("item", ["--data.max_prompt_tokens=3", "data.max_prompt_tokens", "=3"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError, match="key=value"):
        load_config("demo", [item])


def test_unknown_preset_and_yaml_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    path = tmp_path / "mine.yaml"
    path.write_text("data:\n  max_prompt_tokens: 128\nrollout:\n  max_response_tokens: 128\n")
    assert load_config(str(path)).data.max_prompt_tokens == 128
    path.write_text("data: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(str(path))
    path.write_text("data: 3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(path))


def test_config_is_frozen_and_round_trips_through_yaml(tmp_path: Path):
    cfg = load_config("gsm8k", ["rollout.n=2"])
    with pytest.raises(AttributeError):
        cfg.rollout.n = 3  # type: ignore[misc]
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("text", ["42\n", "true\n", "hello\n", "- a\n"])
def test_yaml_that_is_not_a_mapping(tmp_path: Path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(path))


def test_yaml_that_is_not_utf8(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\xff\xfe\x00d")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(str(path))


def test_interpolations_stay_literal_text():
    assert load_config("demo", ["model.path=${oc.env:HOME}"]).model.path == "${oc.env:HOME}"


def test_duplicate_problems_are_reported_once():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["train.max_tokens_per_microbatch=-1"])
    assert len(err.value.problems) == 1


def test_huge_floats_for_integers_are_rejected():
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config("demo", ["rollout.n=1e30"])


def test_override_values_yaml_cannot_read_are_plain_text():
    cfg = load_config("demo", ["data.instruction=Give the answer after ####.", "rollout.stop=[####]", "data.system_prompt=*ref"])
    assert cfg.data.instruction == "Give the answer after ####."
    assert cfg.rollout.stop == ["####"]
    assert cfg.data.system_prompt == "*ref"


def test_settings_that_silently_do_nothing_are_problems():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["rollout.n=1", "algorithm.kl_in_reward=true", "rollout.stop=['']", "train.lr=.inf",
                             "reward.shaping.overlong.buffer_tokens=8", "reward.shaping.overlong.penalty_factor=-5"])
    keys = {p.key for p in err.value.problems}
    assert keys == {"rollout.n", "algorithm.kl_in_reward", "rollout.stop", "train.lr", "reward.shaping.overlong.penalty_factor"}


def test_loss_scale_factor_is_refused_where_the_loss_mode_does_not_use_it():
    with pytest.raises(ConfigError, match="algorithm.loss_scale_factor=100: has no effect with algorithm.loss_agg_mode=token-mean"):
        load_config("demo", ["algorithm.loss_scale_factor=100"])
    assert load_config("demo", ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_scale_factor=100"])


def test_common_slips_get_the_fix_they_need():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["model.dtype=fp16"])
    assert "fp16 is not offered" in str(err.value) and "model.dtype=auto" in str(err.value) and "fp64?" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["rollot.max_response_tokens=64", "rollot.n=3"])
    text = str(err.value)
    assert "rollot.max_response_tokens=64: unknown key; fix: did you mean rollout.max_response_tokens?" in text
    assert "rollot.n=3: unknown key; fix: did you mean rollout.n?" in text
    with pytest.raises(ConfigError, match=r"train.total_steps'?: is a config key without a value.*write train.total_steps=<value>"):
        load_config("train.total_steps")


def test_a_yaml_key_written_twice_is_refused_with_both_values_and_lines(tmp_path: Path):
    """PyYAML keeps the last of two equal keys silently; OmegaConf and YAML 1.2 refuse them, and so does packrl."""
    path = tmp_path / "mine.yaml"
    path.write_text("data:\n  max_prompt_tokens: 256\n  batch_size: 4\n  max_prompt_tokens: 512\nrollout:\n  n: 2\n"
                    "rollout:\n  n: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert [str(p) for p in err.value.problems] == [
        f"data.max_prompt_tokens='512': is written twice in the same mapping of preset {path}: 256 (line 2) and 512 "
        "(line 4); YAML keys must be unique, and which value is meant is unknown; fix: delete one of the two lines of "
        "data.max_prompt_tokens",
        f"rollout='n: 4': is written twice in the same mapping of preset {path}: n: 2 (line 6) and n: 4 (line 8); YAML "
        "keys must be unique, and which value is meant is unknown; fix: delete one of the two lines of rollout",
    ]


def test_an_override_given_twice_takes_the_last_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="packrl.config"):
        cfg = load_config("demo", ["data.batch_size=4", "rollout.n=2", "data.batch_size=8"])
    assert cfg.data.batch_size == 8
    assert caplog.messages == ["data.batch_size is overridden 2 times on the command line (data.batch_size=4, then "
                               "data.batch_size=8); the last, data.batch_size=8, is used"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="packrl.config"):
        load_config("demo", ["data.batch_size=4", "rollout.n=2"])
    assert caplog.messages == []
