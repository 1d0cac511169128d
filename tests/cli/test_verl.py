"""`packrl verl`: verl launch-script overrides -> the packrl config they describe.

The override lists are verl's own GSM8K examples (examples/ppo_trainer, examples/grpo_trainer,
the sequence-balance and LoRA scripts), written as the scripts pass them to
``python3 -m verl.trainer.main_ppo``; `SMALL` reduces their sizes as a verl user would.
"""

from __future__ import annotations

import json
import shutil

import pytest

from packrl.cli.main import main
from packrl.cli.verl import count_rows
from packrl.compat.verl import parse_override, translate
from packrl.compat.verl.keys import FAMILIES, VERL_KEYS
from packrl.config import ConfigError, load_config
from tests.conftest import GGUF, GSM8K_DIR, SHARED, needs_shared, skip_without_shared

AR = "actor_rollout_ref"
COMMON = [
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=1024", "data.max_prompt_length=512", "data.filter_overlong_prompts=True", "data.truncation='error'",
    f"{AR}.actor.optim.lr=1e-6", f"{AR}.model.use_remove_padding=True", f"{AR}.actor.ppo_mini_batch_size=256",
    f"{AR}.model.enable_gradient_checkpointing=True", f"{AR}.actor.fsdp_config.param_offload=False",
    f"{AR}.actor.fsdp_config.optimizer_offload=False", f"{AR}.rollout.name=vllm", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", "trainer.logger=['console','wandb']", "trainer.project_name='verl_example_gsm8k'",
    "trainer.experiment_name='gsm8k'", "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.total_epochs=15",
]
KL_LOSS = [f"{AR}.actor.use_kl_loss=True", f"{AR}.actor.kl_loss_coef=0.001", f"{AR}.actor.kl_loss_type=low_var_kl",
           f"{AR}.actor.entropy_coeff=0"]
PPO = [*COMMON, "algorithm.adv_estimator=gae", "data.max_response_length=512", f"{AR}.model.path=deepseek-ai/deepseek-llm-7b-chat",
       f"{AR}.actor.ppo_micro_batch_size_per_gpu=16", f"{AR}.actor.use_kl_loss=False",
       f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=32", f"{AR}.rollout.tensor_model_parallel_size=4",
       f"{AR}.rollout.gpu_memory_utilization=0.4", "critic.optim.lr=1e-5", "critic.model.use_remove_padding=True",
       "critic.model.path=deepseek-ai/deepseek-llm-7b-chat", "critic.model.enable_gradient_checkpointing=True",
       "critic.ppo_micro_batch_size_per_gpu=32", "critic.model.fsdp_config.param_offload=False",
       "critic.model.fsdp_config.optimizer_offload=False", "trainer.test_freq=1"]
GRPO = [*COMMON, *KL_LOSS, "algorithm.adv_estimator=grpo", "data.max_response_length=1024", f"{AR}.model.path=Qwen/Qwen2-7B-Instruct",
        f"{AR}.actor.ppo_micro_batch_size_per_gpu=40", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=40",
        f"{AR}.rollout.tensor_model_parallel_size=2", f"{AR}.rollout.gpu_memory_utilization=0.6", f"{AR}.rollout.n=5",
        f"{AR}.ref.log_prob_micro_batch_size_per_gpu=40", f"{AR}.ref.fsdp_config.param_offload=True", "trainer.test_freq=5"]
SEQ_BALANCE = [*COMMON, *KL_LOSS, "algorithm.adv_estimator=grpo", "data.max_response_length=1024",
               f"{AR}.model.path=Qwen/Qwen2-7B-Instruct", f"{AR}.actor.use_dynamic_bsz=True",
               f"{AR}.actor.ppo_max_token_len_per_gpu=24000", f"{AR}.actor.ulysses_sequence_parallel_size=2",
               f"{AR}.rollout.log_prob_max_token_len_per_gpu=48000", f"{AR}.ref.log_prob_max_token_len_per_gpu=48000",
               f"{AR}.rollout.tensor_model_parallel_size=2", f"{AR}.rollout.gpu_memory_utilization=0.6", f"{AR}.rollout.n=5",
               f"{AR}.ref.fsdp_config.param_offload=True", "trainer.test_freq=5"]
LORA = [*COMMON, *KL_LOSS, "algorithm.adv_estimator=grpo", "data.max_response_length=1024", "data.shuffle=False",
        f"{AR}.model.path=Qwen/Qwen2.5-3B-Instruct", f"{AR}.model.use_shm=True", f"{AR}.model.lora_rank=64",
        f"{AR}.model.lora_alpha=32", f"{AR}.model.target_modules=all-linear", f"{AR}.actor.ppo_micro_batch_size_per_gpu=40",
        f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=40", f"{AR}.rollout.load_format=safetensors",
        f"{AR}.rollout.layered_summon=True", f"{AR}.rollout.n=5", f"{AR}.ref.log_prob_micro_batch_size_per_gpu=40",
        "trainer.test_freq=5"]
