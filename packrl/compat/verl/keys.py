"""The verl config keys packrl knows, what each becomes, and how.

A verl launch script passes Hydra overrides to ``python3 -m verl.trainer.main_ppo``. `VERL_KEYS`
lists the keys of verl's ``ppo_trainer.yaml`` (verl 0.9.1's, FSDP engine, with the spellings of
verl 0.5-0.9.0 that scripts still pass) and the recipe keys scripts pass (``data.gen_batch_size``,
``reward_model.overlong_buffer.*``), each with a `KeyRule` that states every packrl key the verl
key reaches. A rule is one of:

====================  =====================================================================
rule                  what `packrl.compat.verl.translate` does with the key
====================  =====================================================================
executable            ``convert`` set: the table itself maps the value to ``packrl`` (one
                      key), with a unit or name conversion (`packrl.compat.verl.convert`)
relational            ``by`` set: the named function(s) of `packrl.compat.verl.relational`
                      set the ``packrl`` keys from this and other verl keys (budgets from
                      micro-batch keys, steps from epochs and rows, the critic, ...)
both                  ``convert`` maps the first ``packrl`` key; ``by`` reads the key for the
                      others (``data.train_batch_size`` is also half of the total steps)
``accept=ANY``        ignored with ``reason`` (a setting packrl does not need)
``accept`` values     those values ignored with ``reason``; any other is refused with
                      ``reason`` and ``fix`` (a setting packrl cannot honour exactly)
====================  =====================================================================

`FAMILIES` covers free-form sub-trees (``engine_kwargs.vllm.*``, profilers, FSDP settings).
A key in neither is not a verl key: `nearest_key` names the nearest one for the error, since
guides circulate misspelled keys (nearest by the sections and name parts shared, then by spelling:
`packrl.compat.verl.nearest`). `BEHAVIOUR` names the packrl keys set with no verl key behind
them. The module is data and pure functions; it imports no torch.
"""

from __future__ import annotations

from typing import Any

import packrl.compat.verl.convert as cv
from packrl.compat.verl.nearest import nearest
from packrl.compat.verl.rules import ACTOR, ANY, AR, REF, ROLLOUT, KeyRule
from packrl.compat.verl.rules import ignored_rule as _i
from packrl.compat.verl.rules import relational_rule as _r
from packrl.compat.verl.rules import table_rule as _x

__all__ = ["ACTOR", "ANY", "AR", "BEHAVIOUR", "DEFAULTS", "FAMILIES", "REF", "ROLLOUT", "VERL_KEYS", "VLLM_PASSED", "KeyRule",
           "nearest_key", "rule_of"]


_PERF = "a speed/memory setting of verl's workers; packrl sizes work by token budgets (train.max_tokens_per_*)"
_LOG = "a logging or naming nicety; packrl names a run by its directory (train.out_dir) and logs to train.loggers"
_PROFILE = "a profiler setting; packrl times every stage and update micro-batch in RUN_DIR/trace.json (train.trace)"
_FSDP = "an FSDP sharding detail; packrl wraps each decoder layer with FSDP2 when trainer.num_workers > 1"
_MEGATRON = "Megatron-only; verl's FSDP workers (the ones packrl corresponds to) do not read it"
_ENGINE = "an inference-engine detail; packrl runs its engine in the worker's process and derives its limits from the budgets"
_PACKED = "packrl always packs sequences without padding (model.packed_attention); results equal the padded forward (invariant 1)"
_OFFLOAD = ("packrl offloads the reference and the critic together with the policy (model.param_offload, set from "
            "actor_rollout_ref.actor.fsdp_config.*_offload)")
_CHUNKED = "packrl always computes log-probs and entropy in chunks of train.logits_chunk_tokens tokens"
_DERIVED = "packrl derives it from the token budgets (see rollout.max_num_seqs and the vLLM settings in docs/engines.md)"
_SCHEDULE = "packrl's LR schedule is a linear warmup, then constant"
_CHECKPOINT = "packrl checkpoints hold the model, optimizer, schedule, data position and step"
_INTERNAL = "set by verl's trainer at run time, not by a user"
_NO_CRITIC_LORA = "packrl's critic trains its whole model"
_REWARD_MODEL = "packrl scores with registered reward functions (reward.name), not a reward model"
_COSINE = "read only by verl's cosine schedule, which packrl does not offer"
_ROUTER = "MoE routing replay; packrl routes every forward by the model's own router"
_MTP = "read only with model.mtp.enable (multi-token prediction), which packrl does not train"
_TOOLS = ("packrl's tools are registered functions (rollout.multi_turn.tools)", (None,),
          "register the tool (packrl.registry.TOOLS) in a trainer.plugins file and set rollout.multi_turn.tools")
_OPTIMIZER_IMPL = ("packrl's optimizer is torch.optim.AdamW", ("torch.optim",), "remove optim.optimizer_impl")
_OPTIMIZER_OVERRIDE = ("packrl's AdamW takes optim.lr, optim.weight_decay and torch's betas", (None,),
                       "remove optim.override_optimizer_config")
_TIMELINE = cv.switch_on("a Ray timeline -> RUN_DIR/trace.json: spans per stage and per micro-batch")


def _actor_like(role: str) -> dict[str, KeyRule]:
    """Keys the actor and the reference share (FSDP strategy, sequence parallelism, compile flags);
    the reference's log-prob micro-batch keys (verl's actor has none: its old log-probs use
    ``rollout.log_prob_*``)."""
    p = f"{AR}.{role}"
    rules = {
        f"{p}.strategy": _i("packrl's workers are FSDP2 (trainer.num_workers > 1) or one process", ("fsdp", "fsdp2"),
                            "packrl has no Megatron backend; use fsdp2 settings"),
        f"{p}.ulysses_sequence_parallel_size": _r("trainer.sequence_parallel_size", "_parallel"),
        f"{p}.entropy_from_logits_with_chunking": _i(_CHUNKED),
        f"{p}.entropy_from_logits_chunk_size": _i(_CHUNKED),
        f"{p}.entropy_checkpointing": _i(_CHUNKED),
        f"{p}.pad_to_length": _i(_PACKED),
        f"{p}.use_torch_compile": _i(_PERF),
        f"{p}.rollout_n": _i(_INTERNAL),
        f"{p}.router_replay.mode": _i(_ROUTER, ("disabled",), f"set {p}.router_replay.mode=disabled (verl <= 0.9.0)"),
    }
    if role == "ref":
        rules |= {
            f"{p}.log_prob_micro_batch_size": _r("train.max_tokens_per_logprob_microbatch", "_budgets",
                                                 "sequences over all GPUs -> tokens per GPU"),
            f"{p}.log_prob_micro_batch_size_per_gpu": _r("train.max_tokens_per_logprob_microbatch", "_budgets", "sequences -> tokens"),
            f"{p}.log_prob_use_dynamic_bsz": _r("train.max_tokens_per_logprob_microbatch", "_budgets",
                                                "picks the token or the sequence budget"),
            f"{p}.log_prob_max_token_len_per_gpu": _r("train.max_tokens_per_logprob_microbatch", "_budgets"),
        }
    else:
        unused = _i(f"not a key of verl's actor (ppo_trainer.yaml): verl's old log-probs use {ROLLOUT}.log_prob_*")
        rules |= {f"{p}.{name}": unused for name in ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
                                                    "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")}
    return rules


