"""`packrl verl` on verl 0.9.x scripts.

Every key of verl 0.9.1's config (and the 0.7-0.9.0 keys it dropped) has a rule, verl's own
defaults written out translate, and verl 0.9's settings convert exactly: the geometric rejection
of ``rollout_rs=seq_mean_k1`` (checked against verl's rule, written here from
``rollout_corr_helper.compute_rollout_rejection_mask``), the dual clip, REINFORCE++, the warmup in
training steps. The dry run reads a local model's config for its context; a 7B LoRA command as the
tuning guides write it (no GPU count: verl's 8 per node) passes the dry run.

``verl_config_keys.tsv`` is verl's own ``_generated_ppo_trainer.yaml`` flattened; its header names
the versions and files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from packrl.algos.rollout_correction import apply_rollout_correction
from packrl.cli.main import main
from packrl.compat.verl import translate
from packrl.compat.verl.context import same
from packrl.compat.verl.keys import ANY, DEFAULTS, rule_of
from packrl.compat.verl.overrides import format_value
from packrl.config import ConfigError, load_config
from packrl.types import Response
from tests.cli.test_verl import SMALL
from tests.conftest import SMOLLM_DIR

AR = "actor_rollout_ref"
RC = "algorithm.rollout_correction"
ROWS = 7473
KEYS = [line.rstrip("\n").split("\t") for line in (Path(__file__).parent / "verl_config_keys.tsv").read_text().splitlines()
        if line and not line.startswith("#")]
"""(key, verl version, default as JSON) of every verl config key, verl 0.9.1's first."""

GRPO_09 = [
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "data.train_files=['/data/gsm8k/train.parquet', '/data/math/train.parquet']",
    "data.val_files=['/data/gsm8k/test.parquet', '/data/math/test.parquet']", "data.train_batch_size=1024",
    "data.max_prompt_length=1024", "data.max_response_length=2048", "data.filter_overlong_prompts=True", "data.truncation='error'",
    f"{AR}.model.path=Qwen/Qwen3-8B", f"{AR}.model.use_remove_padding=True", f"{AR}.model.enable_gradient_checkpointing=True",
    f"{AR}.actor.optim.lr=1e-6", f"{AR}.actor.ppo_mini_batch_size=256", f"{AR}.actor.use_dynamic_bsz=True",
    f"{AR}.actor.ppo_max_token_len_per_gpu=24576", f"{AR}.actor.use_kl_loss=True", f"{AR}.actor.kl_loss_coef=0.001",
    f"{AR}.actor.kl_loss_type=low_var_kl", f"{AR}.actor.entropy_coeff=0", f"{AR}.actor.fsdp_config.param_offload=False",
    f"{AR}.actor.fsdp_config.optimizer_offload=False", f"{AR}.rollout.name=vllm", f"{AR}.rollout.tensor_model_parallel_size=2",
    f"{AR}.rollout.gpu_memory_utilization=0.6", f"{AR}.rollout.n=5", f"{AR}.rollout.log_prob_use_dynamic_bsz=True",
    f"{AR}.rollout.log_prob_max_token_len_per_gpu=24576", f"{AR}.ref.log_prob_use_dynamic_bsz=True",
    f"{AR}.ref.log_prob_max_token_len_per_gpu=24576", f"{AR}.ref.fsdp_config.param_offload=True", "trainer.balance_batch=True",
    "trainer.logger=['console','wandb']", "trainer.project_name=verl_grpo_gsm8k_math", "trainer.experiment_name=qwen3_8b_grpo",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
    "trainer.use_v1=True", "trainer.v1.trainer_mode=sync",
]
"""verl 0.9's ``examples/grpo_trainer/run_qwen3_8b_fsdp.sh`` (NVIDIA GPUs, vLLM) as it passes its overrides."""
GEO_RS = [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0", f"{RC}.rollout_rs=seq_mean_k1",
          f"{RC}.rollout_rs_threshold=0.999_1.001", f"{RC}.bypass_mode=False"]
