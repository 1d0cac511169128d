"""Translate a verl launch script's overrides into a packrl preset plus dotlist overrides.

``translate(["data.train_batch_size=1024", "actor_rollout_ref.rollout.n=5", ...])`` returns a
`Translation`: the packrl overrides (on top of the `PRESET` preset), what each came from with
every unit conversion, and the verl keys packrl does not use with the reason. Keys verl does not
have (naming the nearest verl key) and keys packrl cannot honour are raised together as one
`ConfigError` whose problems name the verl key, the value, why and the fix.

Units (verl -> packrl), as in docs/verl.md:

=========================================================  =====================================
verl                                                       packrl
=========================================================  =====================================
``data.train_batch_size`` (prompts)                        ``data.batch_size`` (prompts)
``AR.actor.ppo_mini_batch_size`` (prompts)                 ``train.mini_batch_size`` (prompts)
``AR.actor.ppo_max_token_len_per_gpu`` (dynamic bsz)       ``train.max_tokens_per_microbatch``
  (tokens per GPU; a pack holds x ulysses size)              (tokens per rank; same x semantics)
``AR.actor.ppo_micro_batch_size_per_gpu`` (sequences)      m x (P + R) / ulysses tokens per rank
``AR.actor.ppo_micro_batch_size`` (sequences, all GPUs)    per GPU = m / (GPUs / ulysses), then as above
``trainer.n_gpus_per_node`` x ``trainer.nnodes``           ``trainer.num_workers``
``trainer.total_epochs``                                   epochs x floor(rows / batch) steps
=========================================================  =====================================

Keys a script does not set take verl's defaults where they change what is trained (advantage
estimator ``gae``, ``rollout.n=1``, weight decay 0.01, ...); speed and memory settings keep
packrl's. The module is pure (no torch, no data files: the caller counts the training rows):
translating verl's 38-override GSM8K GRPO script takes about 3 ms once the preset is read
(15 ms the first time), so ``packrl verl --dry-run`` answers before any model could load.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from packrl.config.verl_keys import (ACTOR, ANY, AR, DEFAULTS, REF, ROLLOUT, VLLM_PASSED, IgnoredKey, Mapping, Translation,
                                     VerlOverride, format_value, nearest_key, parse_override, rule_of)
from packrl.config.algorithm_variants import COV_KEYS
from packrl.errors import ConfigError, ConfigProblem

PRESET = "gsm8k"
"""The packrl preset the overrides apply to (GSM8K files, the ``gsm8k`` reward)."""
_MISSING = object()

_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_LOSS_MODES = {"vanilla": "ppo_clip", "gspo": "gspo", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}
_ESTIMATORS = ("gae", "grpo", "rloo")
_LOGGERS = ("console", "wandb", "tensorboard", "mlflow")
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}


@lru_cache(maxsize=1)
def _preset_config() -> Any:
    from packrl.config.load import load_config

    return load_config(PRESET)


def _preset_value(key: str) -> Any:
    value: Any = _preset_config()
    for part in key.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


@dataclass
class _Context:
    """The given overrides with verl's defaults, and what the translation has made of them."""

    given: dict[str, VerlOverride]
    mappings: dict[str, Mapping] = field(default_factory=dict)
    ignored: list[IgnoredKey] = field(default_factory=list)
    problems: list[ConfigProblem] = field(default_factory=list)
    handled: set[str] = field(default_factory=set)
    num_train_rows: int | None = None
    total_steps: int | None = None
    """The run's steps, once `_trainer` has them (None = unknown)."""
    sequence_parallel: int = 1
    longest: int = 1024
    """Prompt + response budget in tokens, once `_data` has them."""

    def has(self, key: str) -> bool:
        return key in self.given

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.given:
            return self.given[key].value
        return DEFAULTS.get(key, default)

    def first(self, *keys: str) -> Any:
        """The value of the first given key, else the default of the first with one."""
        for key in keys:
            if key in self.given:
                return self.given[key].value
        return next((DEFAULTS[k] for k in keys if k in DEFAULTS), None)

    def int(self, key: str, default: Any = None) -> int:
        """The value of ``key`` as a whole number; another value is refused (and 1 stands in)."""
        value = self.get(key, default)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
        self.refuse(key, "must be a whole number", f"set {key} to an integer", value=value)
        return 1

    def float(self, key: str, default: Any = None) -> float:
        """The value of ``key`` as a number; another value is refused (and 0.0 stands in)."""
        value = self.get(key, default)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        self.refuse(key, "must be a number", f"set {key} to a number", value=value)
        return 0.0

    def set(self, key: str, value: Any, *sources: str, conversion: str = "") -> None:
        """Emit packrl ``key=value`` from verl ``sources``; one left at its verl default is only
        emitted when the preset holds another value."""
        given = [s for s in sources if s in self.given]
        self.handled.update(given)
        if not given and _same(_preset_value(key), value):
            return
        texts = tuple(self.given[s].text for s in given) + tuple(
            f"{s}={format_value(DEFAULTS[s])} (verl default)" for s in sources if s not in self.given and s in DEFAULTS)
        self.mappings[key] = Mapping(key, value, texts or ("(verl behaviour)",), conversion)

    def ignore(self, key: str, reason: str) -> None:
        if key in self.given and key not in self.handled:
            self.handled.add(key)
            self.ignored.append(IgnoredKey(key, self.given[key].value, reason))

    def refuse(self, key: str, message: str, fix: str, value: Any = _MISSING) -> None:
        self.handled.add(key)
        self.problems.append(ConfigProblem(key, self.get(key) if value is _MISSING else value, message, fix))

    def ignore_unless(self, condition: bool, keys: Sequence[str], reason: str) -> bool:
        """Name every given key of ``keys`` as ignored with ``reason`` when ``condition`` is false."""
        if not condition:
            for key in keys:
                self.ignore(key, reason)
        return condition


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def translate(args: Sequence[str], *, num_train_rows: int | None = None) -> Translation:
    """Translate a verl script's overrides into packrl's.

    Args:
        args: the overrides as written after ``python3 -m verl.trainer.main_ppo``
            (``key=value``, ``+key=value``, ``++key=value``); a later one for a key wins.
        num_train_rows: rows of ``data.train_files`` (for ``trainer.total_epochs`` when
            ``trainer.total_training_steps`` is not set); None = unknown.

    Returns:
        The `Translation` on top of `PRESET`.

    Raises:
        ConfigError: every override that is not one, every key verl does not have (with the
            nearest verl key) and every value packrl cannot honour (with the reason and fix).
    """
    given: dict[str, VerlOverride] = {}
    problems = []
    for text in args:
        try:
            item = parse_override(text)
        except ValueError as err:
            problems.append(ConfigProblem("override", text, str(err), "write verl overrides as key=value, e.g. data.train_batch_size=256"))
            continue
        if rule_of(item.key) is None:
            near = nearest_key(item.key)
            fix = f"did you mean {near}?" if near else "see docs/verl.md for the verl keys packrl knows"
            if _is_packrl_key(item.key):
                fix = f"{item.key} is a packrl key: add it to the `packrl train` command that `packrl verl --dry-run` prints"
            problems.append(ConfigProblem(item.key, item.value, "is not a verl config key", fix))
            continue
        given[item.key] = item
    c = _Context(given, num_train_rows=num_train_rows)
    for step in (_trainer, _data, _model, _offload, _parallel, _budgets, _algorithm, _actor_loss, _optimizer, _rollout, _multi_turn,
                 _critic, _reward, _generic):
        step(c)
    if problems or c.problems:
        raise ConfigError(list({str(p): p for p in problems + c.problems}.values()))  # a value read twice is named once
    return Translation(PRESET, tuple(c.mappings.values()), tuple(c.ignored))