_DATA = {
    "data.tokenizer": _i("packrl uses the model's own tokenizer", (None,), "leave data.tokenizer unset; set model.path"),
    "data.use_shm": _i(_PERF),
    "data.train_files": _x("data.train_files", cv.files, "verl's RL parquet schema (prompt, reward_model.ground_truth) is read as it is"),
    "data.val_files": _r("data.val_files", "_val_files"),
    "data.train_max_samples": _i("packrl trains on every row of data.train_files", (-1, None),
                                 "write the subset to its own file and pass it as data.train_files"),
    "data.val_max_samples": _x("data.max_val_rows", cv.val_rows, "-1 = all rows -> null; packrl takes the first N rows, verl a random N"),
    "data.prompt_key": _i("packrl reads verl's `prompt` column", ("prompt",), "rename the column to `prompt` in the data files"),
    "data.reward_fn_key": _i("packrl passes `data_source` to the reward", ("data_source",), "rename the column to `data_source`"),
    "data.max_prompt_length": _r("data.max_prompt_tokens", "_lengths"),
    "data.max_response_length": _r("rollout.max_response_tokens", "_lengths"),
    "data.train_batch_size": KeyRule(packrl="data.batch_size, train.total_steps", reason="prompts per step in both", convert=cv.as_int,
                                      by="_total_steps"),
    "data.val_batch_size": _i("packrl generates validation in batches of rollout.max_num_seqs; the batch does not change results"),
    "data.return_raw_input_ids": _i(_INTERNAL), "data.return_raw_chat": _i(_INTERNAL),
    "data.return_full_prompt": _i(_INTERNAL), "data.return_multi_modal_inputs": _i(_INTERNAL),
    "data.shuffle": _x("data.shuffle", cv.as_bool),
    "data.seed": _x("train.seed", cv.unless_null(cv.as_int, "null: packrl seeds from train.seed",
                    "packrl's one seed also seeds sampling"), "packrl's one seed also seeds sampling and initialisation"),
    "data.validation_shuffle": _i("packrl validates every row in file order; the order does not change the accuracy"),
    "data.dataloader_num_workers": _i(_PERF),
    "data.filter_overlong_prompts": _r("data.overlong_prompt", "_overlong_prompt", "True -> filter"),
    "data.filter_overlong_prompts_workers": _i(_PERF),
    "data.truncation": _r("data.overlong_prompt", "_overlong_prompt",
                          "left/right/middle shorten the last user message's text, error stops"),
    "data.image_key": _i("packrl reads images from verl's `images` column", ("images",), "rename the column to `images`"),
    "data.video_key": _i("packrl does not read videos", ("videos",), "remove video rows from the data"),
    "data.image_patch_size": _i("the processor's own patch size is used", (14,), "leave data.image_patch_size at 14"),
    "data.trust_remote_code": _i("packrl loads transformers' built-in architectures only"),
    "data.custom_cls.path": _i("packrl reads jsonl/json/parquet rows", (None,),
                               "write the rows in verl's RL schema to a parquet file and pass it as data.train_files"),
    "data.custom_cls.name": _i("see data.custom_cls.path"),
    "data.sampler.class_path": _i("packrl samples rows in a seeded shuffled order", (None,), "remove data.sampler.*"),
    "data.sampler.class_name": _i("see data.sampler.class_path"),
    "data.datagen.path": _i("packrl reads fixed data files", (None,), "generate the rows beforehand into a data file"),
    "data.datagen.name": _i("see data.datagen.path"),
    "data.gen_batch_size": _r("algorithm.filters.dynamic_sampling.max_num_gen_batches", "_filter_groups",
                              "rounds of gen_batch_size -> rounds of data.batch_size"),
    "data.tool_config_path": _i(*_TOOLS),
    "data.function_tool_path": _i(*_TOOLS),
    "data.audio_key": _i("packrl does not read audio", ("audios",), "remove audio rows from the data"),
    "data.apply_chat_template_kwargs": _i("packrl renders with the tokenizer's default template arguments", ({}, None),
                                          "write the template you need into the tokenizer's chat template"),
    "data.continuous_token.enable": _i("packrl always trains the exact token ids it generated, across turns too (verl 0.9.0)"),
    "data.continuous_token.model_family": _i("read only with data.continuous_token.enable"),
    "data.mm_processor_kwargs": _i("packrl runs the model's processor with its own settings and sizes images to the budgets",
                                   ({}, None), "remove data.mm_processor_kwargs (set the processor's defaults in its "
                                   "preprocessor_config.json)"),
}

_MODEL = {
    f"{AR}.model.path": _x("model.path", cv.as_str),
    f"{AR}.model.tokenizer_path": _i("packrl uses the model's own tokenizer", (None,), "put the tokenizer next to the weights"),
    f"{AR}.model.hf_config_path": _i("packrl reads the config next to the weights (model.path)", (None,),
                                     "put config.json next to the weights"),
    f"{AR}.model.override_config": _i("packrl applies only rope_scaling to the model config", ({}, None),
                                      "remove it, or set model.rope_scaling.* through override_config.rope_scaling"),
    f"{AR}.model.custom_chat_template": _i("packrl renders with the tokenizer's chat template", (None,),
                                           "write the template into the model's tokenizer_config.json"),
    f"{AR}.model.use_shm": _i(_PERF),
    f"{AR}.model.external_lib": _i("packrl imports no model libraries", (None,),
                                   "register parts through trainer.plugins; custom architectures are not supported"),
    f"{AR}.model.override_config.rope_scaling.type": _r("model.rope_scaling.type", "_rope"),
    f"{AR}.model.override_config.rope_scaling.rope_type": _r("model.rope_scaling.type", "_rope"),
    f"{AR}.model.override_config.rope_scaling.factor": _x("model.rope_scaling.factor", cv.as_float),
    f"{AR}.model.override_config.rope_scaling.original_max_position_embeddings": _i(
        "packrl takes it from the model's max_position_embeddings"),
    f"{AR}.model.enable_gradient_checkpointing": _x("model.gradient_checkpointing", cv.as_bool),
    f"{AR}.model.enable_activation_offload": _x("model.activation_offload", cv.as_bool),
    f"{AR}.model.use_remove_padding": _i(_PACKED),
    f"{AR}.model.lora_rank": _r("model.lora.rank", "_lora"),
    f"{AR}.model.lora_alpha": _r("model.lora.alpha", "_lora", "verl's default is 16 (packrl's 32)"),
    f"{AR}.model.target_modules": _r("model.lora.target_modules", "_lora"),
    f"{AR}.model.exclude_modules": _i("packrl's LoRA takes target_modules only", (None,), "list the wanted modules in target_modules"),
    f"{AR}.model.lora_adapter_path": _i("packrl starts LoRA adapters from zero", (None,), "merge the adapter into the weights first"),
    f"{AR}.model.use_liger": _i(_CHUNKED), f"{AR}.model.use_fused_kernels": _i(_CHUNKED),
    f"{AR}.model.fused_kernel_options.impl_backend": _i(_CHUNKED),
    f"{AR}.model.trust_remote_code": _i("packrl loads transformers' built-in architectures only"),
    f"{AR}.model.tiled_mlp.enabled": _i(_PERF), f"{AR}.model.tiled_mlp.num_shards": _i(_PERF),
    **{f"{AR}.model.mtp.{name}": _i("packrl does not train or draft with multi-token prediction", (False,),
                                    f"set {AR}.model.mtp.{name}=False") for name in ("enable", "enable_train", "enable_rollout")},
}

