"""The relational conversions: packrl keys that need several verl keys at once.

Everything a verl key maps to by itself is applied from the key table (`KeyRule.convert`); the
functions here are the ones `KeyRule.by` names: a value chosen between two spellings
(``optim.clip_grad`` over ``grad_clip``), a unit that needs other keys (a micro-batch of m
sequences is m x (prompt + response) tokens, epochs are steps only with the row count), a key
that acts only when another enables it (LoRA, the critic, filter groups, KL), and checks that two
verl keys agree where packrl has one setting. `STEPS` runs them in order; each takes the
`Context` and sets, ignores or refuses keys through it. The sources are verl's
``ppo_trainer.yaml`` and its trainer (``ray_trainer.py``, ``fsdp_workers.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from packrl.compat.verl.context import Context, preset_value
from packrl.compat.verl.convert import KL_ESTIMATORS, Refused, files, geometric_bounds
from packrl.compat.verl.keys import ACTOR, AR, REF, ROLLOUT, VLLM_PASSED, rule_of
from packrl.compat.verl.overrides import format_value


def _total_steps(c: Context) -> None:
    """``trainer.total_training_steps``, else epochs x whole batches of the training rows
    (verl's dataloader drops the last partial batch)."""
    if c.get("trainer.total_training_steps") is not None:
        c.total_steps = c.int("trainer.total_training_steps")
        c.set("train.total_steps", c.total_steps, "trainer.total_training_steps")
        c.ignore("trainer.total_epochs", "verl runs trainer.total_training_steps when it is set")
        return
    epochs, batch, num_train_rows = c.int("trainer.total_epochs"), _batch_size(c), c.num_train_rows
    if batch is None:
        return
    if epochs < 1:
        c.refuse("trainer.total_epochs", "must be at least 1", "set trainer.total_epochs >= 1 or trainer.total_training_steps",
                 value=epochs)
        return
    if num_train_rows is None:
        names = files(c.get("data.train_files"))
        missing = [name for name in names if "://" not in name and not Path(name).exists()]
        why = f"but these files do not exist: {', '.join(missing)}" if missing else (
            f"which could not be counted from data.train_files={', '.join(names)} (local .parquet, .jsonl or .json files are counted)")
        c.refuse("trainer.total_epochs", f"needs the number of training rows, {why}",
                 "point data.train_files at existing files, or set trainer.total_training_steps", value=epochs)
        return
    if num_train_rows == 0:
        c.refuse("trainer.total_epochs", "needs training rows, and data.train_files holds none (an empty list or empty files)",
                 "point data.train_files at GSM8K parquet files (packrl data gsm8k writes them)", value=epochs)
        return
    steps = epochs * (num_train_rows // batch)
    if steps < 1:
        c.refuse("trainer.total_epochs", f"gives {steps} steps: {num_train_rows:,} rows hold no full batch of "
                 f"data.train_batch_size={batch:,} prompts", "lower data.train_batch_size or set trainer.total_training_steps",
                 value=epochs)
        return
    c.total_steps = steps
    c.set("train.total_steps", steps, "trainer.total_epochs", "data.train_batch_size",
          conversion=f"{epochs} epochs x floor({num_train_rows:,} rows / {batch:,} prompts) = {steps:,} steps "
                     "(rows counted before overlong filtering)")


def _batch_size(c: Context) -> int | None:
    """``data.train_batch_size``, or None (refused) when it is below 1."""
    batch = c.int("data.train_batch_size")
    if batch < 1:
        c.refuse("data.train_batch_size", "must be at least 1 prompt per step", "set data.train_batch_size to a positive integer",
                 value=batch)
        return None
    return batch


def _resume(c: Context) -> None:
    """``trainer.default_local_dir`` -> ``train.out_dir``; ``resume_mode=auto`` resumes there."""
    if c.get("trainer.default_local_dir") is not None:
        c.set("train.out_dir", str(c.get("trainer.default_local_dir")), "trainer.default_local_dir")
    mode = c.get("trainer.resume_mode")
    if mode == "auto" and c.get("trainer.default_local_dir") is not None:
        c.set("train.resume", "auto", "trainer.resume_mode", "trainer.default_local_dir")
    elif mode in ("auto", "disable"):
        c.ignore("trainer.resume_mode", "without trainer.default_local_dir the run starts in a new RUN_DIR" if mode == "auto"
                 else "a fresh run, as packrl's default")
    else:
        c.refuse("trainer.resume_mode", "packrl resumes from its own checkpoints only (verl's cannot be read)",
                 "set trainer.resume_mode=auto with trainer.default_local_dir set to a packrl RUN_DIR, or disable")


def _val_files(c: Context) -> None:
    """``data.val_files`` when given, or when validation runs (``trainer.test_freq > 0``) on verl's default."""
    if c.has("data.val_files") or c.int("trainer.test_freq") > 0:
        c.set("data.val_files", files(c.get("data.val_files")), "data.val_files")


def _lengths(c: Context) -> None:
    """The prompt and response budgets: ``data.max_*_length`` or ``rollout.*_length``, which must agree."""
    for verl_key, rollout_key, key in (("data.max_prompt_length", f"{ROLLOUT}.prompt_length", "data.max_prompt_tokens"),
                                       ("data.max_response_length", f"{ROLLOUT}.response_length", "rollout.max_response_tokens")):
        if c.has(rollout_key) and c.get(rollout_key) != c.get(verl_key):
            c.refuse(rollout_key, f"differs from {verl_key}={c.get(verl_key)}; packrl has one budget for both",
                     f"set {rollout_key} and {verl_key} to the same number of tokens")
        c.set(key, c.int(rollout_key if c.has(rollout_key) else verl_key), verl_key, rollout_key)
    c.longest = sum(c.int(f"{ROLLOUT}.{r}_length" if c.has(f"{ROLLOUT}.{r}_length") else f"data.max_{r}_length")
                    for r in ("prompt", "response"))


def _overlong_prompt(c: Context) -> None:
    """``data.filter_overlong_prompts`` first, else ``data.truncation`` -> ``data.overlong_prompt``."""
    if c.get("data.filter_overlong_prompts"):
        c.set("data.overlong_prompt", "filter", "data.filter_overlong_prompts")
        c.ignore("data.truncation", "verl filters overlong prompts first (data.filter_overlong_prompts=True), nothing is left to cut")
        return
    mode = c.get("data.truncation")
    if mode not in ("left", "right", "middle", "error"):
        c.refuse("data.truncation", "must be left, right, middle or error", "set data.truncation=error")
        return
    c.set("data.overlong_prompt", mode, "data.filter_overlong_prompts", "data.truncation",
          conversion="" if mode == "error" else f"{mode}: packrl shortens the last user message's text (verl <= 0.6 cut token ids)")


def _rope(c: Context) -> None:
    """``rope_scaling.type`` (or its newer spelling ``rope_type``; ``type`` wins) -> ``model.rope_scaling.type``."""
    rope = f"{AR}.model.override_config.rope_scaling"
    kind_key = f"{rope}.type" if c.has(f"{rope}.type") else f"{rope}.rope_type"
    if not c.has(kind_key):
        return
    kind = c.get(kind_key)
    if kind in ("linear", "dynamic", "yarn"):
        c.set("model.rope_scaling.type", kind, kind_key)
    else:
        c.refuse(kind_key, "packrl applies linear, dynamic or yarn RoPE scaling", f"set {kind_key}=yarn (or linear, dynamic)")


def _lora(c: Context) -> None:
    """``lora_rank > 0`` turns LoRA on; then alpha (verl's default 16) and the target modules."""
    lora = [f"{AR}.model.lora_rank", f"{AR}.model.lora_alpha", f"{AR}.model.target_modules"]
    rank = c.int(lora[0]) if c.get(lora[0]) is not None else 0
    if not c.ignore_unless(rank > 0, lora, "no effect: actor_rollout_ref.model.lora_rank=0 (full fine-tuning)"):
        return
    c.set("model.lora.rank", rank, lora[0])
    c.set("model.lora.alpha", c.float(lora[1]), lora[1])
    targets = c.get(lora[2])
    if isinstance(targets, (str, list)):
        modules = [m.strip() for m in targets.split(",")] if isinstance(targets, str) else [str(m) for m in targets]
        c.set("model.lora.target_modules", modules, lora[2])
    else:
        c.refuse(lora[2], "must be all-linear or a list of module names", f"set {lora[2]}=all-linear (or [q_proj,v_proj])")


def _offload(c: Context) -> None:
    """The actor's FSDP offload settings -> packrl's one switch, which also covers the reference
    and the critic (their own verl settings are named)."""
    keys = [f"{ACTOR}.fsdp_config.{name}" for name in ("param_offload", "optimizer_offload", "offload_policy")]
    on = any(bool(c.get(k)) for k in keys)
    c.set("model.param_offload", on, *keys, conversion="parameters, gradients and optimizer states of the policy, reference "
          "and critic stay in host memory (FSDP2 CPUOffloadPolicy; verl's param_offload/optimizer_offload move them between "
          "phases instead)" if on else "")
    critic = [f"critic.{fsdp}.{name}" for fsdp in ("fsdp", "model.fsdp_config") for name in ("param_offload", "optimizer_offload")]
    for key in (f"{REF}.fsdp_config.param_offload", *critic):
        c.ignore(key, f"packrl offloads the reference and the critic with the policy: model.param_offload={format_value(on)}, "
                 f"from {ACTOR}.fsdp_config")


def _parallel(c: Context) -> None:
    """GPUs per node x nodes -> workers; the actor's Ulysses size (either spelling, and the
    reference's, must agree) -> ``trainer.sequence_parallel_size``."""
    gpus, nodes = c.int("trainer.n_gpus_per_node"), c.int("trainer.nnodes")
    c.set("trainer.num_workers", gpus * nodes, "trainer.n_gpus_per_node", "trainer.nnodes",
          conversion=f"{gpus} GPUs per node x {nodes} node(s)" if nodes > 1 else "")
    if nodes > 1:
        c.set("trainer.ray_address", "auto", "trainer.nnodes", conversion="several nodes: join the running Ray cluster")
    spellings = [f"{ACTOR}.ulysses_sequence_parallel_size", f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size"]
    sizes = {c.int(k) for k in spellings if c.has(k)}
    if len(sizes) > 1:
        c.refuse(spellings[1], f"differs from {spellings[0]}={c.get(spellings[0])}", "give one sequence-parallel size")
    sp = c.sequence_parallel = sizes.pop() if sizes else 1
    c.set("trainer.sequence_parallel_size", sp, *spellings)
    ref = f"{REF}.ulysses_sequence_parallel_size"
    if c.has(ref) and c.int(ref) != sp:
        c.refuse(ref, f"differs from the actor's sequence-parallel size {sp}; packrl's reference runs with the actor", f"set {ref}={sp}")
    c.ignore(ref, "the reference runs with the actor's trainer.sequence_parallel_size")


Budget = tuple[int | None, tuple[str, ...], str]
"""(tokens per rank or None, the verl keys used, the conversion)."""


def _token_budget(c: Context, *, dynamic: str, tokens: str, micro: tuple[str, str], dynamic_default: bool,
                  tokens_default: int) -> Budget:
    """One verl micro-batch setting -> ``(tokens per rank, verl keys used, conversion)``.

    With ``use_dynamic_bsz`` the token budget carries over (both are per GPU, a pack holds that
    x the sequence-parallel size); otherwise a micro-batch of m sequences holds at most
    m x (P + R) tokens, split over the sequence-parallel ranks. None = nothing set (verl
    would stop).
    """
    total, per_gpu = micro
    if bool(c.get(dynamic, dynamic_default)):
        for k in micro:
            c.ignore(k, f"verl reads micro-batch sizes only with {dynamic.rsplit('.', 1)[-1]}=False")
        value = c.int(tokens, tokens_default)
        return value, (dynamic, tokens), "" if c.has(tokens) else f"verl's default {tokens_default:,} tokens per GPU"
    c.ignore(tokens, f"verl reads it only with {dynamic.rsplit('.', 1)[-1]}=True")
    longest, sp = c.longest, c.sequence_parallel
    ranks = c.int("trainer.n_gpus_per_node") * c.int("trainer.nnodes")
    if c.get(per_gpu) is not None:
        m, used, how = c.int(per_gpu), (dynamic, per_gpu), ""
    elif c.get(total) is not None:
        m, used = max(1, c.int(total) // max(1, ranks // sp)), (dynamic, total)
        how = f"{c.get(total)} sequences over {ranks // sp} data-parallel ranks = {m} per GPU; "
    else:
        return None, (), ""
    value = math.ceil(m * longest / sp)
    how += f"{m} sequences x (max_prompt_length + max_response_length = {longest:,}) tokens"
    return value, used, how + (f" / {sp} sequence-parallel ranks" if sp > 1 else "") + f" = {value:,} tokens"


def _budgets(c: Context) -> None:
    """The actor's micro-batch setting -> ``train.max_tokens_per_microbatch``; the rollout's and
    the reference's log-prob settings (defaulting to the actor's) -> the one log-prob budget."""
    dyn, toks = bool(c.get(f"{ACTOR}.use_dynamic_bsz")), c.int(f"{ACTOR}.ppo_max_token_len_per_gpu")
    update = _token_budget(c, dynamic=f"{ACTOR}.use_dynamic_bsz", tokens=f"{ACTOR}.ppo_max_token_len_per_gpu",
                           micro=(f"{ACTOR}.ppo_micro_batch_size", f"{ACTOR}.ppo_micro_batch_size_per_gpu"),
                           dynamic_default=False, tokens_default=16384)
    logprob = [_token_budget(c, dynamic=f"{role}.log_prob_use_dynamic_bsz", tokens=f"{role}.log_prob_max_token_len_per_gpu",
                             micro=(f"{role}.log_prob_micro_batch_size", f"{role}.log_prob_micro_batch_size_per_gpu"),
                             dynamic_default=dyn, tokens_default=toks)
               for role in (ROLLOUT, REF)]
    for key, (value, used, how) in (("train.max_tokens_per_microbatch", update),
                                    ("train.max_tokens_per_logprob_microbatch", _smaller(logprob))):
        if value is None:
            floor = math.ceil(c.longest / c.sequence_parallel)
            value = max(int(preset_value(key)), floor)
            how = "no verl micro-batch setting: packrl's budget, at least one whole sequence"
        c.set(key, value, *used, conversion=how)


def _smaller(budgets: list[Budget]) -> Budget:
    """The old-log-prob (rollout) and reference budgets as packrl's one log-prob budget: the smaller."""
    known = [b for b in budgets if b[0] is not None]
    if not known:
        return None, (), ""
    if len(known) == 2 and known[0][0] != known[1][0]:
        low = min(known, key=lambda b: b[0] or 0)
        return low[0], known[0][1] + known[1][1], f"{low[2] or low[0]}; packrl has one log-prob budget: the smaller of rollout's and ref's"
    return known[0][0], tuple(k for b in known for k in b[1]), known[0][2]


def _gae(c: Context) -> None:
    """``algorithm.gamma`` (read by gae and reinforce_plus_plus) and ``lam`` (gae only)."""
    estimator = c.get("algorithm.adv_estimator")
    for key, readers in (("algorithm.gamma", ("gae", "reinforce_plus_plus")), ("algorithm.lam", ("gae",))):
        read = c.ignore_unless(estimator in readers, [key], f"read only by {' and '.join(readers)} (algorithm.adv_estimator={estimator})")
        if read and c.has(key):
            c.set(key, c.float(key), key)


def _filter_groups(c: Context) -> None:
    """DAPO's dynamic sampling: the metric, and the cap in rounds of ``data.gen_batch_size``
    prompts as rounds of ``data.batch_size`` (the same prompt cap)."""
    prefix, ours = "algorithm.filter_groups", "algorithm.filters.dynamic_sampling"
    keys = [f"{prefix}.metric", f"{prefix}.max_num_gen_batches", "data.gen_batch_size"]
    if not c.ignore_unless(bool(c.get(f"{prefix}.enable")), keys, f"no effect: {prefix}.enable=False"):
        return
    metric = c.get(f"{prefix}.metric")
    if metric in ("acc", "score"):
        c.set(f"{ours}.metric", "score", f"{prefix}.enable", f"{prefix}.metric", conversion=f"{metric}: the reward function's score")
    elif metric in ("reward", "seq_reward", "seq_final_reward"):
        c.set(f"{ours}.metric", "reward", f"{prefix}.enable", f"{prefix}.metric",
              conversion=f"{metric}: the score plus shaping, before in-reward KL")
    else:
        c.refuse(f"{prefix}.metric", "packrl filters on the score (verl's acc) or the reward (verl's reward)",
                 f"set {prefix}.metric=reward")
    rounds, batch = c.int(f"{prefix}.max_num_gen_batches"), _batch_size(c)
    if batch is None:
        return
    if rounds <= 0:
        given = "" if c.has(f"{prefix}.max_num_gen_batches") else " (verl default, not set by the script)"
        c.refuse(f"{prefix}.max_num_gen_batches", f"<= 0 means unlimited rounds in verl{given}; packrl needs a cap (then trains on "
                 "the groups kept, with a warning)", f"set {prefix}.max_num_gen_batches=10", value=rounds)
        return
    gen = c.int("data.gen_batch_size") if c.get("data.gen_batch_size") is not None else batch
    capped = math.ceil(rounds * gen / batch)
    c.set(f"{ours}.max_num_gen_batches", capped, f"{prefix}.max_num_gen_batches", "data.gen_batch_size",
          conversion="" if gen == batch else f"{rounds} rounds of {gen:,} prompts -> {capped} rounds of data.batch_size={batch:,} "
          "(the same prompt cap)")


def _rollout_correction(c: Context) -> None:
    """Token-level importance weights (``rollout_is``, or the older ``actor.tis_imp_ratio_cap``)
    and geometric-mean rejection (`_geometric_rejection`); verl's other modes are refused."""
    p = "algorithm.rollout_correction"
    level, cap_key = c.get(f"{p}.rollout_is"), f"{ACTOR}.tis_imp_ratio_cap"
    if level is None and c.get(cap_key) is not None and c.float(cap_key) > 0:
        c.set(f"{p}.rollout_is", "token", cap_key, conversion="tis_imp_ratio_cap > 0 turns token TIS on")
        c.set(f"{p}.rollout_is_threshold", c.float(cap_key), cap_key)
    elif level is not None and level != "token":
        c.refuse(f"{p}.rollout_is", "packrl weights tokens only (verl's sequence level multiplies every token's ratio)",
                 f"set {p}.rollout_is=token")
    elif c.ignore_unless(level == "token", [f"{p}.rollout_is_threshold", cap_key], f"no effect: {p}.rollout_is is null"):
        c.set(f"{p}.rollout_is", "token", f"{p}.rollout_is")
        threshold = c.get(f"{p}.rollout_is_threshold")
        if isinstance(threshold, str) and "_" in threshold:
            c.refuse(f"{p}.rollout_is_threshold", "lower_upper is verl's IcePop (weights outside the window set to 0); packrl "
                     "truncates weights at one upper bound", f"set {p}.rollout_is_threshold=2.0")
        elif c.has(f"{p}.rollout_is_threshold"):
            c.set(f"{p}.rollout_is_threshold", c.float(f"{p}.rollout_is_threshold"), f"{p}.rollout_is_threshold")
        c.ignore(cap_key, f"superseded by {p}.rollout_is")
    _geometric_rejection(c)


def _geometric_rejection(c: Context) -> None:
    """``rollout_rs`` -> packrl's geometric-mean rejection: verl >= 0.7.1's ``seq_mean_k1`` (the
    ``decoupled_geo_rs`` preset; its threshold bounds the inverse ratio, `convert.geometric_bounds`)
    or verl <= 0.7.0's ``geometric`` (the bounds as packrl's, with ``rollout_rs_threshold_lower``)."""
    p = "algorithm.rollout_correction"
    rs, upper_key, lower_key = c.get(f"{p}.rollout_rs"), f"{p}.rollout_rs_threshold", f"{p}.rollout_rs_threshold_lower"
    if rs is not None and rs not in ("seq_mean_k1", "geometric"):
        c.refuse(f"{p}.rollout_rs", "packrl rejects by the geometric-mean ratio only (verl's seq_mean_k1; the other k1/k2/k3 "
                 "criteria and comma-separated lists are not offered)", f"set {p}.rollout_rs=seq_mean_k1")
        return
    if not c.ignore_unless(rs is not None, [upper_key, lower_key], f"no effect: {p}.rollout_rs is null"):
        return
    c.set(f"{p}.rollout_rs", "geometric", f"{p}.rollout_rs", conversion="seq_mean_k1 -> geometric" if rs == "seq_mean_k1" else "")
    if c.get(upper_key) is None:
        c.refuse(upper_key, f"is needed with {p}.rollout_rs={rs} (verl stops without it)", f"set {upper_key}='0.999_1.001'")
    elif rs == "geometric":
        for key in (upper_key, lower_key):
            if c.get(key) is not None:
                c.set(key, c.float(key), key)
    else:
        c.ignore(lower_key, f"verl <= 0.7.0's key; with {p}.rollout_rs=seq_mean_k1 the bounds are {upper_key}'s lower_upper")
        try:
            upper, lower = geometric_bounds(c.get(upper_key))
        except Refused as refused:
            c.refuse(upper_key, refused.message, refused.fix.format(key=upper_key))
            return
        if lower is None:
            c.set(upper_key, upper, upper_key, conversion=f"[1/{upper!r}, {upper!r}] in both")
            return
        low_text, high_text = str(c.get(upper_key)).strip().split("_", 1)
        inverse = f"seq_mean_k1 bounds 1/rho to [{low_text}, {high_text}], so rho"
        c.set(upper_key, upper, upper_key, conversion=f"{inverse} <= 1/{low_text} = {upper!r}")
        c.set(lower_key, lower, upper_key, conversion=f"{inverse} >= 1/{high_text} = {lower!r}")


def _clip_ratio(c: Context) -> None:
    """``clip_ratio_low``/``high``, each falling back to ``clip_ratio`` (verl reads it where they are
    null); the dual clip ``clip_ratio_c``, which verl's vanilla loss always applies (its default
    3.0 included, asserted > 1), under ``loss_mode=vanilla`` only (verl's other losses do not read it)."""
    base = f"{ACTOR}.clip_ratio"
    for side in ("low", "high"):
        key = f"{base}_{side}"
        source = key if c.has(key) else base
        fallback = f"clip_ratio -> both bounds (verl reads it where clip_ratio_{side} is null)"
        c.set(f"algorithm.clip_ratio_{side}", c.float(source), source, conversion="" if c.has(key) or not c.has(base) else fallback)
    dual, mode = f"{base}_c", c.get(f"{ACTOR}.policy_loss.loss_mode")
    if not c.ignore_unless(mode == "vanilla", [dual], f"read only by loss_mode=vanilla ({ACTOR}.policy_loss.loss_mode={mode})"):
        return
    bound = c.float(dual)
    if not 1.0 < bound < math.inf:
        c.refuse(dual, "must be a finite number > 1 (verl asserts clip_ratio_c > 1)", f"set {dual}=3.0", value=c.get(dual))
        return
    c.set("algorithm.policy_loss_args.clip_ratio_c", bound, dual,
          conversion="" if c.has(dual) else "verl's dual clip is on in every vanilla-loss run")


_COV_KEYS = {"clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"), "kl_cov": ("kl_cov_ratio", "ppo_kl_coef")}
"""verl's ``actor.policy_loss.*`` keys each of its covariance losses reads (packrl's options of the
same names, `packrl.algos.cov_losses`)."""


def _cov_losses(c: Context) -> None:
    """Clip-Cov's and KL-Cov's knobs, read only under their own ``policy_loss.loss_mode``; they
    become ``algorithm.policy_loss_args.*``."""
    mode_key = f"{ACTOR}.policy_loss.loss_mode"
    mode = c.get(mode_key)
    for loss, names in _COV_KEYS.items():
        keys = [f"{ACTOR}.policy_loss.{n}" for n in names]
        if c.ignore_unless(mode == loss, keys, f"read only by loss_mode={loss} ({mode_key}={mode})"):
            for verl_key, name in zip(keys, names):
                if c.has(verl_key):
                    c.set(f"algorithm.policy_loss_args.{name}", c.float(verl_key), verl_key)


def _kl(c: Context) -> None:
    """verl's two KL places (the loss: ``actor.use_kl_loss``; the reward: ``algorithm.use_kl_in_reward``)
    -> packrl's one KL term: its weight, estimator and place; both at once is refused."""
    in_loss, in_reward = bool(c.get(f"{ACTOR}.use_kl_loss")), bool(c.get("algorithm.use_kl_in_reward"))
    loss_keys = [f"{ACTOR}.kl_loss_coef", f"{ACTOR}.kl_loss_type"]
    reward_keys = ["algorithm.kl_ctrl.kl_coef", "algorithm.kl_penalty"]
    if in_loss and in_reward:
        c.refuse("algorithm.use_kl_in_reward", f"packrl has one KL term; {ACTOR}.use_kl_loss=True also asks for one in the loss",
                 f"keep one: {ACTOR}.use_kl_loss=True or algorithm.use_kl_in_reward=True")
        return
    c.ignore_unless(in_loss, loss_keys, f"no effect: {ACTOR}.use_kl_loss=False")
    c.ignore_unless(in_reward, reward_keys, "no effect: algorithm.use_kl_in_reward=False")
    c.set("algorithm.kl_in_reward", in_reward, "algorithm.use_kl_in_reward")
    if not (in_loss or in_reward):
        c.set("algorithm.kl_coef", 0.0, f"{ACTOR}.use_kl_loss", conversion="no KL: no reference model")
        return
    switch, (coef_key, type_key) = (f"{ACTOR}.use_kl_loss", loss_keys) if in_loss else ("algorithm.use_kl_in_reward", reward_keys)
    kind = str(c.get(type_key))
    if kind not in KL_ESTIMATORS:
        c.refuse(type_key, f"has no packrl KL estimator (packrl: k1, k2, k3; verl: {', '.join(KL_ESTIMATORS)})",
                 f"set {type_key}=low_var_kl (k3), kl (k1) or mse (k2)")
        return
    c.set("algorithm.kl_coef", c.float(coef_key), switch, coef_key)
    estimator = KL_ESTIMATORS[kind]
    c.set("algorithm.kl_estimator", estimator, type_key, conversion=f"{kind} -> {estimator}" if kind != estimator else "")


def _grad_clip(c: Context) -> None:
    """``optim.clip_grad`` (verl >= 0.5) over the older ``actor.grad_clip``."""
    clip = f"{ACTOR}.optim.clip_grad" if c.has(f"{ACTOR}.optim.clip_grad") else f"{ACTOR}.grad_clip"
    c.set("train.grad_clip", c.float(clip), clip)


def _warmup(c: Context) -> None:
    """verl's warmup in training steps (``lr_warmup_steps`` when > 0, else int(``lr_warmup_steps_ratio``
    x the run's steps): verl 0.9.1's FSDP engine) -> ``train.warmup_steps`` in optimizer steps:
    x (mini-batches per step x ``ppo_epochs``), so the warmup ends after the same training step.
    verl steps its schedule once per training step (lr x t / W in step t, 0 in the first);
    packrl ramps per optimizer step, lr x (s + 1) / W'."""
    steps_key, ratio_key = f"{ACTOR}.optim.lr_warmup_steps", f"{ACTOR}.optim.lr_warmup_steps_ratio"
    used: tuple[str, ...]
    if c.get(steps_key) is not None and c.int(steps_key) > 0:
        steps, used, how = c.int(steps_key), (steps_key,), ""
        c.ignore(ratio_key, f"verl reads the ratio only when {steps_key} <= 0")
    else:
        ratio, total = c.float(ratio_key), c.total_steps
        if total is None:
            return
        steps, used, how = int(ratio * total), (steps_key, ratio_key), f"int({ratio} x {total:,} steps) = {int(ratio * total):,} steps"
    batch, mini, epochs = c.int("data.train_batch_size"), c.int(f"{ACTOR}.ppo_mini_batch_size"), c.int(f"{ACTOR}.ppo_epochs")
    per_step = max(1, batch // max(1, mini)) * max(1, epochs)
    warmup = steps * per_step
    if steps and per_step > 1:
        how += ("; " if how else "") + (f"{steps:,} training steps x {per_step} optimizer steps each (data.train_batch_size / "
                                        f"ppo_mini_batch_size x ppo_epochs) = {warmup:,}")
    if steps and (c.get("algorithm.adv_estimator") == "gae" or c.get("critic.enable")):
        how += "; packrl's critic warms up with it (verl's critic.optim.lr_warmup_steps: none by default)"
    c.set("train.warmup_steps", warmup, *used, conversion=how)


def _val_temperature(c: Context) -> None:
    """Validation samples at ``val_kwargs.temperature`` only with ``do_sample=True`` and a
    temperature > 0; else greedy, and the conversion names which of the two made it greedy."""
    sample, temp = f"{ROLLOUT}.val_kwargs.do_sample", f"{ROLLOUT}.val_kwargs.temperature"
    do_sample, temperature = bool(c.get(sample)), c.float(temp)
    if do_sample and temperature > 0:
        c.set("rollout.val_temperature", temperature, sample, temp)
        return
    why = "do_sample=False" if not do_sample else f"temperature={format_value(c.get(temp))}"
    c.set("rollout.val_temperature", 0.0, sample, temp, conversion=f"{why}: greedy (0)")


def _vllm_args(c: Context) -> None:
    """vLLM engine arguments (``rollout.gpu_memory_utilization``, ``engine_kwargs.vllm.*``) ->
    ``rollout.engine_kwargs``, under ``rollout.name=vllm`` only; null ones are dropped, as verl does."""
    name = c.get(f"{ROLLOUT}.name")
    passed = [(f"{ROLLOUT}.{n}", n) for n in VLLM_PASSED]
    passed += [(k, k.rsplit(".", 1)[-1]) for k in c.given if k.startswith(f"{ROLLOUT}.engine_kwargs.vllm.")]
    for verl_key, arg in passed:
        if not c.ignore_unless(name == "vllm", [verl_key], f"a vLLM engine argument; {ROLLOUT}.name={name}"):
            continue
        if c.has(verl_key) and c.get(verl_key) is None:
            c.ignore(verl_key, "null: verl drops engine arguments set to null")
        elif c.has(verl_key):
            c.set(f"rollout.engine_kwargs.{arg}", c.get(verl_key), verl_key)


def _multi_turn(c: Context) -> None:
    """verl's tool loop -> packrl's multi-turn budgets. verl names its tools by class in a YAML
    file, packrl by registered name, so the switch itself is refused; its fix carries the
    mapped budgets for the packrl command."""
    p = f"{ROLLOUT}.multi_turn"
    keys = [f"{p}.max_assistant_turns", f"{p}.max_tool_response_length", f"{p}.tool_response_truncate_side", f"{p}.tool_config_path"]
    if not c.ignore_unless(bool(c.get(f"{p}.enable")), keys, f"no effect: {p}.enable=False"):
        return
    mapped = []
    if c.get(f"{p}.max_assistant_turns") is not None:
        mapped.append(f"rollout.multi_turn.max_turns={c.int(f'{p}.max_assistant_turns')}")
    if c.has(f"{p}.max_tool_response_length"):  # characters -> tokens: a token holds >= 1 character, so nothing verl keeps is cut
        mapped.append(f"rollout.multi_turn.max_tool_response_tokens={c.int(f'{p}.max_tool_response_length')}")
    side = c.get(f"{p}.tool_response_truncate_side")
    if side is not None:  # verl's left keeps the head (packrl's right), its right keeps the tail
        swapped = {"left": "right", "right": "left"}.get(str(side), "middle")
        mapped.append(f"rollout.multi_turn.tool_response_truncation_side={swapped}")
    c.handled.update(keys)
    c.refuse(f"{p}.enable", f"packrl's tools are registered functions; verl's tool classes ({p}.tool_config_path="
             f"{c.get(f'{p}.tool_config_path')}) cannot be loaded",
             f"drop {p}.* from the verl command and add rollout.multi_turn.tools=[calculator] (or a tool registered in a "
             f"trainer.plugins file) {' '.join(mapped)} to the packrl train command `packrl verl --dry-run` prints")


def _critic(c: Context) -> None:
    """The critic's keys, read only when the run has one (``critic.enable``, else gae); the ones
    packrl's critic shares with the actor must equal the actor's."""
    estimator, enable = c.get("algorithm.adv_estimator"), c.get("critic.enable")
    enabled = bool(enable) if enable is not None else estimator == "gae"
    if estimator == "gae" and enable is False:
        c.refuse("critic.enable", "algorithm.adv_estimator=gae needs the critic's values", "set critic.enable=True or choose "
                 "another algorithm.adv_estimator")
    mapped = [k for k in c.given if (k.startswith("critic.") or k == "trainer.critic_warmup") and (rule := rule_of(k)) and rule.mapped]
    if not c.ignore_unless(enabled, mapped, f"no effect: the run has no critic (algorithm.adv_estimator={estimator})"):
        return
    if enable is not None:
        c.set("critic.enable", bool(enable), "critic.enable")
    c.set("critic.lr", c.float("critic.optim.lr"), "critic.optim.lr")
    c.set("critic.cliprange_value", c.float("critic.cliprange_value"), "critic.cliprange_value")
    clip = "critic.optim.clip_grad" if c.has("critic.optim.clip_grad") else "critic.grad_clip"
    c.set("critic.grad_clip", c.float(clip), clip)
    path = c.get("critic.model.path")
    if path is not None and path != c.get(f"{AR}.model.path"):
        c.set("critic.model.path", str(path), "critic.model.path")
    else:
        c.ignore("critic.model.path", "the policy's own checkpoint, packrl's default (critic.model.path=null)")
    if c.has("trainer.critic_warmup"):
        c.set("critic.warmup_steps", c.int("trainer.critic_warmup"), "trainer.critic_warmup")
    shared = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "loss_scale_factor", "optim.weight_decay")
    for key, actor_key in ((f"critic.{name}", f"{ACTOR}.{name}") for name in shared):
        if c.has(key) and c.get(key) != c.get(actor_key):
            c.refuse(key, f"differs from {actor_key}={c.get(actor_key)}; packrl's critic shares the actor's setting",
                     f"set {key} equal to {actor_key}")
        else:
            c.ignore(key, f"equal to {actor_key}, which packrl's critic shares")
    value, used, how = _token_budget(c, dynamic="critic.use_dynamic_bsz", tokens="critic.ppo_max_token_len_per_gpu",
                                     micro=("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
                                     dynamic_default=bool(c.get(f"{ACTOR}.use_dynamic_bsz")), tokens_default=32768)
    if value is not None and any(c.has(k) for k in used):
        c.set("critic.max_tokens_per_microbatch", value, *used, conversion=how)
    else:
        c.ignore("critic.use_dynamic_bsz", "no critic budget given: the critic uses train.max_tokens_per_microbatch")


def _reward(c: Context) -> None:
    """verl's reward managers -> packrl's reward: naive/batch/prime score as ``reward.name``;
    dapo's overlong buffer -> ``reward.shaping.overlong.buffer_tokens`` and its factor. Spellings: verl
    0.9's ``reward.reward_manager.name`` / ``reward.reward_kwargs``, 0.7-0.8's ``reward_manager.name``,
    the legacy ``reward_model.*`` ones verl 0.9 still migrates, and the DAPO recipe's
    ``reward_model.overlong_buffer``. verl also
    scores responses a budget cut, which packrl does only when told (`BEHAVIOUR`)."""
    spellings = ("reward_model.reward_manager", "reward_manager.name", "reward.reward_manager.name")  # legacy wins, as verl migrates
    manager_key = next((k for k in spellings if c.get(k) is not None and c.has(k)), spellings[-1])
    manager = c.get(manager_key)
    for other in spellings:
        if other != manager_key:
            c.ignore(other, f"{manager_key} names the reward manager")
    kwargs = "reward.reward_kwargs" if any(k.startswith("reward.reward_kwargs.") for k in c.given) else "reward_model.reward_kwargs"
    recipe, cfg = "reward_model.overlong_buffer", f"{kwargs}.overlong_buffer_cfg"
    spelling = recipe if any(k.startswith(recipe + ".") for k in c.given) else cfg
    keys = [f"{spelling}.enable", f"{spelling}.len", f"{spelling}.penalty_factor", f"{kwargs}.max_resp_len"]
    if manager not in ("naive", "batch", "prime", "dapo"):
        c.refuse(manager_key, "packrl scores with registered reward functions",
                 f"set {manager_key}=naive (or dapo), and reward.name in the printed packrl command")
    active = bool(c.get(f"{spelling}.enable")) and (manager == "dapo" or spelling == recipe)
    if manager in ("naive", "batch", "prime") or (manager == "dapo" and not active):
        c.ignore(manager_key, f"{manager} computes the task score as packrl's reward.name does"
                 + (" (dapo without the overlong buffer scores as naive)" if manager == "dapo" else ""))
    if c.ignore_unless(active, keys, "no effect: the overlong buffer needs reward_manager=dapo and overlong_buffer*.enable=True"):
        length, response = c.int(f"{spelling}.len", 0), c.int("data.max_response_length")
        resp_len = c.get(f"{kwargs}.max_resp_len")
        if resp_len is not None and c.int(f"{kwargs}.max_resp_len") != response:
            c.refuse(f"{kwargs}.max_resp_len", f"differs from data.max_response_length={response}; packrl ramps the penalty up "
                     "to rollout.max_response_tokens", f"set {kwargs}.max_resp_len={response}")
        c.set("reward.shaping.overlong.buffer_tokens", length, f"{spelling}.enable", f"{spelling}.len", manager_key,
              *([f"{kwargs}.max_resp_len"] if resp_len is not None else []))
        if c.has(f"{spelling}.penalty_factor"):
            c.set("reward.shaping.overlong.penalty_factor", c.float(f"{spelling}.penalty_factor"), f"{spelling}.penalty_factor")
    c.set("reward.score_truncated", True, conversion="verl scores responses a budget cut; packrl's rewards would give them 0")


STEPS: tuple[Callable[[Context], None], ...] = (
    _total_steps, _resume, _val_files, _lengths, _overlong_prompt, _rope, _lora, _offload, _parallel, _budgets, _gae,
    _filter_groups, _rollout_correction, _clip_ratio, _cov_losses, _kl, _grad_clip, _warmup, _val_temperature, _vllm_args,
    _multi_turn, _critic, _reward,
)
"""The relational conversions in the order they run: steps before the warmup, the budgets and
the Ulysses size before the token budgets that read them."""