def _is_packrl_key(key: str) -> bool:
    """Whether ``key`` names a field of packrl's `RunConfig` (a packrl override given to `packrl verl`)."""
    import dataclasses

    from packrl.config.schema import RunConfig

    node: Any = RunConfig
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return False
        node = getattr(node(), part) if dataclasses.is_dataclass(node) else None
        node = type(node) if dataclasses.is_dataclass(node) else node
    return True


def train_files_of(args: Sequence[str]) -> list[str]:
    """The ``data.train_files`` a verl script names (verl's default when it names none), for
    counting rows before `translate`; overrides that do not parse are skipped here."""
    value: Any = DEFAULTS["data.train_files"]
    for text in args:
        try:
            item = parse_override(text)
        except ValueError:
            continue
        if item.key == "data.train_files":
            value = item.value
    return _files(value)


def sources_of(translation: Translation, problem: ConfigProblem) -> str:
    """The verl overrides behind the packrl keys of ``problem`` ("" when none), so a problem
    packrl finds in the translated config names what to change in the verl command."""
    by_key = {m.key: m for m in translation.mappings}
    found = [s for key in problem.involved_keys if key in by_key for s in by_key[key].sources]
    return ", ".join(dict.fromkeys(found))


def _total_steps(c: _Context) -> int | None:
    """``trainer.total_training_steps``, else epochs x whole batches of the training rows."""
    if c.get("trainer.total_training_steps") is not None:
        steps = c.int("trainer.total_training_steps")
        c.set("train.total_steps", steps, "trainer.total_training_steps")
        c.ignore("trainer.total_epochs", "verl runs trainer.total_training_steps when it is set")
        return steps
    epochs, batch, num_train_rows = c.int("trainer.total_epochs"), c.int("data.train_batch_size"), c.num_train_rows
    if epochs < 1:
        c.refuse("trainer.total_epochs", "must be at least 1", "set trainer.total_epochs >= 1 or trainer.total_training_steps",
                 value=epochs)
        return None
    if num_train_rows is None:
        names = _files(c.get("data.train_files"))
        missing = [name for name in names if "://" not in name and not Path(name).exists()]
        why = f"but these files do not exist: {', '.join(missing)}" if missing else (
            f"which could not be counted from data.train_files={', '.join(names)} (local .parquet, .jsonl or .json files are counted)")
        c.refuse("trainer.total_epochs", f"needs the number of training rows, {why}",
                 "point data.train_files at existing files, or set trainer.total_training_steps", value=epochs)
        return None
    if num_train_rows == 0:
        c.refuse("trainer.total_epochs", "needs training rows, and data.train_files holds none (an empty list or empty files)",
                 "point data.train_files at GSM8K parquet files (packrl data gsm8k writes them)", value=epochs)
        return None
    steps = epochs * (num_train_rows // batch)
    if steps < 1:
        c.refuse("trainer.total_epochs", f"gives {steps} steps: {num_train_rows:,} rows hold no full batch of "
                 f"data.train_batch_size={batch:,} prompts", "lower data.train_batch_size or set trainer.total_training_steps",
                 value=epochs)
        return None
    c.set("train.total_steps", steps, "trainer.total_epochs", "data.train_batch_size",
          conversion=f"{epochs} epochs x floor({num_train_rows:,} rows / {batch:,} prompts) = {steps:,} steps "
                     "(rows counted before overlong filtering)")
    return steps


def _trainer(c: _Context) -> None:
    c.total_steps = _total_steps(c)
    for verl_key, key, note in (("trainer.save_freq", "train.save_every", " (packrl still saves after the last step)"),
                                ("trainer.test_freq", "train.val_every", "")):
        value = c.int(verl_key)
        c.set(key, max(0, value), verl_key, conversion=f"{value} (never) -> 0{note}" if value <= 0 else "")
    if c.has("trainer.logger"):
        names = [str(n) for n in _as_list(c.get("trainer.logger"))]
        kept, dropped = [n for n in names if n in _LOGGERS], [n for n in names if n not in _LOGGERS]
        c.set("train.loggers", kept or ["console"], "trainer.logger",
              conversion=f"dropped {', '.join(dropped)} (packrl logs to {', '.join(_LOGGERS)})" if dropped else "")
    if c.get("trainer.rollout_data_dir") is not None:
        c.set("train.dump_rollouts", True, "trainer.rollout_data_dir", conversion="dumps go to RUN_DIR/rollouts/step_N.jsonl")
    for key in ("ray_kwargs.timeline_json_file", "ray_init.timeline_json_file"):
        if c.get(key) is not None:
            c.set("train.trace", True, key, conversion="a Ray timeline -> RUN_DIR/trace.json: spans per stage and per micro-batch")
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
    if c.has("trainer.max_actor_ckpt_to_keep"):
        keep = None if c.get("trainer.max_actor_ckpt_to_keep") is None else c.int("trainer.max_actor_ckpt_to_keep")
        c.set("train.keep_last", keep if keep is not None and keep > 0 else None, "trainer.max_actor_ckpt_to_keep")


def _files(value: Any) -> list[str]:
    return [os.path.expanduser(str(f)) for f in _as_list(value)]


def _data(c: _Context) -> None:
    c.set("data.train_files", _files(c.get("data.train_files")), "data.train_files")
    if c.has("data.val_files") or c.int("trainer.test_freq") > 0:
        c.set("data.val_files", _files(c.get("data.val_files")), "data.val_files")
    rows = None if c.get("data.val_max_samples") is None else c.int("data.val_max_samples")
    every = rows is None or rows < 0
    c.set("data.max_val_rows", None if every else rows, "data.val_max_samples",
          conversion="-1 (all) -> null" if every else "the first N rows (verl: a random N)")
    for verl_key, rollout_key, key in (("data.max_prompt_length", f"{ROLLOUT}.prompt_length", "data.max_prompt_tokens"),
                                       ("data.max_response_length", f"{ROLLOUT}.response_length", "rollout.max_response_tokens")):
        if c.has(rollout_key) and c.get(rollout_key) != c.get(verl_key):
            c.refuse(rollout_key, f"differs from {verl_key}={c.get(verl_key)}; packrl has one budget for both",
                     f"set {rollout_key} and {verl_key} to the same number of tokens")
        c.set(key, c.int(rollout_key if c.has(rollout_key) else verl_key), verl_key, rollout_key)
    c.longest = sum(c.int(f"{ROLLOUT}.{r}_length" if c.has(f"{ROLLOUT}.{r}_length") else f"data.max_{r}_length")
                    for r in ("prompt", "response"))
    c.set("data.batch_size", c.int("data.train_batch_size"), "data.train_batch_size")
    c.set("data.shuffle", bool(c.get("data.shuffle")), "data.shuffle")
    if c.get("data.seed") is not None:
        c.set("train.seed", c.int("data.seed"), "data.seed", conversion="packrl's one seed also seeds sampling")
    else:
        c.ignore("data.seed", "null: packrl seeds from train.seed")
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


def _model(c: _Context) -> None:
    if c.has(f"{AR}.model.path"):
        c.set("model.path", str(c.get(f"{AR}.model.path")), f"{AR}.model.path")
    for verl_key, key in ((f"{AR}.model.enable_gradient_checkpointing", "model.gradient_checkpointing"),
                          (f"{AR}.model.enable_activation_offload", "model.activation_offload")):
        if c.has(verl_key):
            c.set(key, bool(c.get(verl_key)), verl_key)
    if c.has(f"{ACTOR}.use_torch_compile"):
        c.set("model.compile", None if c.get(f"{ACTOR}.use_torch_compile") else False, f"{ACTOR}.use_torch_compile",
              conversion="true -> null: on where packrl can compile")
    rope = f"{AR}.model.override_config.rope_scaling"
    kind_key = f"{rope}.type" if c.has(f"{rope}.type") else f"{rope}.rope_type"
    if c.has(kind_key):
        kind = c.get(kind_key)
        if kind in ("linear", "dynamic", "yarn"):
            c.set("model.rope_scaling.type", kind, kind_key)
        else:
            c.refuse(kind_key, "packrl applies linear, dynamic or yarn RoPE scaling", f"set {kind_key}=yarn (or linear, dynamic)")
    if c.has(f"{rope}.factor"):
        c.set("model.rope_scaling.factor", c.float(f"{rope}.factor"), f"{rope}.factor")
    dtype_key = f"{ACTOR}.fsdp_config.dtype"
    if c.has(dtype_key):
        if str(c.get(dtype_key)) in _DTYPES:
            c.set("model.dtype", _DTYPES[str(c.get(dtype_key))], dtype_key, conversion="compute dtype; parameters stay float32")
        else:
            c.refuse(dtype_key, "packrl computes in bf16 or fp32", f"set {dtype_key}=bfloat16 (or float32)")
    lora = [f"{AR}.model.lora_rank", f"{AR}.model.lora_alpha", f"{AR}.model.target_modules"]
    rank = c.int(lora[0]) if c.get(lora[0]) is not None else 0
    if c.ignore_unless(rank > 0, lora, "no effect: actor_rollout_ref.model.lora_rank=0 (full fine-tuning)"):
        c.set("model.lora.rank", rank, lora[0])
        c.set("model.lora.alpha", c.float(lora[1]), lora[1])
        targets = c.get(lora[2])
        if isinstance(targets, (str, list)):
            modules = [m.strip() for m in targets.split(",")] if isinstance(targets, str) else [str(m) for m in targets]
            c.set("model.lora.target_modules", modules, lora[2])
        else:
            c.refuse(lora[2], "must be all-linear or a list of module names", f"set {lora[2]}=all-linear (or [q_proj,v_proj])")


def _offload(c: _Context) -> None:
    """The actor's FSDP offload settings -> packrl's one switch, which also covers the reference
    and the critic (their own verl settings are named)."""
    keys = [f"{ACTOR}.fsdp_config.{name}" for name in ("param_offload", "optimizer_offload", "offload_policy")]
    on = any(bool(c.get(k)) for k in keys)
    c.set("model.param_offload", on, *keys, conversion="parameters, gradients and optimizer states of the policy, reference "
          "and critic stay in host memory (FSDP2 CPUOffloadPolicy; verl's param_offload/optimizer_offload move them between "
          "phases instead)" if on else "")
    for key in (f"{REF}.fsdp_config.param_offload", "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload"):
        c.ignore(key, f"packrl offloads the reference and the critic with the policy: model.param_offload={format_value(on)}, "
                 f"from {ACTOR}.fsdp_config")


def _parallel(c: _Context) -> None:
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


def _token_budget(c: _Context, *, dynamic: str, tokens: str, micro: tuple[str, str],
                  dynamic_default: bool, tokens_default: int) -> tuple[int | None, tuple[str, ...], str]:
    """One verl micro-batch setting -> ``(tokens per rank, verl keys used, conversion)``.

    With ``use_dynamic_bsz`` the token budget carries over (both are per GPU, a pack holds that
    x the sequence-parallel size); otherwise a micro-batch of m sequences holds at most
    m x (P + R) tokens, split over the sequence-parallel ranks. None = nothing set (verl
    would stop).
    """
    total, per_gpu = micro
    is_dynamic = bool(c.get(dynamic, dynamic_default))
    if is_dynamic:
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


def _budgets(c: _Context) -> None:
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
            value = max(int(_preset_value(key)), floor)
            how = "no verl micro-batch setting: packrl's budget, at least one whole sequence"
        c.set(key, value, *used, conversion=how)
    c.set("train.mini_batch_size", c.int(f"{ACTOR}.ppo_mini_batch_size"), f"{ACTOR}.ppo_mini_batch_size")


def _smaller(budgets: list[tuple[int | None, tuple[str, ...], str]]) -> tuple[int | None, tuple[str, ...], str]:
    """The old-log-prob (rollout) and reference budgets as packrl's one log-prob budget: the smaller."""
    known = [b for b in budgets if b[0] is not None]
    if not known:
        return None, (), ""
    if len(known) == 2 and known[0][0] != known[1][0]:
        low = min(known, key=lambda b: b[0])
        return low[0], known[0][1] + known[1][1], f"{low[2] or low[0]}; packrl has one log-prob budget: the smaller of rollout's and ref's"
    return known[0][0], tuple(k for b in known for k in b[1]), known[0][2]


def _algorithm(c: _Context) -> None:
    estimator = c.get("algorithm.adv_estimator")
    if estimator not in _ESTIMATORS:
        c.refuse("algorithm.adv_estimator", f"has no packrl estimator (packrl: {', '.join(_ESTIMATORS)})",
                 "set algorithm.adv_estimator=grpo (or gae, rloo), or register the estimator in a trainer.plugins file")
    else:
        c.set("algorithm.adv_estimator", estimator, "algorithm.adv_estimator")
    for verl_key, key in (("algorithm.gamma", "algorithm.gamma"), ("algorithm.lam", "algorithm.lam")):
        if c.ignore_unless(estimator == "gae", [verl_key], f"read only by gae (algorithm.adv_estimator={estimator})") and c.has(verl_key):
            c.set(key, c.float(verl_key), verl_key)
    c.set("algorithm.norm_adv_by_std", bool(c.get("algorithm.norm_adv_by_std_in_grpo")), "algorithm.norm_adv_by_std_in_grpo")
    _filter_groups(c)
    _rollout_correction(c)


def _filter_groups(c: _Context) -> None:
    prefix = "algorithm.filter_groups"
    keys = [f"{prefix}.metric", f"{prefix}.max_num_gen_batches", "data.gen_batch_size"]
    if not c.ignore_unless(bool(c.get(f"{prefix}.enable")), keys, f"no effect: {prefix}.enable=False"):
        return
    c.set(f"{prefix}.enable", True, f"{prefix}.enable")
    metric = c.get(f"{prefix}.metric")
    if metric in ("acc", "score", None):
        c.set(f"{prefix}.metric", "score", f"{prefix}.metric")
    elif metric in ("seq_reward", "seq_final_reward"):
        c.set(f"{prefix}.metric", "reward", f"{prefix}.metric", conversion=f"{metric}: the score plus shaping")
    else:
        c.refuse(f"{prefix}.metric", "packrl filters on score or reward", f"set {prefix}.metric=score")
    rounds, batch = c.int(f"{prefix}.max_num_gen_batches"), c.int("data.train_batch_size")
    if rounds <= 0:
        c.refuse(f"{prefix}.max_num_gen_batches", "<= 0 means unlimited rounds in verl; packrl needs a cap (then trains on the "
                 "groups kept, with a warning)", f"set {prefix}.max_num_gen_batches=10", value=rounds)
        return
    gen = c.int("data.gen_batch_size") if c.get("data.gen_batch_size") is not None else batch
    capped = math.ceil(rounds * gen / batch)
    c.set(f"{prefix}.max_num_gen_batches", capped, f"{prefix}.max_num_gen_batches", "data.gen_batch_size",
          conversion="" if gen == batch else f"{rounds} rounds of {gen:,} prompts -> {capped} rounds of data.batch_size={batch:,} "
          "(the same prompt cap)")


def _rollout_correction(c: _Context) -> None:
    p = "algorithm.rollout_correction"
    level, cap_key = c.get(f"{p}.rollout_is"), f"{ACTOR}.tis_imp_ratio_cap"
    if level is None and c.get(cap_key) is not None and c.float(cap_key) > 0:
        c.set(f"{p}.rollout_is", "token", cap_key, conversion="tis_imp_ratio_cap > 0 turns token TIS on")
        c.set(f"{p}.rollout_is_threshold", c.float(cap_key), cap_key)
    elif level is not None and level != "token":
        c.refuse(f"{p}.rollout_is", "packrl weights tokens only", f"set {p}.rollout_is=token")
    elif c.ignore_unless(level == "token", [f"{p}.rollout_is_threshold", cap_key], f"no effect: {p}.rollout_is is null"):
        c.set(f"{p}.rollout_is", "token", f"{p}.rollout_is")
        if c.has(f"{p}.rollout_is_threshold"):
            c.set(f"{p}.rollout_is_threshold", c.float(f"{p}.rollout_is_threshold"), f"{p}.rollout_is_threshold")
        c.ignore(cap_key, f"superseded by {p}.rollout_is")
    rs, bounds = c.get(f"{p}.rollout_rs"), [f"{p}.rollout_rs_threshold", f"{p}.rollout_rs_threshold_lower"]
    if rs is not None and rs != "geometric":
        c.refuse(f"{p}.rollout_rs", "packrl rejects by the geometric-mean ratio only", f"set {p}.rollout_rs=geometric")
    elif c.ignore_unless(rs == "geometric", bounds, f"no effect: {p}.rollout_rs is null"):
        c.set(f"{p}.rollout_rs", "geometric", f"{p}.rollout_rs")
        for key in bounds:
            if c.get(key) is not None and not isinstance(c.get(key), (int, float)):
                c.refuse(key, "must be a number", f"set {key} to a number such as 1.001")
            elif c.get(key) is not None:
                c.set(key, c.float(key), key)


def _actor_loss(c: _Context) -> None:
    base = f"{ACTOR}.clip_ratio"
    for side in ("low", "high"):
        key = f"{base}_{side}"
        c.set(f"algorithm.clip_ratio_{side}", c.float(key if c.has(key) else base), key if c.has(key) else base,
              conversion="" if c.has(key) or not c.has(base) else f"clip_ratio -> both bounds (verl reads it where clip_ratio_{side} is null)")
    mode_key = f"{ACTOR}.policy_loss.loss_mode"
    mode = c.get(mode_key)
    if not isinstance(mode, str) or mode not in _LOSS_MODES:
        c.refuse(mode_key, f"has no packrl policy loss (packrl: {', '.join(_LOSS_MODES)})",
                 f"set {mode_key}=vanilla (or gspo, clip_cov, kl_cov), or register the loss in a trainer.plugins file")
    else:
        c.set("algorithm.policy_loss", _LOSS_MODES[mode], mode_key, conversion="vanilla -> ppo_clip" if mode == "vanilla" else "")
    for loss, names in COV_KEYS.items():
        keys = [f"{ACTOR}.policy_loss.{n}" for n in names]
        if c.ignore_unless(mode == loss, keys, f"read only by loss_mode={loss} ({mode_key}={mode})"):
            for verl_key, name in zip(keys, names):
                if c.has(verl_key):
                    c.set(f"algorithm.{name}", c.float(verl_key), verl_key)
    agg = f"{ACTOR}.loss_agg_mode"
    c.set("algorithm.loss_agg_mode", c.get(agg), agg)
    if c.get(f"{ACTOR}.loss_scale_factor") is not None:
        c.set("algorithm.loss_scale_factor", c.int(f"{ACTOR}.loss_scale_factor"), f"{ACTOR}.loss_scale_factor")
    else:
        c.ignore(f"{ACTOR}.loss_scale_factor", "null = the response budget in both (verl: the padded response width)")
    c.set("algorithm.entropy_coeff", c.float(f"{ACTOR}.entropy_coeff"), f"{ACTOR}.entropy_coeff")
    _kl(c)


def _kl(c: _Context) -> None:
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
    if kind not in _KL:
        c.refuse(type_key, f"has no packrl KL estimator (packrl: k1, k2, k3; verl: {', '.join(_KL)})",
                 f"set {type_key}=low_var_kl (k3), kl (k1) or mse (k2)")
        return
    c.set("algorithm.kl_coef", c.float(coef_key), switch, coef_key)
    c.set("algorithm.kl_estimator", _KL[kind], type_key, conversion=f"{kind} -> {_KL[kind]}" if kind != _KL[kind] else "")


def _optimizer(c: _Context) -> None:
    c.set("train.lr", c.float(f"{ACTOR}.optim.lr"), f"{ACTOR}.optim.lr")
    c.set("train.weight_decay", c.float(f"{ACTOR}.optim.weight_decay"), f"{ACTOR}.optim.weight_decay")
    clip = f"{ACTOR}.optim.clip_grad" if c.has(f"{ACTOR}.optim.clip_grad") else f"{ACTOR}.grad_clip"
    c.set("train.grad_clip", c.float(clip), clip)
    c.set("train.ppo_epochs", c.int(f"{ACTOR}.ppo_epochs"), f"{ACTOR}.ppo_epochs")
    steps_key, ratio_key = f"{ACTOR}.optim.lr_warmup_steps", f"{ACTOR}.optim.lr_warmup_steps_ratio"
    steps = c.get(steps_key)
    if steps is not None and c.int(steps_key) >= 0:
        c.set("train.warmup_steps", c.int(steps_key), steps_key)
        c.ignore(ratio_key, f"verl reads the ratio only when {steps_key} < 0")
        return
    ratio, total = c.float(ratio_key), c.total_steps
    if total is None:
        return
    warmup = int(ratio * total)
    c.set("train.warmup_steps", warmup, ratio_key, conversion=f"int({ratio} x {total:,} steps) = {warmup:,}")


def _rollout(c: _Context) -> None:
    name = c.get(f"{ROLLOUT}.name")
    if name in ("vllm", "hf"):
        c.set("rollout.engine", name, f"{ROLLOUT}.name")
    elif name is not None:
        c.refuse(f"{ROLLOUT}.name", "packrl's engines are vllm and hf", f"set {ROLLOUT}.name=vllm (or hf)")
    c.set("rollout.n", c.int(f"{ROLLOUT}.n"), f"{ROLLOUT}.n")
    c.set("rollout.temperature", c.float(f"{ROLLOUT}.temperature"), f"{ROLLOUT}.temperature")
    c.set("rollout.top_p", c.float(f"{ROLLOUT}.top_p"), f"{ROLLOUT}.top_p")
    top_k = c.int(f"{ROLLOUT}.top_k")
    c.set("rollout.top_k", max(0, top_k), f"{ROLLOUT}.top_k", conversion="-1 (off) -> 0 (off)" if top_k < 0 else "")
    if c.has(f"{ROLLOUT}.max_num_seqs"):
        c.set("rollout.max_num_seqs", c.int(f"{ROLLOUT}.max_num_seqs"), f"{ROLLOUT}.max_num_seqs")
    c.set("rollout.return_logprobs", bool(c.get(f"{ROLLOUT}.calculate_log_probs")), f"{ROLLOUT}.calculate_log_probs")
    sample, temp = f"{ROLLOUT}.val_kwargs.do_sample", f"{ROLLOUT}.val_kwargs.temperature"
    sampled = bool(c.get(sample)) and c.float(temp) > 0
    c.set("rollout.val_temperature", c.float(temp) if sampled else 0.0, sample, temp,
          conversion="" if sampled else "do_sample=False: greedy (0)")
    vllm = name == "vllm"
    passed = [(f"{ROLLOUT}.{n}", n) for n in VLLM_PASSED]
    passed += [(k, k.rsplit(".", 1)[-1]) for k in c.given if k.startswith(f"{ROLLOUT}.engine_kwargs.vllm.")]
    for verl_key, arg in passed:
        if not c.ignore_unless(vllm, [verl_key], f"a vLLM engine argument; {ROLLOUT}.name={name}"):
            continue
        if c.has(verl_key) and c.get(verl_key) is None:
            c.ignore(verl_key, "null: verl drops engine arguments set to null")
        elif c.has(verl_key):
            c.set(f"rollout.engine_kwargs.{arg}", c.get(verl_key), verl_key)


def _multi_turn(c: _Context) -> None:
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


def _critic(c: _Context) -> None:
    estimator = c.get("algorithm.adv_estimator")
    enable = c.get("critic.enable")
    enabled = bool(enable) if enable is not None else estimator == "gae"
    if estimator == "gae" and enable is False:
        c.refuse("critic.enable", "algorithm.adv_estimator=gae needs the critic's values", "set critic.enable=True or choose "
                 "another algorithm.adv_estimator")
    mapped = [k for k in c.given if (k.startswith("critic.") or k == "trainer.critic_warmup") and (rule_of(k) and rule_of(k).mapped)]
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
    for key, actor_key in (("critic.ppo_mini_batch_size", f"{ACTOR}.ppo_mini_batch_size"), ("critic.ppo_epochs", f"{ACTOR}.ppo_epochs"),
                           ("critic.loss_agg_mode", f"{ACTOR}.loss_agg_mode"), ("critic.optim.weight_decay", f"{ACTOR}.optim.weight_decay")):
        if c.has(key) and c.get(key) != c.get(actor_key):
            c.refuse(key, f"differs from {actor_key}={c.get(actor_key)}; packrl's critic shares the actor's setting",
                     f"set {key} equal to {actor_key}")
        else:
            c.ignore(key, f"equal to {actor_key}, which packrl's critic shares")
    value, used, how = _token_budget(c, dynamic="critic.use_dynamic_bsz", tokens="critic.ppo_max_token_len_per_gpu",
                                     micro=("critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
                                     dynamic_default=bool(c.get(f"{ACTOR}.use_dynamic_bsz")),
                                     tokens_default=32768)
    if value is not None and any(c.has(k) for k in used):
        c.set("critic.max_tokens_per_microbatch", value, *used, conversion=how)
    else:
        c.ignore("critic.use_dynamic_bsz", "no critic budget given: the critic uses train.max_tokens_per_microbatch")


def _reward(c: _Context) -> None:
    manager = c.get("reward_model.reward_manager")
    kwargs, recipe = "reward_model.reward_kwargs", "reward_model.overlong_buffer"
    cfg = f"{kwargs}.overlong_buffer_cfg"
    spelling = recipe if any(k.startswith(recipe + ".") for k in c.given) else cfg
    keys = [f"{spelling}.enable", f"{spelling}.len", f"{spelling}.penalty_factor", f"{kwargs}.max_resp_len"]
    if manager not in ("naive", "batch", "prime", "dapo"):
        c.refuse("reward_model.reward_manager", "packrl scores with registered reward functions",
                 "set reward_model.reward_manager=naive (or dapo), and reward.name in the printed packrl command")
    active = bool(c.get(f"{spelling}.enable")) and (manager == "dapo" or spelling == recipe)
    if manager in ("naive", "batch", "prime") or (manager == "dapo" and not active):
        c.ignore("reward_model.reward_manager", f"{manager} computes the task score as packrl's reward.name does"
                 + (" (dapo without the overlong buffer scores as naive)" if manager == "dapo" else ""))
    if c.ignore_unless(active, keys, "no effect: the overlong buffer needs reward_manager=dapo and overlong_buffer*.enable=True"):
        length, response = c.int(f"{spelling}.len", 0), c.int("data.max_response_length")
        resp_len = c.get(f"{kwargs}.max_resp_len")
        if resp_len is not None and c.int(f"{kwargs}.max_resp_len") != response:
            c.refuse(f"{kwargs}.max_resp_len", f"differs from data.max_response_length={response}; packrl ramps the penalty up "
                     "to rollout.max_response_tokens", f"set {kwargs}.max_resp_len={response}")
        c.set("reward.overlong_buffer_tokens", length, f"{spelling}.enable", f"{spelling}.len", "reward_model.reward_manager",
              *([f"{kwargs}.max_resp_len"] if resp_len is not None else []))
        if c.has(f"{spelling}.penalty_factor"):
            c.set("reward.overlong_penalty_factor", c.float(f"{spelling}.penalty_factor"), f"{spelling}.penalty_factor")
    c.set("reward.score_truncated", True, conversion="verl scores responses a budget cut; packrl's rewards would give them 0")


def _generic(c: _Context) -> None:
    """Every key not yet handled: ignored with its rule's reason, refused when its value is not
    accepted; a mapped key no step used had no effect in this configuration."""
    for key, item in c.given.items():
        if key in c.handled:
            continue
        rule = rule_of(key)
        assert rule is not None, f"{key} passed the known-key check"
        if rule.mapped:
            c.ignore(key, f"no effect in this configuration (it maps to {rule.packrl} when it acts)")
        elif rule.accept is ANY or any(_same(item.value, v) for v in rule.accept):
            c.ignore(key, rule.reason)
        else:
            accepted = ", ".join(format_value(v) for v in rule.accept)
            c.refuse(key, f"{rule.reason} (accepted: {accepted})", rule.fix or f"remove {key}")