_ACTOR = {
    **_actor_like("actor"),
    f"{ACTOR}.use_torch_compile": _x("model.compile", cv.torch_compile,
                                     "false -> false; true -> null (compiled decoder layers where packrl can run "
                                     "them; verl compiles its entropy and log-prob functions)"),
    f"{ACTOR}.ppo_mini_batch_size": _x("train.mini_batch_size", cv.as_int, "prompts per optimizer step in both"),
    f"{ACTOR}.ppo_micro_batch_size": _r("train.max_tokens_per_microbatch", "_budgets", "sequences over all GPUs -> tokens per GPU"),
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": _r("train.max_tokens_per_microbatch", "_budgets", "sequences -> tokens"),
    f"{ACTOR}.use_dynamic_bsz": _r("train.max_tokens_per_microbatch", "_budgets", "picks the token or the sequence budget"),
    f"{ACTOR}.ppo_max_token_len_per_gpu": _r("train.max_tokens_per_microbatch", "_budgets",
                                             "per GPU; a pack holds x sequence_parallel_size"),
    f"{ACTOR}.clip_ratio": _r("algorithm.clip_ratio_low, algorithm.clip_ratio_high", "_clip_ratio"),
    f"{ACTOR}.clip_ratio_low": _r("algorithm.clip_ratio_low", "_clip_ratio"),
    f"{ACTOR}.clip_ratio_high": _r("algorithm.clip_ratio_high", "_clip_ratio"),
    f"{ACTOR}.clip_ratio_c": _r("algorithm.policy_loss_args.clip_ratio_c", "_clip_ratio",
                                "dual clip (arXiv 1912.09729), on in every verl run: verl's default 3.0 is set when the script "
                                "leaves it; read by loss_mode=vanilla only (ppo_clip's option)"),
    f"{ACTOR}.tau_pos": _i("read only by verl's loss_mode=sapo, which packrl does not have"),
    f"{ACTOR}.tau_neg": _i("read only by verl's loss_mode=sapo, which packrl does not have"),
    f"{ACTOR}.policy_loss.loss_mode": _x("algorithm.policy_loss", cv.policy_loss, "vanilla -> ppo_clip"),
    f"{ACTOR}.policy_loss.clip_cov_ratio": _r("algorithm.policy_loss_args.clip_cov_ratio", "_cov_losses"),
    f"{ACTOR}.policy_loss.clip_cov_lb": _r("algorithm.policy_loss_args.clip_cov_lb", "_cov_losses"),
    f"{ACTOR}.policy_loss.clip_cov_ub": _r("algorithm.policy_loss_args.clip_cov_ub", "_cov_losses"),
    f"{ACTOR}.policy_loss.kl_cov_ratio": _r("algorithm.policy_loss_args.kl_cov_ratio", "_cov_losses"),
    f"{ACTOR}.policy_loss.ppo_kl_coef": _r("algorithm.policy_loss_args.ppo_kl_coef", "_cov_losses"),
    f"{ACTOR}.policy_loss.dro_beta": _i("read only by verl's loss_mode=dro, which packrl does not have"),
    f"{ACTOR}.loss_agg_mode": _x("algorithm.loss_agg_mode", cv.loss_agg_mode, "same four names; verl 0.9's token-sum is refused"),
    f"{ACTOR}.loss_scale_factor": _x("algorithm.loss_scale_factor", cv.unless_null(cv.as_int,
                                     "null = the response budget in both (verl: the padded response width)")),
    f"{ACTOR}.entropy_coeff": _x("algorithm.entropy_coeff", cv.as_float),
    f"{ACTOR}.calculate_entropy": _i("packrl computes the entropy metric in every old-log-prob pass"),
    f"{ACTOR}.calculate_sum_pi_squared": _i("a statistic for verl's optimal-token-baseline estimators, which packrl does not have"),
    f"{ACTOR}.sum_pi_squared_checkpointing": _i("a statistic for verl's optimal-token-baseline estimators (verl 0.7.1)"),
    f"{ACTOR}.use_prefix_grouper": _i("packrl shares a group's prompt in a pack where it can (train.share_prompts, on by default); "
                                      "results are equal either way"),
    f"{ACTOR}.use_kl_loss": _r("algorithm.kl_coef, algorithm.kl_in_reward=false", "_kl"),
    f"{ACTOR}.kl_loss_coef": _r("algorithm.kl_coef", "_kl"),
    f"{ACTOR}.kl_loss_type": _r("algorithm.kl_estimator", "_kl", "kl/k1 -> k1, mse/k2 -> k2, low_var_kl/k3 -> k3"),
    f"{ACTOR}.ppo_epochs": _x("train.ppo_epochs", cv.as_int),
    f"{ACTOR}.shuffle": _i("packrl keeps one order per step; mini-batches are consecutive prompt groups"),
    f"{ACTOR}.data_loader_seed": _i("packrl seeds everything from train.seed"),
    f"{ACTOR}.checkpoint.save_contents": _i(_CHECKPOINT), f"{ACTOR}.checkpoint.load_contents": _i(_CHECKPOINT),
    f"{ACTOR}.checkpoint.async_save": _i(_CHECKPOINT), f"{ACTOR}.checkpoint.strict": _i(_CHECKPOINT),
    f"{ACTOR}.checkpoint.mbridge_config": _i(_MEGATRON),
    f"{ACTOR}.qat.enable": _i("packrl trains without quantization-aware training", (False,), f"set {ACTOR}.qat.enable=False"),
    f"{ACTOR}.fsdp_config.qat.enable": _i("packrl trains without quantization-aware training", (False,),
                                          f"set {ACTOR}.fsdp_config.qat.enable=False"),
    f"{ACTOR}.fsdp_config.model_dtype": _i("packrl keeps parameters and optimizer states in float32 and computes in model.dtype "
                                           "(verl's bf16 parameters save memory and round every update)"),
    f"{ACTOR}.optim.lr": _x("train.lr", cv.as_float),
    f"{ACTOR}.optim.lr_warmup_steps": _r("train.warmup_steps", "_warmup", "<= 0 = use lr_warmup_steps_ratio (verl 0.9's engine); "
                                         "training steps x optimizer steps per step; verl ramps once per training step (LR 0 in "
                                         "the first), packrl once per optimizer step"),
    f"{ACTOR}.optim.lr_warmup_steps_ratio": _r("train.warmup_steps", "_warmup", "int(ratio x total steps) x optimizer steps per step; "
                                               "the ramp as for lr_warmup_steps"),
    f"{ACTOR}.optim.weight_decay": _x("train.weight_decay", cv.as_float, "verl's default is 0.01 (packrl's 0.0)"),
    f"{ACTOR}.optim.warmup_style": _i(_SCHEDULE, (None, "constant"), "set optim.warmup_style=constant (cosine decay is not offered)"),
    f"{ACTOR}.optim.lr_scheduler_type": _i(_SCHEDULE, ("constant",), "set optim.lr_scheduler_type=constant"),
    f"{ACTOR}.optim.min_lr_ratio": _i(_COSINE), f"{ACTOR}.optim.num_cycles": _i(_COSINE),
    f"{ACTOR}.optim.zero_indexed_step": _i(_COSINE),
    f"{ACTOR}.optim.optimizer_impl": _i(*_OPTIMIZER_IMPL),
    f"{ACTOR}.optim.override_optimizer_config": _i(*_OPTIMIZER_OVERRIDE),
    f"{ACTOR}.optim.betas": _i("packrl's AdamW uses torch's betas", ([0.9, 0.999],), "remove optim.betas"),
    f"{ACTOR}.optim.optimizer": _i("packrl's optimizer is AdamW", ("AdamW",), "remove optim.optimizer"),
    f"{ACTOR}.optim.clip_grad": _r("train.grad_clip", "_grad_clip"),
    f"{ACTOR}.optim.total_training_steps": _i(_INTERNAL),
    f"{ACTOR}.grad_clip": _r("train.grad_clip", "_grad_clip"),
    f"{ACTOR}.use_fused_kernels": _i(_CHUNKED),
    f"{ACTOR}.tis_imp_ratio_cap": _r("algorithm.rollout_correction.rollout_is, algorithm.rollout_correction.rollout_is_threshold",
                                         "_rollout_correction", "> 0 turns token TIS on"),
    f"{ACTOR}.freeze_vision_tower": _i("packrl trains the language model's parameters"),
    f"{ACTOR}.use_rollout_log_probs": _i("packrl recomputes the old log-probs when a loss needs them"),
    f"{ACTOR}.use_remove_padding": _i(_PACKED),
    f"{ACTOR}.fsdp_config.param_offload": _r("model.param_offload", "_offload", "one switch: parameters, gradients, optimizer states"),
    f"{ACTOR}.fsdp_config.optimizer_offload": _r("model.param_offload", "_offload", "one switch: parameters, gradients, optimizer states"),
    f"{ACTOR}.fsdp_config.offload_policy": _r("model.param_offload", "_offload", "FSDP2's CPUOffloadPolicy in both"),
    f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size": _r("trainer.sequence_parallel_size", "_parallel"),
    f"{ACTOR}.fsdp_config.dtype": _x("model.dtype", cv.dtype, "bfloat16 -> bf16, float32 -> fp32"),
}