"""verl 0.9's ``RolloutCorrectionConfig.decoupled_geo_rs_token_tis()`` preset as overrides."""
LORA_7B = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation=error", "data.shuffle=False",
    f"{AR}.model.path=Qwen/Qwen2.5-7B-Instruct", f"{AR}.model.lora_rank=16", f"{AR}.model.lora_alpha=32",
    f"{AR}.model.target_modules=all-linear", f"{AR}.model.use_shm=True", f"{AR}.model.enable_gradient_checkpointing=True",
    f"{AR}.model.use_remove_padding=True", f"{AR}.actor.optim.lr=3e-6", f"{AR}.actor.ppo_mini_batch_size=64",
    f"{AR}.actor.ppo_micro_batch_size_per_gpu=16", f"{AR}.actor.use_kl_loss=True", f"{AR}.actor.kl_loss_coef=0.001",
    f"{AR}.actor.kl_loss_type=low_var_kl", f"{AR}.actor.entropy_coeff=0", f"{AR}.actor.fsdp_config.param_offload=False",
    f"{AR}.actor.fsdp_config.optimizer_offload=False", f"{AR}.rollout.name=vllm", f"{AR}.rollout.load_format=safetensors",
    f"{AR}.rollout.layered_summon=True", f"{AR}.rollout.tensor_model_parallel_size=2", f"{AR}.rollout.gpu_memory_utilization=0.6",
    f"{AR}.rollout.n=5", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=16", f"{AR}.ref.log_prob_micro_batch_size_per_gpu=16",
    f"{AR}.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0",
    "trainer.logger=['console','wandb']", "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2.5_7b_grpo_lora",
    "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
]
"""A 7B GRPO LoRA command as tuning guides print it (verl's examples/tuning/lora and the LoRA docs): rank 16,
gradient checkpointing, vLLM, and no trainer.n_gpus_per_node (verl's default 8 applies); data files
are added by the test."""


def overrides(args: list[str], rows: int = ROWS) -> dict[str, str]:
    """``packrl key -> value text`` of the translation of ``args``, after checking it loads."""
    translation = translate(args, num_train_rows=rows)
    load_config(translation.preset, translation.overrides)
    return dict(o.split("=", 1) for o in translation.overrides)


def problems(args: list[str]) -> dict[str, Any]:
    """The problems of translating ``args``, by verl key."""
    with pytest.raises(ConfigError) as err:
        translate(args, num_train_rows=ROWS)
    return {p.key: p for p in err.value.problems}


def test_every_key_of_verls_config_has_a_rule():
    missing = [f"{key} (verl {version})" for key, version, _ in KEYS if rule_of(key) is None]
    assert not missing, missing
    assert sum(version == "0.9.1" for _, version, _ in KEYS) == 830


def test_verls_own_default_of_every_unused_key_is_accepted():
    refused = []
    for key, _, default in KEYS:
        rule, value = rule_of(key), json.loads(default)
        interpolated = isinstance(value, str) and "${" in value
        if rule is not None and not rule.mapped and rule.accept is not ANY and not interpolated:
            if not any(same(value, accepted) for accepted in rule.accept):
                refused.append(f"{key}={value!r}")
    assert not refused, refused


def test_the_defaults_the_translation_reads_are_verl_0_9_1s():
    defaults = {key: json.loads(default) for key, version, default in KEYS if version == "0.9.1"}
    assert {key: (value, defaults.get(key)) for key, value in DEFAULTS.items() if not same(value, defaults.get(key))} == {}


def test_verls_whole_default_config_written_out_translates_and_loads():
    args = [f"{key}={format_value(json.loads(default))}" for key, version, default in KEYS
            if version == "0.9.1" and "${" not in default and default != '"???"']
    out = overrides(args + ["trainer.logger=[console]", f"{AR}.rollout.name=hf"])
    assert len(args) > 700
    assert out["algorithm.adv_estimator"] == "gae" and out["trainer.num_workers"] == "8"
    assert out["algorithm.policy_loss_args.clip_ratio_c"] == "3.0"
    assert out["rollout.return_logprobs"] == "true"  # verl 0.9's calculate_log_probs default