SMALL = ["data.train_batch_size=4", f"{AR}.actor.ppo_mini_batch_size=2", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
         f"{AR}.rollout.name=hf"]
"""Sizes a CPU can load (and no vllm or wandb package needed), as a verl user would override them."""


def translated(args: list[str], rows: int = 7473) -> dict[str, str]:
    """``packrl key -> value text`` of the translation, after checking it loads cleanly."""
    translation = translate(args, num_train_rows=rows)
    load_config(translation.preset, translation.overrides)
    return dict(o.split("=", 1) for o in translation.overrides)


def test_gsm8k_ppo_example_maps_to_gae_with_a_critic():
    out = translated(PPO + SMALL)
    assert out["algorithm.adv_estimator"] == "gae" and out["critic.lr"] == "1e-05"
    assert out["critic.max_tokens_per_microbatch"] == str(32 * (512 + 512))
    assert out["train.max_tokens_per_microbatch"] == str(16 * 1024) and out["train.max_tokens_per_logprob_microbatch"] == str(32 * 1024)
    assert out["rollout.n"] == "1" and out["algorithm.kl_coef"] == "0.0"  # verl's default n; no KL loss
    assert "critic.model.path" not in out  # the actor's own path = packrl's default (null)
    assert out["train.total_steps"] == str(15 * (7473 // 4)) and out["train.val_every"] == "1"


def test_gsm8k_grpo_example_maps_sizes_and_units():
    translation = translate(GRPO, num_train_rows=7473)
    out = dict(o.split("=", 1) for o in translation.overrides)
    assert out["data.batch_size"] == "1024" and out["train.mini_batch_size"] == "256" and out["rollout.n"] == "5"
    assert out["data.max_prompt_tokens"] == "512" and out["rollout.max_response_tokens"] == "1024"
    assert out["train.max_tokens_per_microbatch"] == str(40 * 1536) == out["train.max_tokens_per_logprob_microbatch"]
    assert out["algorithm.kl_coef"] == "0.001" and out["algorithm.kl_estimator"] == "k3" and out["algorithm.kl_in_reward"] == "false"
    assert out["trainer.num_workers"] == "8" and out["rollout.engine"] == "vllm"
    assert out["rollout.engine_kwargs.gpu_memory_utilization"] == "0.6" and out["data.overlong_prompt"] == "filter"
    assert out["train.total_steps"] == str(15 * (7473 // 1024)) and out["train.weight_decay"] == "0.01"  # verl's default
    report = translation.report()
    assert "40 sequences x (max_prompt_length + max_response_length = 1,536) tokens = 61,440 tokens" in report
    assert "15 epochs x floor(7,473 rows / 1,024 prompts) = 105 steps" in report
    assert translation.command().startswith("packrl train gsm8k ")
    translated(GRPO + SMALL)


def test_sequence_balance_example_keeps_token_budgets_per_gpu():
    out = translated(SEQ_BALANCE + SMALL + ["trainer.n_gpus_per_node=2"])
    assert out["train.max_tokens_per_microbatch"] == "24000"  # per GPU in both; a pack holds x 2 in both
    assert out["train.max_tokens_per_logprob_microbatch"] == "48000" and out["trainer.sequence_parallel_size"] == "2"
    assert out["trainer.num_workers"] == "2"


def test_micro_batch_sequences_under_sequence_parallelism_become_tokens_per_rank():
    args = GRPO + SMALL + ["trainer.n_gpus_per_node=2", f"{AR}.actor.ulysses_sequence_parallel_size=2",
                           f"{AR}.actor.ppo_micro_batch_size_per_gpu=3"]
    out = translated(args)
    assert out["train.max_tokens_per_microbatch"] == str(3 * 1536 // 2)


def test_global_micro_batch_is_divided_over_data_parallel_ranks():
    out = translated(GRPO + SMALL + ["trainer.n_gpus_per_node=4", f"{AR}.actor.ppo_micro_batch_size=8"]
                     + [f"{AR}.actor.ppo_micro_batch_size_per_gpu=null", "data.train_batch_size=8", f"{AR}.actor.ppo_mini_batch_size=4"])
    assert out["train.max_tokens_per_microbatch"] == str(2 * 1536)


def test_lora_example_maps_rank_alpha_and_targets():
    out = translated(LORA + SMALL)
    assert (out["model.lora.rank"], out["model.lora.alpha"], out["model.lora.target_modules"]) == ("64", "32.0", "[all-linear]")
    assert out["data.shuffle"] == "false"
    assert translated(LORA + SMALL + [f"{AR}.model.lora_alpha=16", f"{AR}.model.lora_rank=8"])["model.lora.rank"] == "8"
    no_alpha = [a for a in LORA if "lora_alpha" not in a]
    assert translated(no_alpha + SMALL)["model.lora.alpha"] == "16.0"  # verl's default alpha, not packrl's


def test_hydra_append_forms_are_accepted():
    assert parse_override("++trainer.val_before_train=False").key == "trainer.val_before_train"
    args = GRPO + SMALL[:-1] + [f"+{AR}.rollout.engine_kwargs.vllm.disable_cascade_attn=True",
                                f"++{AR}.model.override_config.rope_scaling.type=yarn",
                                f"+{AR}.model.override_config.rope_scaling.factor=2.0"]
    out = dict(o.split("=", 1) for o in translate(args, num_train_rows=7473).overrides)  # vllm need not be installed
    assert out["rollout.engine_kwargs.disable_cascade_attn"] == "true"
    assert out["model.rope_scaling.type"] == "yarn" and out["model.rope_scaling.factor"] == "2.0"


def test_misspelled_key_names_the_nearest_verl_key():
    with pytest.raises(ConfigError) as err:
        translate(GRPO + [f"{AR}.actor.ppo_mini_batchsize=64", "trainer.n_gpu_per_node=2", "train.lr=1e-5",
                          "algorithm.filters.gfpo.keep=2", "reward.shaping.overlong.buffer_tokens=8"], num_train_rows=100)
    text = str(err.value)
    assert "train.lr is a packrl key: add it to the `packrl train` command" in text
    assert "algorithm.filters.gfpo.keep is a packrl key" in text and "reward.shaping.overlong.buffer_tokens is a packrl key" in text
    assert f"{AR}.actor.ppo_mini_batchsize=64: is not a verl config key; fix: did you mean {AR}.actor.ppo_mini_batch_size?" in text
    assert "did you mean trainer.n_gpus_per_node?" in text


def test_ignored_keys_are_named_with_their_reason():
    translation = translate(GRPO + [f"{AR}.actor.fsdp_config.wrap_policy.min_num_params=0", "trainer.balance_batch=True"],
                            num_train_rows=7473)
    ignored = {i.key: i.reason for i in translation.ignored}
    assert "FSDP sharding detail" in ignored[f"{AR}.actor.fsdp_config.wrap_policy.min_num_params"]
    assert "project_name" not in " ".join(translation.overrides) and "logging" in ignored["trainer.project_name"]
    assert "tensor_model_parallel_size" in " ".join(ignored) and "balances ranks" in ignored["trainer.balance_batch"]
    given = {parse_override(a).key for a in GRPO}
    named = {i.key for i in translation.ignored} | {s.split("=", 1)[0] for m in translation.mappings for s in m.sources}
    assert given <= named  # no key is dropped silently


def test_unhonourable_values_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        translate(GRPO + [f"{AR}.actor.strategy=megatron", f"{AR}.actor.policy_loss.loss_mode=sapo",
                          "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=0"], num_train_rows=7473)
    problems = {p.key: p for p in err.value.problems}
    assert "Megatron" in problems[f"{AR}.actor.strategy"].fix
    assert "vanilla" in problems[f"{AR}.actor.policy_loss.loss_mode"].fix
    assert problems["algorithm.filter_groups.max_num_gen_batches"].fix == "set algorithm.filter_groups.max_num_gen_batches=10"


def test_policy_losses_and_dynamic_sampling_map_to_algorithm_keys():
    out = translated(GRPO + SMALL + [f"{AR}.actor.policy_loss.loss_mode=clip_cov", f"{AR}.actor.policy_loss.clip_cov_ratio=0.0004",
                                     f"{AR}.actor.policy_loss.kl_cov_ratio=0.002", "algorithm.filter_groups.enable=True",
                                     "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
                                     "data.gen_batch_size=12"])
    assert out["algorithm.policy_loss"] == "clip_cov" and out["algorithm.policy_loss_args.clip_cov_ratio"] == "0.0004"
    assert "algorithm.policy_loss_args.kl_cov_ratio" not in out  # read by kl_cov only: named as ignored
    assert out["algorithm.filters.dynamic_sampling.metric"] == "score"
    assert out["algorithm.filters.dynamic_sampling.max_num_gen_batches"] == "30"
    assert translated(GRPO + SMALL + [f"{AR}.actor.policy_loss.loss_mode=vanilla"])["algorithm.policy_loss"] == "ppo_clip"


def test_dry_run_prints_the_command_conversions_and_resolved_config(capsys):
    assert main(["verl", "--dry-run", *GRPO, *SMALL, "trainer.total_training_steps=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("packrl train gsm8k ") and "train.total_steps=3" in out
    assert "ignored (verl keys packrl does not use):" in out and "resolved config:" in out and "max_tokens_per_microbatch: 61440" in out


def test_a_dry_run_for_vllm_on_a_machine_without_it_prints_the_translation_and_warns(capsys, monkeypatch):
    """People translate on a laptop for a GPU cluster: vLLM missing here is a warning for a dry
    run and stays an error for a run that trains."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    vllm = [*GRPO, *SMALL[:-1], "trainer.total_training_steps=3"]  # rollout.name=vllm, as written for the cluster
    assert main(["verl", "--dry-run", *vllm]) == 0
    out, err = capsys.readouterr()
    assert "rollout.engine=vllm" in out and "resolved config:" in out
    assert "warning: rollout.engine='vllm': needs the vllm package, which is not installed here" in err
    assert main(["verl", *vllm]) == 2
    assert "needs the vllm package, which is not installed here" in capsys.readouterr().err


def test_cli_refuses_unknown_keys_and_names_verl_sources_of_packrl_problems(capsys):
    assert main(["verl", "--dry-run", *GRPO, "data.max_prompt_lenght=9"]) == 2
    assert "did you mean data.max_prompt_length?" in capsys.readouterr().err
    assert main(["verl", "--dry-run", *GRPO, *SMALL, "trainer.total_training_steps=3", f"{AR}.actor.ppo_mini_batch_size=3"]) == 2
    assert f"(from verl: {AR}.actor.ppo_mini_batch_size=3" in capsys.readouterr().err


def test_every_mapped_verl_key_names_real_packrl_keys_and_is_documented():
    from pathlib import Path

    from packrl.config import RunConfig

    cfg = RunConfig()
    for verl_key, rule in [*VERL_KEYS.items(), *FAMILIES.items()]:
        for target in filter(None, (t.strip().split("=")[0] for t in rule.packrl.split(","))):
            value = cfg
            for part in target.split("."):
                value = value.get(part, {}) if isinstance(value, dict) else getattr(value, part)  # engine_kwargs: a dict
    doc = (Path(__file__).resolve().parents[2] / "docs" / "verl.md").read_text()
    missing = [k for k in [*VERL_KEYS, *FAMILIES] if f"`{k.replace(AR, 'AR')}" not in doc]
    assert not missing, f"docs/verl.md lacks {missing[:5]}"


def write_verl_parquet(path, rows: int) -> None:
    """The first ``rows`` GSM8K training rows in verl's RL schema (examples/data_preprocess/gsm8k.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = (SHARED / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:rows]
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    table = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        table.append({"data_source": "openai/gsm8k", "ability": "math",
                      "prompt": [{"role": "user", "content": f"{row['question']} {instruction}"}],
                      "reward_model": {"style": "rule", "ground_truth": row["answer"].split("####")[-1].strip().replace(",", "")},
                      "extra_info": {"split": "train", "index": i}})
    pq.write_table(pa.Table.from_pylist(table), path)


def test_total_epochs_counts_parquet_rows(tmp_path):
    pytest.importorskip("pyarrow")
    skip_without_shared(GSM8K_DIR / "train.jsonl")
    write_verl_parquet(tmp_path / "train.parquet", 10)
    assert count_rows([str(tmp_path / "train.parquet")]) == 10 and count_rows(["openai/gsm8k"]) is None




@pytest.mark.slow
@needs_shared(GGUF, GSM8K_DIR / "train.jsonl")
def test_translated_gsm8k_grpo_command_trains_one_step(tmp_path, capsys):
    write_verl_parquet(tmp_path / "train.parquet", 8)
    out_dir = tmp_path / "run"
    args = [a for a in GRPO if not a.startswith(("data.train_files", "data.val_files"))]
    args += [f"data.train_files={tmp_path / 'train.parquet'}", f"{AR}.model.path={GGUF}", "data.train_batch_size=2",
             f"{AR}.actor.ppo_mini_batch_size=2", f"{AR}.rollout.n=2", "data.max_response_length=32",
             "trainer.n_gpus_per_node=1", "trainer.logger=[console]", f"{AR}.rollout.name=hf", "trainer.test_freq=-1",
             f"trainer.default_local_dir={out_dir}", "trainer.total_training_steps=1",
             f"{AR}.model.enable_gradient_checkpointing=False"]
    assert main(["verl", *args]) == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1] and lines[0]["response_length/max"] <= 32
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # full weights + AdamW states


def test_torch_compile_off_turns_compiled_layers_off():
    assert translated(GRPO + SMALL + [f"{AR}.actor.use_torch_compile=False"])["model.compile"] == "false"
    assert translated(GRPO + SMALL + [f"{AR}.actor.use_torch_compile=True"]).get("model.compile", "null") == "null"