_REF = {
    **_actor_like("ref"),
    f"{AR}.ref.fsdp_config.param_offload": _i(_OFFLOAD),
}

VLLM_PASSED = ("gpu_memory_utilization", "enable_chunked_prefill", "enable_prefix_caching", "max_num_batched_tokens",
               "enforce_eager", "disable_log_stats")
"""``AR.rollout.*`` keys that are ``vllm.EngineArgs`` fields: passed to ``rollout.engine_kwargs`` under vllm."""

_ROLLOUT = {
    f"{ROLLOUT}.name": _x("rollout.engine", cv.engine, "vllm -> vllm, hf -> hf"),
    f"{ROLLOUT}.mode": _i("packrl's engine generates in the worker's process (sync or async gives the same samples)"),
    f"{ROLLOUT}.temperature": _x("rollout.temperature", cv.as_float),
    f"{ROLLOUT}.top_p": _x("rollout.top_p", cv.as_float),
    f"{ROLLOUT}.top_k": _x("rollout.top_k", cv.top_k, "-1 (off) -> 0"),
    f"{ROLLOUT}.prompt_length": _r("data.max_prompt_tokens", "_lengths"),
    f"{ROLLOUT}.response_length": _r("rollout.max_response_tokens", "_lengths"),
    f"{ROLLOUT}.dtype": _i("the engine computes in model.dtype"),
    f"{ROLLOUT}.nnodes": _i("packrl's generation runs on the training workers, or under trainer.rollout_mode=separate_async on "
                            "trainer.num_rollout_workers", (0,), f"remove {ROLLOUT}.nnodes (packrl: trainer.num_rollout_workers)"),
    f"{ROLLOUT}.n_gpus_per_node": _i(f"read only with {ROLLOUT}.nnodes > 0"),
    f"{ROLLOUT}.seed": _i("packrl seeds sampling from train.seed"),
    f"{ROLLOUT}.full_determinism": _i("packrl's engine samples from train.seed; bitwise batch invariance is vLLM's setting "
                                      "(rollout.engine_kwargs)"),
    f"{ROLLOUT}.router_config_path": _i(_ENGINE), f"{ROLLOUT}.skip_tokenizer_init": _i(_ENGINE),
    f"{ROLLOUT}.enable_rollout_routing_replay": _i(_ROUTER, (False,), f"set {ROLLOUT}.enable_rollout_routing_replay=False"),
    f"{ROLLOUT}.moe_load_balance_metrics_interval": _i(_LOG),
    f"{ROLLOUT}.quantization_config_file": _i("read only with rollout.quantization", (None,), "remove rollout.quantization_config_file"),
    f"{ROLLOUT}.mtp": _i(_MTP), f"{ROLLOUT}.qat": _i("the actor's qat section, which packrl refuses when enabled"),
    f"{ROLLOUT}.disaggregation.enabled": _i("packrl's engine runs prefill and decode together", (False,),
                                           f"set {ROLLOUT}.disaggregation.enabled=False"),
    f"{ROLLOUT}.skip.enable": _i("packrl generates every step", (False,), "remove rollout.skip.enable (verl 0.8 spelling)"),
    f"{ROLLOUT}.ignore_eos": _i("packrl stops at the end-of-sequence token", (False,), "remove rollout.ignore_eos"),
    f"{ROLLOUT}.free_cache_engine": _i(_ENGINE), f"{ROLLOUT}.load_format": _i(_ENGINE),
    f"{ROLLOUT}.layered_summon": _i(_ENGINE), f"{ROLLOUT}.multi_stage_wake_up": _i(_ENGINE),
    f"{ROLLOUT}.tensor_model_parallel_size": _i("packrl runs one engine per worker (data-parallel generation); "
                                                        "the split changes speed, not the samples"),
    f"{ROLLOUT}.data_parallel_size": _i(_ENGINE), f"{ROLLOUT}.expert_parallel_size": _i(_ENGINE),
    f"{ROLLOUT}.pipeline_model_parallel_size": _i(_ENGINE),
    f"{ROLLOUT}.max_model_len": _i(_DERIVED),
    f"{ROLLOUT}.cudagraph_capture_sizes": _i(_ENGINE),
    f"{ROLLOUT}.max_num_seqs": _x("rollout.max_num_seqs", cv.as_int),
    f"{ROLLOUT}.logprobs_mode": _i("packrl's engine returns processed log-probs, the trainer's own",
                                           ("processed_logprobs",), "remove rollout.logprobs_mode"),
    f"{ROLLOUT}.scheduling_policy": _i(_ENGINE),
    f"{ROLLOUT}.do_sample": _i("packrl samples at rollout.temperature", (True,), "sample (do_sample=True) for RL rollouts"),
    f"{ROLLOUT}.n": _x("rollout.n", cv.as_int),
    f"{ROLLOUT}.over_sample_rate": _i("packrl waits for every response", (0, 0.0), "remove rollout.over_sample_rate"),
    f"{ROLLOUT}.calculate_log_probs": _x("rollout.return_logprobs", cv.as_bool),
    f"{ROLLOUT}.log_prob_micro_batch_size": _r("train.max_tokens_per_logprob_microbatch", "_budgets", "sequences over all GPUs -> tokens"),
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": _r("train.max_tokens_per_logprob_microbatch", "_budgets", "sequences -> tokens"),
    f"{ROLLOUT}.log_prob_use_dynamic_bsz": _r("train.max_tokens_per_logprob_microbatch", "_budgets", "picks the token or sequence budget"),
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": _r("train.max_tokens_per_logprob_microbatch", "_budgets"),
    f"{ROLLOUT}.val_kwargs.temperature": _r("rollout.val_temperature", "_val_temperature", "with do_sample=True; 0 -> greedy (0)"),
    f"{ROLLOUT}.val_kwargs.do_sample": _r("rollout.val_temperature", "_val_temperature", "False -> 0 (greedy)"),
    f"{ROLLOUT}.val_kwargs.n": _i("packrl validates one response per prompt", (1,), "set val_kwargs.n=1"),
    f"{ROLLOUT}.val_kwargs.top_p": _i("packrl validates greedily or at rollout.val_temperature"),
    f"{ROLLOUT}.val_kwargs.top_k": _i("packrl validates greedily or at rollout.val_temperature"),
    f"{ROLLOUT}.multi_turn.enable": _r("rollout.multi_turn.tools", "_multi_turn"),
    f"{ROLLOUT}.multi_turn.max_assistant_turns": _r("rollout.multi_turn.max_turns", "_multi_turn"),
    f"{ROLLOUT}.multi_turn.max_user_turns": _i("packrl's trajectories have no simulated user turns", (None,),
                                                       "remove multi_turn.max_user_turns"),
    f"{ROLLOUT}.multi_turn.max_parallel_calls": _i("packrl runs the tool calls of a turn one after another"),
    f"{ROLLOUT}.multi_turn.max_tool_response_length": _r("rollout.multi_turn.max_tool_response_tokens", "_multi_turn",
                                                         "characters -> tokens"),
    f"{ROLLOUT}.multi_turn.tool_response_truncate_side": _r("rollout.multi_turn.tool_response_truncation_side", "_multi_turn",
                                                                    "verl left (keeps the head) -> right, right -> left"),
    f"{ROLLOUT}.multi_turn.tool_config_path": _r("rollout.multi_turn.tools", "_multi_turn"),
    f"{ROLLOUT}.multi_turn.function_tool_path": _i(*_TOOLS),
    f"{ROLLOUT}.multi_turn.interaction_config_path": _i("packrl has no simulated-user interactions", (None,),
                                                                "remove multi_turn.interaction_config_path"),
    f"{ROLLOUT}.multi_turn.format": _i("packrl's tool calls use <tool_call>{json}</tool_call> (hermes)", ("hermes",),
                                               "prompt the model for hermes-style calls"),
    f"{ROLLOUT}.multi_turn.use_inference_chat_template": _i("packrl trains the exact ids it generated"),
    f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode": _i("packrl trains the exact ids it generated"),
    f"{ROLLOUT}.multi_turn.num_repeat_rollouts": _i(_INTERNAL),
    f"{ROLLOUT}.agent.num_workers": _i(_PERF),
    f"{ROLLOUT}.agent.default_agent_loop": _i("packrl picks single- or multi-turn from rollout.multi_turn.tools",
                                              ("single_turn_agent", "tool_agent"), "register an engine (packrl.registry.ROLLOUT_ENGINES)"),
    f"{ROLLOUT}.agent.agent_loop_config_path": _i("packrl has no agent-loop files", (None,), "remove agent.agent_loop_config_path"),
    f"{ROLLOUT}.trace.backend": _i("packrl writes RUN_DIR/trace.json and, with train.dump_rollouts, every response"),
    f"{ROLLOUT}.trace.token2text": _i("see rollout.trace.backend"),
    f"{ROLLOUT}.trace.max_samples_per_step_per_worker": _i("see rollout.trace.backend"),
    f"{ROLLOUT}.trace.project_name": _i(_LOG), f"{ROLLOUT}.trace.experiment_name": _i(_LOG),
    f"{ROLLOUT}.skip_rollout": _i("packrl generates every step", (False,), "remove rollout.skip_rollout"),
    f"{ROLLOUT}.skip_dump_dir": _i("read only with skip_rollout"),
    f"{ROLLOUT}.update_weights_bucket_megabytes": _i(_ENGINE),
    f"{ROLLOUT}.quantization": _i("packrl's engine generates with the policy's own weights", (None,), "remove rollout.quantization"),
    **{f"{ROLLOUT}.{name}": _r(f"rollout.engine_kwargs.{name}", "_vllm_args", "vllm engine argument") for name in VLLM_PASSED},
}