def test_a_verl_0_9_grpo_script_with_geometric_rejection_translates(capsys):
    assert main(["verl", "--dry-run", *GRPO_09, *GEO_RS, *SMALL, "trainer.total_training_steps=3"]) == 0
    out = capsys.readouterr().out
    assert f"{RC}.rollout_rs=geometric  <-  {RC}.rollout_rs=seq_mean_k1  [seq_mean_k1 -> geometric]" in out
    upper, lower = 1 / 0.999, 1 / 1.001
    assert f"{RC}.rollout_rs_threshold={upper!r}  <-  {RC}.rollout_rs_threshold=0.999_1.001" in out
    assert f"{RC}.rollout_rs_threshold_lower={lower!r}" in out and f"{RC}.rollout_is=token" in out
    assert "seq_mean_k1 bounds 1/rho to [0.999, 1.001], so rho <= 1/0.999" in out
    assert "trainer.use_v1=true: packrl has one trainer" in out and "resolved config:" in out


def verl_keeps(log_ratios: list[float], spec: str | float) -> bool:
    """verl 0.9.1's ``rollout_rs=seq_mean_k1`` decision for one response, from
    ``rollout_corr_helper``: thresholds ``lower_upper`` (one number u: ``lower = 1/u``), each
    token's log r = log pi_old - log pi_rollout clamped to +-20, k1 = -log r, and the response is
    kept when log(lower) <= mean(k1) <= log(upper)."""
    text = str(spec)
    lower, upper = (float(t) for t in text.split("_", 1)) if "_" in text else (float(str(1.0 / float(text))), float(text))
    k1 = [-min(20.0, max(-20.0, x)) for x in log_ratios]
    return math.log(lower) <= sum(k1) / len(k1) <= math.log(upper)


def _responses(seed: int, log_lo: float, log_hi: float) -> tuple[list[Response], list[torch.Tensor], list[torch.Tensor]]:
    """Responses of 1-40 tokens whose mean log-ratio spans [2 log_lo, 2 log_hi] (the bounds in
    log space), a third of them at a bound to within the float32 rounding of the old log-probs
    (~1e-7); some carry tool tokens (not the policy's, with large log-ratios both rules ignore)."""
    rng = random.Random(seed)
    responses, olds, masks = [], [], []
    for i in range(600):
        n = rng.randint(1, 40)
        target = rng.choice([log_lo, log_hi]) + rng.choice([-1e-9, 1e-9]) if i % 3 == 0 else rng.uniform(2 * log_lo, 2 * log_hi)
        noise = [rng.gauss(0, 0.05) for _ in range(n)]
        shift = target - sum(noise) / n
        policy = [True] * n if i % 4 else [rng.random() < 0.7 or t == 0 for t in range(n)]
        rollout = torch.tensor([rng.uniform(-6.0, -0.01) for _ in range(n)], dtype=torch.float64)
        ratio = torch.tensor([x + shift if p else rng.uniform(-5.0, 5.0) for x, p in zip(noise, policy)], dtype=torch.float64)
        responses.append(Response(tuple(range(n)), "eos", rollout_logprobs=tuple(rollout.tolist()), response_mask=tuple(policy)))
        olds.append((rollout + ratio).float())
        masks.append(torch.tensor(policy))
    return responses, olds, masks


@pytest.mark.parametrize("spec", ["0.999_1.001", "0.99_1.05", "0.5_2.0", 1.001, 1.2])
def test_the_converted_threshold_rejects_the_same_sequences_as_verls_rule(spec):
    translation = translate([*GRPO_09, *SMALL, *GEO_RS[:2], f"{RC}.rollout_rs=seq_mean_k1",
                             f"{RC}.rollout_rs_threshold={spec}"], num_train_rows=ROWS)
    cfg = load_config(translation.preset, translation.overrides).algorithm.rollout_correction
    text = str(spec)
    lower, upper = (float(t) for t in text.split("_", 1)) if "_" in text else (1 / float(text), float(text))
    # the bounds on verl's statistic mean(-log r) are [log lower, log upper]: mean(log r) in [-log upper, -log lower]
    responses, olds, masks = _responses(7, -math.log(upper), -math.log(lower))
    kept, _, _ = apply_rollout_correction(responses, olds, masks, cfg)
    packrl = [bool(m.any()) for m in kept]
    engine = [torch.tensor(r.rollout_logprobs, dtype=torch.float32) for r in responses]
    verl = [verl_keeps((old.double() - eng.double())[m].tolist(), spec) for old, eng, m in zip(olds, engine, masks)]
    assert packrl == verl
    assert 100 < sum(verl) < len(verl) - 100  # both decisions are common