_CRITIC = {
    "critic.enable": _r("critic.enable", "_critic"),
    "critic.strategy": _i("packrl's critic runs in the policy's workers", ("fsdp", "fsdp2"), "packrl has no Megatron backend"),
    "critic.optim.lr": _r("critic.lr", "_critic"),
    "critic.optim.lr_warmup_steps": _i("packrl's critic learning rate follows the actor's warmup (train.warmup_steps)", (-1, 0, None),
                                       "remove critic.optim.lr_warmup_steps"),
    "critic.optim.lr_warmup_steps_ratio": _i("packrl's critic learning rate follows the actor's warmup (train.warmup_steps)",
                                             (0, 0.0), "remove critic.optim.lr_warmup_steps_ratio"),
    "critic.optim.weight_decay": _r("train.weight_decay", "_critic", "one weight decay for actor and critic"),
    "critic.optim.warmup_style": _i(_SCHEDULE, (None, "constant"), "set critic.optim.warmup_style=constant"),
    "critic.optim.optimizer": _i("packrl's optimizer is AdamW", ("AdamW",), "remove critic.optim.optimizer"),
    "critic.optim.optimizer_impl": _i(*_OPTIMIZER_IMPL), "critic.optim.override_optimizer_config": _i(*_OPTIMIZER_OVERRIDE),
    "critic.optim.zero_indexed_step": _i(_COSINE),
    "critic.optim.lr_scheduler_type": _i(_SCHEDULE, ("constant",), "set critic.optim.lr_scheduler_type=constant"),
    "critic.optim.min_lr_ratio": _i("read only by verl's cosine schedule"),
    "critic.optim.num_cycles": _i("read only by verl's cosine schedule"),
    "critic.optim.betas": _i("packrl's AdamW uses torch's betas", ([0.9, 0.999],), "remove critic.optim.betas"),
    "critic.optim.clip_grad": _r("critic.grad_clip", "_critic"),
    "critic.optim.total_training_steps": _i(_INTERNAL),
    "critic.model.path": _r("critic.model.path", "_critic", "the actor's path -> null (packrl's default: the policy's checkpoint)"),
    "critic.model.tokenizer_path": _i("the critic uses the policy's tokenizer"),
    "critic.model.hf_config_path": _i("packrl reads the config next to the critic's weights", (None,), "put config.json there"),
    "critic.model.custom_chat_template": _i("the critic scores the policy's rendered tokens"),
    "critic.model.exclude_modules": _i(_NO_CRITIC_LORA), "critic.model.lora_adapter_path": _i(_NO_CRITIC_LORA, (None,),
                                                                                           "remove critic.model.lora_adapter_path"),
    "critic.model.use_liger": _i(_CHUNKED), "critic.model.use_fused_kernels": _i(_CHUNKED),
    "critic.model.fused_kernel_options.impl_backend": _i(_CHUNKED),
    "critic.model.tiled_mlp.enabled": _i(_PERF), "critic.model.tiled_mlp.num_shards": _i(_PERF),
    "critic.model.override_config": _i("the critic's config is the backbone's own", ({}, None), "remove critic.model.override_config"),
    "critic.model.external_lib": _i("packrl imports no model libraries", (None,), "remove critic.model.external_lib"),
    "critic.model.trust_remote_code": _i("packrl loads transformers' built-in architectures only"),
    "critic.model.enable_gradient_checkpointing": _i("the critic follows model.gradient_checkpointing"),
    "critic.model.enable_activation_offload": _i("the critic follows model.activation_offload"),
    "critic.model.use_remove_padding": _i(_PACKED),
    "critic.model.use_shm": _i(_PERF),
    **{f"critic.{fsdp}.{name}": _i(_OFFLOAD) for fsdp in ("model.fsdp_config", "fsdp") for name in ("param_offload", "optimizer_offload")},
    "critic.fsdp.ulysses_sequence_parallel_size": _i("packrl's critic does not run under sequence parallelism", (1,),
                                                     "set critic.fsdp.ulysses_sequence_parallel_size=1"),
    "critic.model.lora_rank": _i(_NO_CRITIC_LORA, (0,), "set critic.model.lora_rank=0"),
    "critic.model.lora_alpha": _i(_NO_CRITIC_LORA), "critic.model.target_modules": _i(_NO_CRITIC_LORA),
    "critic.ppo_mini_batch_size": _r("train.mini_batch_size", "_critic", "the critic updates on the actor's mini-batches"),
    "critic.ppo_micro_batch_size": _r("critic.max_tokens_per_microbatch", "_critic", "sequences over all GPUs -> tokens per GPU"),
    "critic.ppo_micro_batch_size_per_gpu": _r("critic.max_tokens_per_microbatch", "_critic", "sequences -> tokens"),
    "critic.forward_micro_batch_size": _i("the value pass uses train.max_tokens_per_logprob_microbatch"),
    "critic.forward_micro_batch_size_per_gpu": _i("the value pass uses train.max_tokens_per_logprob_microbatch"),
    "critic.use_dynamic_bsz": _r("critic.max_tokens_per_microbatch", "_critic", "picks the token or sequence budget"),
    "critic.ppo_max_token_len_per_gpu": _r("critic.max_tokens_per_microbatch", "_critic"),
    "critic.forward_max_token_len_per_gpu": _i("the value pass uses train.max_tokens_per_logprob_microbatch"),
    "critic.ulysses_sequence_parallel_size": _i("packrl's critic does not run under sequence parallelism", (1,),
                                                "set critic.ulysses_sequence_parallel_size=1"),
    "critic.ppo_epochs": _r("train.ppo_epochs", "_critic", "the critic passes over the batch with the actor"),
    "critic.shuffle": _i("packrl keeps one order per step"), "critic.data_loader_seed": _i("packrl seeds from train.seed"),
    "critic.grad_clip": _r("critic.grad_clip", "_critic"),
    "critic.cliprange_value": _r("critic.cliprange_value", "_critic"),
    "critic.loss_agg_mode": _r("algorithm.loss_agg_mode", "_critic", "the critic aggregates as the actor"),
    "critic.loss_scale_factor": _r("algorithm.loss_scale_factor", "_critic", "the critic aggregates as the actor"),
    "critic.checkpoint.save_contents": _i(_CHECKPOINT), "critic.checkpoint.load_contents": _i(_CHECKPOINT),
    "critic.checkpoint.async_save": _i(_CHECKPOINT), "critic.checkpoint.mbridge_config": _i(_MEGATRON),
    "critic.rollout_n": _i(_INTERNAL),
}