def test_other_rejection_and_weighting_modes_are_refused():
    base = [*GRPO_09, *SMALL]
    for rs in ("token_k1", "seq_sum_k1", "seq_mean_k3", "seq_mean_k1,seq_max_k2"):
        assert "geometric-mean ratio only" in problems(base + [f"{RC}.rollout_rs={rs}", f"{RC}.rollout_rs_threshold=1.001"])[
            f"{RC}.rollout_rs"].message
    threshold = f"{RC}.rollout_rs_threshold"
    assert "must bracket 1" in problems(base + GEO_RS[2:3] + [f"{threshold}=1.001_1.002"])[threshold].message
    assert "is needed" in problems(base + GEO_RS[2:3])[threshold].message
    icepop = problems(base + [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_5.0"])
    assert "IcePop" in icepop[f"{RC}.rollout_is_threshold"].message
    assert "tokens only" in problems(base + [f"{RC}.rollout_is=sequence"])[f"{RC}.rollout_is"].message
    assert problems(base + [f"{RC}.bypass_mode=True"])[f"{RC}.bypass_mode"].fix == f"set {RC}.bypass_mode=False"
    assert "token-sum" in str(problems(base + [f"{AR}.actor.loss_agg_mode=token-sum"]))


def test_verl_0_7_geometric_spelling_keeps_its_bounds():
    out = overrides([*GRPO_09, *SMALL, f"{RC}.rollout_rs=geometric", f"{RC}.rollout_rs_threshold=1.002",
                     f"{RC}.rollout_rs_threshold_lower=0.997"])
    assert (out[f"{RC}.rollout_rs_threshold"], out[f"{RC}.rollout_rs_threshold_lower"]) == ("1.002", "0.997")


def test_the_dual_clip_is_verls_default_unless_the_script_sets_it():
    translation = translate([*GRPO_09, *SMALL], num_train_rows=ROWS)
    mapping = next(m for m in translation.mappings if m.key == "algorithm.policy_loss_args.clip_ratio_c")
    assert mapping.value == 3.0 and mapping.sources == (f"{AR}.actor.clip_ratio_c=3.0 (verl default)",)
    assert overrides([*GRPO_09, *SMALL, f"{AR}.actor.clip_ratio_c=10"])["algorithm.policy_loss_args.clip_ratio_c"] == "10.0"
    gspo = translate([*GRPO_09, *SMALL, f"{AR}.actor.policy_loss.loss_mode=gspo", f"{AR}.actor.clip_ratio_c=5"], num_train_rows=ROWS)
    assert "algorithm.policy_loss_args.clip_ratio_c" not in {m.key for m in gspo.mappings}
    assert {i.key: i.reason for i in gspo.ignored}[f"{AR}.actor.clip_ratio_c"].startswith("read only by loss_mode=vanilla")
    assert "verl asserts clip_ratio_c > 1" in problems([*GRPO_09, f"{AR}.actor.clip_ratio_c=1.0"])[f"{AR}.actor.clip_ratio_c"].message


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_estimators_pass_through(estimator):
    args = [*GRPO_09, *SMALL, f"algorithm.adv_estimator={estimator}", "algorithm.gamma=0.99"]
    out = overrides(args)
    assert out["algorithm.adv_estimator"] == estimator
    if estimator == "reinforce_plus_plus":  # verl's compute_reinforce_plus_plus_outcome_advantage discounts by gamma
        assert out["algorithm.gamma"] == "0.99"
    else:
        ignored = {i.key: i.reason for i in translate(args, num_train_rows=ROWS).ignored}
        assert "algorithm.gamma" not in out and ignored["algorithm.gamma"].startswith("read only by gae and reinforce_plus_plus")


def test_warmup_in_training_steps_becomes_optimizer_steps():
    args = [*GRPO_09, *SMALL, "data.train_batch_size=8", f"{AR}.actor.ppo_mini_batch_size=2", f"{AR}.actor.ppo_epochs=2",
            "trainer.total_training_steps=100"]
    assert overrides(args + [f"{AR}.actor.optim.lr_warmup_steps=10"])["train.warmup_steps"] == str(10 * 4 * 2)
    # verl 0.9.1's engine reads the ratio whenever lr_warmup_steps <= 0
    ratio = args + [f"{AR}.actor.optim.lr_warmup_steps=0", f"{AR}.actor.optim.lr_warmup_steps_ratio=0.05"]
    assert overrides(ratio)["train.warmup_steps"] == str(5 * 4 * 2)


def test_greedy_validation_names_what_made_it_greedy():
    def val_temperature(do_sample: bool, temperature: float) -> tuple[float, str]:
        args = [*GRPO_09, *SMALL, f"{AR}.rollout.val_kwargs.do_sample={do_sample}", f"{AR}.rollout.val_kwargs.temperature={temperature}"]
        return next((m.value, m.conversion) for m in translate(args, num_train_rows=ROWS).mappings if m.key == "rollout.val_temperature")

    assert val_temperature(False, 0.6) == (0.0, "do_sample=False: greedy (0)")
    assert val_temperature(True, 0) == (0.0, "temperature=0: greedy (0)")  # do_sample=True: the temperature made it greedy
    assert val_temperature(True, 0.6) == (0.6, "")


def test_verl_0_9_reward_spelling_maps_the_dapo_overlong_buffer():
    kwargs = "reward.reward_kwargs"
    out = overrides([*GRPO_09, *SMALL, "reward.reward_manager.name=dapo", f"+{kwargs}.overlong_buffer_cfg.enable=True",
                     f"+{kwargs}.overlong_buffer_cfg.len=512", f"+{kwargs}.overlong_buffer_cfg.penalty_factor=0.5",
                     f"+{kwargs}.max_resp_len=2048"])
    assert (out["reward.shaping.overlong.buffer_tokens"], out["reward.shaping.overlong.penalty_factor"]) == ("512", "0.5")
    assert "reward.shaping.overlong.buffer_tokens" not in overrides([*GRPO_09, *SMALL, "reward.reward_manager.name=naive"])


def test_dynamic_sampling_filters_on_verls_default_metric():
    out = overrides([*GRPO_09, *SMALL, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=4"])
    assert out["algorithm.filters.dynamic_sampling.metric"] == "reward"  # verl 0.9: the reward before KL


def test_asynchronous_verl_trainer_modes_are_refused_with_packrls_mode_named():
    problem = problems([*GRPO_09, "trainer.v1.trainer_mode=separate_async"])["trainer.v1.trainer_mode"]
    assert "trainer.rollout_mode=colocate_async (or separate_async)" in problem.fix


def test_verls_dp_model_engine_passes_the_dry_run_and_the_other_backends_are_refused(capsys):
    """``model_engine`` picks verl 0.9.1's training backend (ppo_trainer.yaml's defaults list:
    ``- model_engine: dp``): dp, verl's FSDP engine, is packrl's; Megatron, TorchTitan and VeOmni are not."""
    assert main(["verl", "--dry-run", "model_engine=dp", "trainer.total_training_steps=3"]) == 0
    assert "model_engine=dp: verl's training backend" in capsys.readouterr().out
    for backend in ("megatron", "torchtitan", "veomni"):
        problem = problems([*GRPO_09, f"model_engine={backend}"])["model_engine"]
        assert problem.value == backend and "packrl has no Megatron, TorchTitan or VeOmni backend" in problem.message
        assert "set model_engine=dp" in problem.fix


def _local_model(tmp_path: Path, text: str | None = None) -> Path:
    source = SMOLLM_DIR / "config.json"
    if not source.is_file():
        pytest.skip(f"needs {source}")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(source.read_text() if text is None else text)
    return folder


def test_the_dry_run_refuses_budgets_beyond_a_local_models_context(tmp_path, capsys):
    model = _local_model(tmp_path)  # SmolLM2-135M: max_position_embeddings 8,192
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 8192
    args = [*GRPO_09, *SMALL, "trainer.total_training_steps=3", f"{AR}.model.path={model}"]
    assert main(["verl", "--dry-run", *args, "data.max_prompt_length=4096", "data.max_response_length=8192"]) == 2
    err = capsys.readouterr().err
    assert "data.max_prompt_tokens + rollout.max_response_tokens = 12,288 > model context 8,192" in err
    assert f"(from verl: data.max_response_length=8192, data.max_prompt_length=4096, {AR}.model.path={model})" in err
    assert main(["verl", "--dry-run", *args]) == 0  # 1,024 + 2,048 fit
    assert "the model context was not checked" not in capsys.readouterr().err


def test_the_dry_run_names_an_unreadable_local_model_config(tmp_path, capsys):
    model = _local_model(tmp_path, text='{"architectures": ["LlamaForCausalLM"], "hidden_size": 5')  # a truncated copy
    assert main(["verl", "--dry-run", *GRPO_09, *SMALL, "trainer.total_training_steps=3", f"{AR}.model.path={model}"]) == 2
    err = capsys.readouterr().err
    assert str(model / "config.json") in err and f"(from verl: {AR}.model.path={model})" in err


def _parquet(path: Path, rows: int) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + {i}?"}],
                                          "reward_model": {"ground_truth": str(2 * i)}} for i in range(rows)]), path)


def test_a_7b_lora_command_from_the_tuning_guides_passes_the_dry_run(tmp_path, capsys):
    _parquet(tmp_path / "train.parquet", 1024)
    files = [f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'train.parquet'}"]
    assert main(["verl", "--dry-run", *LORA_7B, *files]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "trainer.num_workers=8  <-  trainer.nnodes=1, trainer.n_gpus_per_node=8 (verl default)" in out
    command = out.splitlines()[0].split()
    assert {"model.lora.rank=16", "model.lora.alpha=32.0", "model.gradient_checkpointing=true", "rollout.engine=vllm"} <= set(command)
    assert "resolved config:" in out
    assert "the model context was not checked: model.path=Qwen/Qwen2.5-7B-Instruct is not a local path" in err
    if importlib.util.find_spec("wandb") is None:  # a package the training machine needs is a warning in a dry run, as vllm is
        assert "warning: train.loggers=['console', 'wandb']: names wandb but the wandb package is not installed" in err


def test_a_key_given_twice_warns_and_the_last_is_used(caplog):
    with caplog.at_level("WARNING", logger="packrl.compat.verl.translate"):
        out = translate(["actor_rollout_ref.actor.clip_ratio_c=3.0", "actor_rollout_ref.actor.clip_ratio_c=2.5",
                         "trainer.total_training_steps=10"])
    assert ("actor_rollout_ref.actor.clip_ratio_c is given twice or more in the verl command (actor_rollout_ref.actor.clip_ratio_c=3.0, "
            "then actor_rollout_ref.actor.clip_ratio_c=2.5); the last is used") in caplog.text
    assert "algorithm.policy_loss_args.clip_ratio_c=2.5" in out.overrides