_OVERLONG = "reward.shaping.overlong.buffer_tokens"
_RC = "algorithm.rollout_correction"
_REWARD = {
    "reward_model.enable": _i(_REWARD_MODEL, (False, None), "register a reward function in a trainer.plugins file and set reward.name"),
    "reward.reward_model.enable": _i(_REWARD_MODEL, (False,), "register a reward function in a trainer.plugins file and set reward.name"),
    "reward_model.num_workers": _i(_PERF), "reward.num_workers": _i(_PERF),
    "reward_model.enable_resource_pool": _i(_REWARD_MODEL), "reward_model.n_gpus_per_node": _i(_REWARD_MODEL),
    "reward_model.nnodes": _i(_REWARD_MODEL),
    "reward_model.reward_loop_source": _i("packrl scores with registered reward functions", ("register", None),
                                          "register the reward in a trainer.plugins file and set reward.name"),
    "reward_model.reward_loop_module_path": _i("read only with reward_loop_source"),
    "reward_model.reward_loop_class_name": _i("read only with reward_loop_source"),
    "reward_manager.name": _r(_OVERLONG, "_reward", "verl 0.7-0.8 spelling of reward.reward_manager.name"),
    "reward_manager.source": _i("packrl scores with registered reward functions", ("register",),
                                "register the reward in a trainer.plugins file and set reward.name"),
    "reward_model.use_reward_loop": _i("verl's asynchronous scoring loop; the scores are the same"),
    "reward_model.ulysses_sequence_parallel_size": _i(_REWARD_MODEL),
    "reward.reward_manager.source": _i("packrl scores with registered reward functions", ("register",),
                                       "register the reward in a trainer.plugins file and set reward.name"),
    "reward.reward_manager.name": _r(_OVERLONG, "_reward",
                                     "naive/batch/prime score alike; dapo adds the overlong penalty (verl 0.9 spelling)"),
    "reward_model.strategy": _i(_REWARD_MODEL),
    "reward_model.reward_manager": _r(_OVERLONG, "_reward",
                                      "naive/batch/prime score alike; dapo adds the overlong penalty"),
    "reward_model.launch_reward_fn_async": _i(_PERF),
    "reward_model.micro_batch_size": _i(_REWARD_MODEL), "reward_model.micro_batch_size_per_gpu": _i(_REWARD_MODEL),
    "reward_model.max_length": _i(_REWARD_MODEL), "reward_model.use_dynamic_bsz": _i(_REWARD_MODEL),
    "reward_model.forward_max_token_len_per_gpu": _i(_REWARD_MODEL),
    "reward_model.sandbox_fusion.url": _i("packrl's rewards run in process", (None,), "register a reward that calls the sandbox"),
    "reward_model.sandbox_fusion.max_concurrent": _i("read only with sandbox_fusion.url"),
    "reward_model.sandbox_fusion.memory_limit_mb": _i("read only with sandbox_fusion.url"),
    "reward_model.reward_kwargs.max_resp_len": _r(_OVERLONG, "_reward", "must equal data.max_response_length"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": _r(_OVERLONG, "_reward", "False -> 0"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": _r(_OVERLONG, "_reward"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": _r("reward.shaping.overlong.penalty_factor", "_reward"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": _i("packrl always logs the overlong penalty"),
    "reward.reward_kwargs.max_resp_len": _r(_OVERLONG, "_reward", "must equal data.max_response_length"),
    "reward.reward_kwargs.overlong_buffer_cfg.enable": _r(_OVERLONG, "_reward", "False -> 0 (verl 0.9 spelling)"),
    "reward.reward_kwargs.overlong_buffer_cfg.len": _r(_OVERLONG, "_reward"),
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": _r("reward.shaping.overlong.penalty_factor", "_reward"),
    "reward.reward_kwargs.overlong_buffer_cfg.log": _i("packrl always logs the overlong penalty"),
    "reward_model.overlong_buffer.enable": _r(_OVERLONG, "_reward", "False -> 0 (DAPO recipe spelling)"),
    "reward_model.overlong_buffer.len": _r(_OVERLONG, "_reward"),
    "reward_model.overlong_buffer.penalty_factor": _r("reward.shaping.overlong.penalty_factor", "_reward"),
    "reward_model.overlong_buffer.log": _i("packrl always logs the overlong penalty"),
    "custom_reward_function.path": _i("packrl's rewards are registered functions", (None,),
                                      "register the function with @packrl.registry.REWARDS.register in a file and run packrl train "
                                      "with trainer.plugins=[file.py] reward.name=<name>"),
    "custom_reward_function.name": _i("read only with custom_reward_function.path"),
    "reward.custom_reward_function.path": _i("packrl's rewards are registered functions", (None,),
                                             "register the function with @packrl.registry.REWARDS.register in a file and run "
                                             "packrl train with trainer.plugins=[file.py] reward.name=<name>"),
    "reward.custom_reward_function.name": _i("read only with reward.custom_reward_function.path"),
    "reward.sandbox_fusion.url": _i("packrl's rewards run in process", (None,), "register a reward that calls the sandbox"),
}

_ALGORITHM = {
    "algorithm.gamma": _r("algorithm.gamma", "_gae"),
    "algorithm.lam": _r("algorithm.lam", "_gae"),
    "algorithm.adv_estimator": _x("algorithm.adv_estimator", cv.estimator,
                                  "gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline"),
    "algorithm.gdpo_reward_keys": _i("read only by verl's adv_estimator=gdpo, which packrl does not have"),
    "algorithm.gdpo_reward_weights": _i("read only by verl's adv_estimator=gdpo, which packrl does not have"),
    "algorithm.norm_adv_by_std_in_grpo": _x("algorithm.norm_adv_by_std", cv.as_bool),
    "algorithm.use_kl_in_reward": _r("algorithm.kl_in_reward, algorithm.kl_coef", "_kl"),
    "algorithm.kl_penalty": _r("algorithm.kl_estimator", "_kl", "kl -> k1, mse -> k2, low_var_kl -> k3 (with use_kl_in_reward)"),
    "algorithm.kl_ctrl.type": _i("packrl's KL weight is fixed", ("fixed",), "set algorithm.kl_ctrl.type=fixed"),
    "algorithm.kl_ctrl.kl_coef": _r("algorithm.kl_coef", "_kl", "with use_kl_in_reward"),
    "algorithm.kl_ctrl.horizon": _i("read only by the adaptive KL controller"),
    "algorithm.kl_ctrl.target_kl": _i("read only by the adaptive KL controller"),
    "algorithm.use_pf_ppo": _i("packrl has no preference-feedback PPO", (False,), "remove algorithm.use_pf_ppo"),
    "algorithm.pf_ppo.reweight_method": _i("read only with use_pf_ppo"), "algorithm.pf_ppo.weight_pow": _i("read only with use_pf_ppo"),
    "algorithm.filter_groups.enable": _r("algorithm.filters.dynamic_sampling.metric", "_filter_groups"),
    "algorithm.filter_groups.metric": _r("algorithm.filters.dynamic_sampling.metric", "_filter_groups",
                                         "reward (verl 0.9's default) -> reward, acc/score -> score; seq_reward/seq_final_reward "
                                         "(verl <= 0.8) -> reward"),
    "algorithm.filter_groups.max_inflight_gen_batches": _i("rounds verl keeps in flight; packrl generates one round of "
                                                           "data.batch_size prompts at a time"),
    "algorithm.filter_groups.max_num_gen_batches": _r("algorithm.filters.dynamic_sampling.max_num_gen_batches", "_filter_groups",
                                                      "<= 0 (unlimited) is refused"),
    f"{_RC}.rollout_is": _r(f"{_RC}.rollout_is", "_rollout_correction", "token only"),
    f"{_RC}.rollout_is_threshold": _r(f"{_RC}.rollout_is_threshold", "_rollout_correction", "a number (TIS); IcePop's lower_upper "
                                      "is refused"),
    f"{_RC}.rollout_rs": _r(f"{_RC}.rollout_rs=geometric", "_rollout_correction",
                            "seq_mean_k1 (verl >= 0.7.1, decoupled_geo_rs) or geometric (verl <= 0.7.0) -> geometric"),
    f"{_RC}.rollout_rs_threshold": _r(f"{_RC}.rollout_rs_threshold, {_RC}.rollout_rs_threshold_lower", "_rollout_correction",
                                      "seq_mean_k1's lower_upper bounds the inverse ratio: packrl's [1/upper, 1/lower]; one "
                                      "number u = [1/u, u] in both; geometric's as is"),
    f"{_RC}.rollout_rs_threshold_lower": _r(f"{_RC}.rollout_rs_threshold_lower", "_rollout_correction", "verl <= 0.7.0, with geometric"),
    f"{_RC}.rollout_token_veto_threshold": _i("packrl has no token veto", (None,), "remove it (verl <= 0.7.0)"),
    f"{_RC}.bypass_mode": _i("packrl always recomputes the old log-probs (verl's decoupled mode); bypass mode trains against "
                             "the engine's log-probs", (False,), f"set {_RC}.bypass_mode=False"),
    f"{_RC}.loss_type": _i("read only with bypass_mode"),
    f"{_RC}.rollout_is_batch_normalize": _i("packrl's weights are not renormalised", (False,), "remove it"),
}

_TRAINER = {
    "trainer.balance_batch": _i("packrl always balances ranks by token workload (Karmarkar-Karp)"),
    "trainer.total_epochs": _r("train.total_steps", "_total_steps", "epochs x floor(rows / data.train_batch_size)"),
    "trainer.total_training_steps": _r("train.total_steps", "_total_steps"),
    "trainer.project_name": _i(_LOG), "trainer.experiment_name": _i(_LOG), "trainer.log_val_generations": _i(_LOG),
    "trainer.logger": _x("train.loggers", cv.loggers, "console, wandb, tensorboard, mlflow; others are dropped and named"),
    "trainer.rollout_data_dir": _x("train.dump_rollouts", cv.switch_on("dumps go to RUN_DIR/rollouts/step_N.jsonl"),
                                   "dumps go to RUN_DIR/rollouts/step_N.jsonl"),
    "trainer.validation_data_dir": _i("packrl records validation accuracy in metrics.jsonl"),
    "trainer.nnodes": _r("trainer.num_workers, trainer.ray_address", "_parallel",
                         "n_gpus_per_node x nnodes; several nodes join a running Ray cluster"),
    "trainer.n_gpus_per_node": _r("trainer.num_workers", "_parallel", "n_gpus_per_node x nnodes"),
    "trainer.save_freq": _x("train.save_every", cv.never_to_zero(" (packrl still saves after the last step)"),
                            "-1 -> 0 (packrl still saves after the last step)"),
    "trainer.test_freq": _x("train.val_every", cv.never_to_zero(), "-1 -> 0"),
    "trainer.esi_redundant_time": _i(_PERF),
    "trainer.resume_mode": _r("train.resume", "_resume", "auto -> auto (with trainer.default_local_dir), disable -> none"),
    "trainer.resume_from_path": _i("packrl resumes from its own checkpoints only", (None,),
                                   "start the run anew, or resume a packrl run with train.resume=<checkpoints/step_N>"),
    "trainer.resume_path": _i("packrl resumes from its own checkpoints only", (None,),
                              "start the run anew, or resume a packrl run with train.resume=<checkpoints/step_N>"),
    "trainer.val_before_train": _i("packrl validates every train.val_every steps and after the last step, not before the first"),
    "trainer.val_only": _i("packrl trains", (False,), "remove trainer.val_only"),
    "trainer.critic_warmup": _r("critic.warmup_steps", "_critic"),
    "trainer.default_hdfs_dir": _i("packrl writes local checkpoints only", (None,), "copy RUN_DIR/checkpoints yourself"),
    "trainer.del_local_ckpt_after_load": _i(_CHECKPOINT),
    "trainer.default_local_dir": _r("train.out_dir, train.resume", "_resume", "with resume_mode=auto: train.resume=auto"),
    "trainer.max_actor_ckpt_to_keep": _x("train.keep_last", cv.keep_last),
    "trainer.max_critic_ckpt_to_keep": _i("the critic is saved with the actor (train.keep_last)"),
    "trainer.ray_wait_register_center_timeout": _i(_PERF),
    "trainer.device": _i("packrl uses CUDA when present, else the CPU", ("cuda", "cpu"), "run on CUDA or CPU"),
    "trainer.use_legacy_worker_impl": _i("packrl has one worker implementation"),
    "trainer.use_v1": _i("packrl has one trainer"),
    "trainer.v1.trainer_mode": _x("trainer.rollout_mode", cv.trainer_mode, "sync -> sync; the asynchronous modes are refused"),
    "trainer.v1.sampler.custom_sampler.path": _i("packrl samples prompts in a seeded shuffled order", (None,),
                                                 "remove trainer.v1.sampler.custom_sampler.*"),
    "trainer.checkpoint_callback_class": _i("packrl calls no checkpoint callbacks", (None,), "remove trainer.checkpoint_callback_class"),
    "trainer.profile_steps": _i(_PROFILE), "trainer.profile_continuous_steps": _i(_PROFILE),
    "trainer.controller_nsight_options": _i(_PROFILE), "trainer.worker_nsight_options": _i(_PROFILE),
    "ray_kwargs.ray_init.num_cpus": _i("packrl reserves trainer.num_cpus_per_worker per worker"),
    "ray_kwargs.timeline_json_file": _x("train.trace", _TIMELINE, "a Ray timeline -> RUN_DIR/trace.json (spans per stage and micro-batch)"),
    "ray_init.num_cpus": _i("packrl reserves trainer.num_cpus_per_worker per worker"),
    "ray_init.timeline_json_file": _x("train.trace", _TIMELINE, "a Ray timeline -> RUN_DIR/trace.json (verl <= 0.5 spelling)"),
    "transfer_queue.enable": _i("packrl moves batches in process or through Ray (verl 0.9's v1 trainer turns it on itself)"),
    "distillation.enabled": _i("verl's on-policy distillation; packrl trains from rewards only", (False,),
                               "set distillation.enabled=False"),
    **{f"skip.{part}.enable": _i("verl's rollout cache for debugging; packrl generates every step", (False,),
                                 f"set skip.{part}.enable=False") for part in ("rollout", "rollout_tq", "async_rollout")},
    "model_engine": _i("verl's training backend (the model_engine group of ppo_trainer.yaml's defaults): packrl's workers are "
                       "its dp engine (FSDP); packrl has no Megatron, TorchTitan or VeOmni backend", ("dp",),
                       "leave model_engine out or set model_engine=dp (verl's default): packrl trains with FSDP2 over "
                       "trainer.num_workers ranks"),
    "actor_rollout_ref.hybrid_engine": _i("packrl's policy and engine always share the worker", (True,), "remove hybrid_engine"),
    "actor_rollout_ref.nccl_timeout": _x("trainer.collective_timeout_s", cv.as_float,
                                         "seconds a rank waits in one collective before it fails, as the script asks (default 600 "
                                         "in both); verl 0.9.1 declares it but never reads it: its workers start the process "
                                         "group with timeout_second=None (verl/workers/engine_workers.py:89)"),
}

VERL_KEYS: dict[str, KeyRule] = {**_DATA, **_MODEL, **_ACTOR, **_REF, **_ROLLOUT, **_CRITIC, **_REWARD, **_ALGORITHM, **_TRAINER}
"""Every verl key packrl knows (full names, ``actor_rollout_ref`` spelled out) -> its rule."""

FAMILIES: dict[str, KeyRule] = {
    f"{ROLLOUT}.engine_kwargs.vllm.": _r("rollout.engine_kwargs", "_vllm_args", "passed through to vLLM (with rollout.name=vllm)"),
    f"{ROLLOUT}.engine_kwargs.sglang.": _i("SGLang's engine arguments; packrl's engines are hf and vllm"),
    f"{ROLLOUT}.engine_kwargs.trtllm.": _i("TensorRT-LLM's engine arguments; packrl's engines are hf and vllm"),
    f"{ROLLOUT}.agent.custom_async_server.": _i("packrl's engine runs in the worker's process", (None,), "remove it"),
    f"{ACTOR}.fsdp_config.": _i(_FSDP),
    f"{AR}.ref.fsdp_config.": _i(_FSDP),
    "critic.model.fsdp_config.": _i(_FSDP), "critic.fsdp.": _i(_FSDP),
    f"{ACTOR}.qat.": _i("read only with actor.qat.enable"), f"{ACTOR}.fsdp_config.qat.": _i("read only with qat.enable"),
    f"{AR}.actor.router_replay.": _i(_ROUTER), f"{AR}.ref.router_replay.": _i(_ROUTER),
    f"{AR}.model.mtp.": _i(_MTP),
    "critic.model.mtp.": _i(_MTP), "critic.model.lora.": _i(_MEGATRON), "critic.model.tiled_mlp.": _i(_PERF),
    f"{ROLLOUT}.checkpoint_engine.": _i(_ENGINE), f"{ROLLOUT}.prometheus.": _i(_LOG),
    f"{ROLLOUT}.disaggregation.": _i("read only with rollout.disaggregation.enabled"),
    f"{ROLLOUT}.skip.": _i("read only with rollout.skip.enable"),
    "data.mm_processor_kwargs.": _i("packrl runs the model's processor with its own settings and sizes images to the budgets",
                                    (None,), "remove data.mm_processor_kwargs.*"),
    "trainer.v1.": _i("settings of verl's asynchronous trainer modes (refused) and of its sampler's refills and off-policy "
                      "limits; packrl's rollout modes bound staleness with rollout.max_staleness"),
    "reward_model.rollout.": _i(_REWARD_MODEL), "reward.reward_model.": _i(_REWARD_MODEL),
    "reward.reward_manager.module.": _i("read only with reward.reward_manager.source=importlib"),
    "reward_manager.module.": _i("read only with reward_manager.source=importlib"),
    "reward.reward_kwargs.": _i("a reward-manager argument packrl's rewards do not take"),
    "reward.sandbox_fusion.": _i("read only with sandbox_fusion.url"), "sandbox_fusion.": _i("read only with sandbox_fusion.url"),
    "distillation.": _i("read only with distillation.enabled"), "skip.": _i("read only with skip.*.enable"),
    "transfer_queue.": _i("packrl moves batches in process or through Ray"),
    "critic.model.override_config.": _i("the critic's config is the backbone's own", ANY),
    f"{AR}.model.override_config.": _i("packrl applies only rope_scaling to the model config", (None,),
                                       "remove it, or set model.rope_scaling.* through override_config.rope_scaling"),
    f"{AR}.model.lora.": _i(_MEGATRON + "; use actor_rollout_ref.model.lora_rank, lora_alpha, target_modules"),
    f"{AR}.actor.megatron.": _i(_MEGATRON), f"{AR}.ref.megatron.": _i(_MEGATRON), "critic.megatron.": _i(_MEGATRON),
    f"{AR}.actor.profiler.": _i(_PROFILE), f"{AR}.ref.profiler.": _i(_PROFILE), f"{AR}.rollout.profiler.": _i(_PROFILE),
    "critic.profiler.": _i(_PROFILE), "reward_model.profiler.": _i(_PROFILE), "global_profiler.": _i(_PROFILE),
    "reward_model.model.": _i(_REWARD_MODEL),
    "reward_model.reward_kwargs.": _i("a reward-manager argument packrl's rewards do not take"),
    "data.apply_chat_template_kwargs.": _i("packrl renders with the tokenizer's default template arguments", (None,),
                                           "write the template you need into the tokenizer's chat template"),
    "ray_kwargs.ray_init.runtime_env.": _i("packrl workers inherit this process's environment"),
    "hydra.": _i("a Hydra setting of verl's launcher"),
}
"""Free-form sub-trees (prefix ending in ``.``) -> their rule; the longest matching prefix wins."""

BEHAVIOUR: dict[str, str] = {
    "reward.score_truncated": "always true: verl scores responses a budget cut; packrl's rewards would give them 0",
    "train.max_tokens_per_microbatch": "no verl micro-batch setting: packrl's budget, at least one whole sequence",
    "train.max_tokens_per_logprob_microbatch": "no verl micro-batch setting: packrl's budget, at least one whole sequence",
}
"""packrl keys the translation may set with no verl key behind them (verl's behaviour rather than a
setting), and when; every other packrl key it sets is named by the rule of a verl key it came from."""


DEFAULTS: dict[str, Any] = {
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.train_batch_size": 1024,
    "data.filter_overlong_prompts": False, "data.truncation": "error", "data.shuffle": True, "data.val_max_samples": -1,
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet", "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    f"{ROLLOUT}.n": 1, f"{ROLLOUT}.temperature": 1.0, f"{ROLLOUT}.top_p": 1.0, f"{ROLLOUT}.top_k": -1,
    f"{ROLLOUT}.val_kwargs.do_sample": False, f"{ROLLOUT}.val_kwargs.temperature": 0.0,
    f"{ROLLOUT}.multi_turn.enable": False, f"{ROLLOUT}.calculate_log_probs": True,
    f"{ACTOR}.ppo_mini_batch_size": 256, f"{ACTOR}.use_dynamic_bsz": False, f"{ACTOR}.ppo_max_token_len_per_gpu": 16384,
    f"{ACTOR}.clip_ratio": 0.2, f"{ACTOR}.clip_ratio_c": 3.0, f"{ACTOR}.loss_agg_mode": "token-mean", f"{ACTOR}.entropy_coeff": 0.0,
    f"{ACTOR}.use_kl_loss": False, f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl",
    f"{ACTOR}.ppo_epochs": 1, f"{ACTOR}.optim.lr": 1e-6, f"{ACTOR}.optim.lr_warmup_steps": -1,
    f"{ACTOR}.optim.lr_warmup_steps_ratio": 0.0, f"{ACTOR}.optim.weight_decay": 0.01, f"{ACTOR}.grad_clip": 1.0,
    f"{ACTOR}.ulysses_sequence_parallel_size": 1, f"{ACTOR}.policy_loss.loss_mode": "vanilla",
    f"{AR}.model.lora_rank": 0, f"{AR}.model.lora_alpha": 16, f"{AR}.model.target_modules": "all-linear",
    "algorithm.adv_estimator": "gae", "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.filter_groups.enable": False,
    "algorithm.filter_groups.max_num_gen_batches": 0, "algorithm.filter_groups.metric": "reward",
    "critic.optim.lr": 1e-5, "critic.cliprange_value": 0.5, "critic.grad_clip": 1.0, "critic.ppo_max_token_len_per_gpu": 32768,
    "trainer.total_epochs": 30, "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1, "trainer.save_freq": -1,
    "trainer.test_freq": -1, "trainer.critic_warmup": 0, "trainer.resume_mode": "auto",
    "trainer.v1.trainer_mode": "sync", "reward.reward_manager.name": "naive",
}
"""verl 0.9.1's defaults (``ppo_trainer.yaml`` and the files it includes) for the keys the translation reads."""


def rule_of(key: str) -> KeyRule | None:
    """The rule of verl key ``key`` (exact keys first, then the longest family prefix), or None
    when verl has no such key."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    prefixes = [p for p in FAMILIES if key.startswith(p) or key == p.rstrip(".")]
    return FAMILIES[max(prefixes, key=len)] if prefixes else None


def nearest_key(key: str) -> str | None:
    """The known verl key (or family) nearest to ``key`` by meaning, then spelling
    (`packrl.compat.verl.nearest.nearest`), for the error on a misspelled key; None when none is near."""
    return nearest(key, [*VERL_KEYS, *(p.rstrip(".") for p in FAMILIES)])
