"""`packrl preflight`: every problem a run would hit, found from configs alone, in seconds.

Reads the run config and the model's ``config.json`` (never the weights; for a ``.gguf`` file
its header) and reports, all at once:

- every config problem (`packrl.config.check_config`: unknown keys, types, choices, ranges, the
  relations among budgets and batch sizes);
- prompt + response budget against the model context (with ``model.rope_scaling`` applied);
  when they do not fit, a proposed ``model.rope_scaling`` (``yarn``, the smallest integer
  factor that fits, at most `packrl.config.budgets.MAX_ROPE_FACTOR`) and the context it gives;
  past that factor, the fix says that no scaling packrl proposes fits;
- LoRA target modules that match nothing in the architecture;
- the memory estimate per device (`packrl.inspect.memory`) and, given the device memory, the
  largest ``train.max_tokens_per_microbatch`` that fits; a phase that does not fit is a problem.

A problem is anything that would crash the run (or, for memory, run it out of memory); the
report's ``ok`` is False when there is one, and the command exits non-zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from packrl.config import ConfigProblem, RunConfig, check_config
from packrl.config.budgets import MAX_ROPE_FACTOR, PromptRoom, budget_problems, budgets_of, budgets_table
from packrl.config.relations import config_warnings
from packrl.config.schema import AlgorithmConfig, CriticConfig, ModelConfig, RolloutConfig, RopeScalingConfig, TrainerConfig
from packrl.errors import KeyedValueError
from packrl.hardware import ComputeDtype, probe_host, resolve_for_device
from packrl.inspect.memory import GIB, MemoryEstimate, ModelShape, estimate_memory, max_fitting_tokens
from packrl.models.isolation import config_packing
from packrl.registry import POLICY_LOSSES, resolve_target
from packrl.rollout.engine import EngineOptions, declared_capabilities, engine_capabilities, wrapper_notes, wrapper_problems
from packrl.seqlen.budgets import Budgets, model_context_tokens


@dataclass(frozen=True)
class PreflightReport:
    """What preflight found.

    Attributes:
        problems: everything that would crash the run, each with key, value, limit and fix.
        notes: proposals and facts that are not problems (e.g. the proposed RoPE scaling).
        budgets: the budget plan (None when the config could not be read at all).
        memory: the memory estimate (None when the model config could not be read).
        device_memory_bytes: the memory per device the run was checked against, or None.
        recommended_tokens_per_microbatch: the largest ``train.max_tokens_per_microbatch`` that
            fits ``device_memory_bytes`` (multiple of 256 tokens), or None.
        rope_scaling: the proposed ``{"type", "factor", "max_context_tokens"}``, or None.
    """

    problems: list[ConfigProblem]
    notes: list[str] = field(default_factory=list)
    budgets: Budgets | None = None
    memory: MemoryEstimate | None = None
    device_memory_bytes: int | None = None
    recommended_tokens_per_microbatch: int | None = None
    rope_scaling: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ok``, ``problems`` (key, value, message, fix), ``notes``, ``budgets``,
        ``memory`` (`MemoryEstimate.to_dict`), ``device_memory_bytes``,
        ``recommended_tokens_per_microbatch``, ``rope_scaling``."""
        budgets = None
        if self.budgets is not None:
            b = self.budgets
            budgets = {"max_prompt_tokens": b.max_prompt_tokens, "max_response_tokens": b.max_response_tokens,
                       "max_context_tokens": b.max_context_tokens, "max_tokens_per_microbatch": b.max_tokens_per_microbatch,
                       "max_tokens_per_logprob_microbatch": b.max_tokens_per_logprob_microbatch, "rope_factor": b.rope_factor}
        return {
            "ok": self.ok,
            "problems": [{"key": p.key, "value": _jsonable(p.value), "message": p.message, "fix": p.fix} for p in self.problems],
            "notes": list(self.notes),
            "budgets": budgets,
            "memory": None if self.memory is None else self.memory.to_dict(),
            "device_memory_bytes": self.device_memory_bytes,
            "recommended_tokens_per_microbatch": self.recommended_tokens_per_microbatch,
            "rope_scaling": self.rope_scaling,
        }

    def to_text(self) -> str:
        lines = []
        if self.budgets is not None:
            lines += [budgets_table(self.budgets), ""]
        if self.memory is not None:
            lines += [self.memory.table(), ""]
        if self.device_memory_bytes is not None and self.memory is None:
            lines.append("memory not estimated: fix the model problems below first")
        elif self.device_memory_bytes is not None:
            rec = self.recommended_tokens_per_microbatch
            lines.append(f"device memory {self.device_memory_bytes / GIB:.2f} GiB: largest train.max_tokens_per_microbatch "
                         f"that fits = {rec:,}" if rec else f"device memory {self.device_memory_bytes / GIB:.2f} GiB: "
                         "no update micro-batch fits")
        lines += [f"note: {n}" for n in self.notes]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s) would break the run:")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("preflight: no problems found")
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else repr(value)


def preflight(preset: str | None, overrides: list[str] | tuple[str, ...] = (), *, device_memory_gib: float | None = None,
              device: str = "cpu") -> PreflightReport:
    """Check a run before it starts (see the module docstring).

    Args:
        preset: preset name or ``.yaml`` path (None = ``demo``).
        overrides: dotted ``key=value`` overrides.
        device_memory_gib: memory per device in GiB (2^30 bytes) to check against, or None.
        device: ``cpu`` (process RSS) or ``cuda`` (device memory).

    Returns:
        `PreflightReport`.

    Raises:
        ValueError: ``device_memory_gib`` is not a positive number, ``device`` is unknown, or
            the preset cannot be read (a `ConfigError`).
    """
    if device_memory_gib is not None and not (device_memory_gib > 0 and math.isfinite(device_memory_gib)):
        raise ValueError(f"--device-memory={device_memory_gib} GiB must be a positive number of GiB per device, e.g. 80")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device={device!r} must be cpu or cuda")
    cfg, problems, bad = check_config(preset, overrides)
    notes = [f"warning: {p}" for p in config_warnings(cfg) if not bad.intersection(p.involved_keys)]
    memory_bytes = None if device_memory_gib is None else int(device_memory_gib * GIB)
    model_config = None
    if "model.path" not in bad:
        model_config, problem = _read_model_config(cfg.model.path)
        problems += problem
    problems += _critic_path_problems(cfg.critic, cfg.algorithm.adv_estimator) + _wrapper_problems(cfg, bad, problems)
    problems += _loss_hook_problems(cfg.algorithm)
    budgets = budgets_of(cfg, max_context_tokens=None)
    rope = None
    rope_ok = not any(p.key.startswith("model.rope_scaling") for p in problems)  # else judge the unscaled context
    if model_config is not None:
        try:
            context, factor, base = _context(cfg.model.rope_scaling if rope_ok else RopeScalingConfig(), model_config)
        except KeyedValueError as err:  # model.rope_scaling the model config cannot take
            problems.append(err.problem(cfg.model.rope_scaling.type))
        except ValueError as err:
            problems.append(ConfigProblem("model.path", cfg.model.path, str(err), "use a model whose config.json sets "
                                          "max_position_embeddings, or set model.rope_scaling.type=none"))
        else:
            budgets = budgets_of(cfg, context, factor)
            rope = _rope_proposal(budgets, base)
            unread = {str(p) for p in budget_problems(budgets_of(cfg, max_context_tokens=None))}  # said again with the context
            problems = [p for p in problems if str(p) not in unread]
            problems += [_with_rope_fix(p, rope, budgets, base) for p in budget_problems(budgets)
                         if not bad.intersection(p.involved_keys)]
            if rope is not None:
                notes.append(f"set model.rope_scaling.type={rope['type']} model.rope_scaling.factor={rope['factor']:g} "
                             f"for a model context of {rope['max_context_tokens']:,} tokens (base {base:,})")
    memory, recommended = None, None
    lora_ok = not any(p.key.startswith("model.lora") for p in problems)
    if model_config is not None and lora_ok:
        shape, shape_problems = _model_shape(cfg.model, model_config)
        problems += shape_problems
        if shape is not None:
            compute = resolve_for_device(cfg.model.dtype, device)
            host = probe_host(device)
            notes.append(compute.describe() + (f"; host {host.cpu_model}, {host.num_threads} threads" if device == "cpu" else ""))
            if compute.warning:
                notes.append(compute.warning)
            memory = estimate_memory(cfg, shape, device=device, compute_dtype=compute)
            packing = config_packing(model_config)
            notes.append(packing.describe())
            problems += _sequence_parallel_problems(cfg.trainer.sequence_parallel_size, model_config, packing)
            engine_options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
            notes += _engine_notes(cfg.rollout.engine, engine_options, compute, shape, budgets, device)
            notes += wrapper_notes(cfg) + _rollout_mode_notes(cfg.trainer, cfg.rollout, cfg.data.batch_size, shape, compute.param_bytes)
            more = _modality_checks(cfg, model_config, PromptRoom.of(cfg.rollout, budgets.max_context_tokens))
            notes, problems = notes + more[0], problems + more[1]
            if memory_bytes is not None:
                recommended = max_fitting_tokens(cfg, shape, memory_bytes, device=device)
                problems += _memory_problems(cfg, shape, memory, memory_bytes, recommended, budgets)
    unique = {str(p): p for p in problems}
    return PreflightReport(list(unique.values()), notes, budgets, memory, memory_bytes, recommended, rope)


def _model_shape(model_cfg: ModelConfig, model_config: Any) -> tuple[ModelShape | None, list[ConfigProblem]]:
    """The model's shape (`ModelShape.from_config`; ``model_cfg``: the ``model`` section), or None
    and the problem that stops it: a multimodal checkpoint of a family packrl does not train, or
    LoRA targets the model lacks."""
    try:
        return ModelShape.from_config(model_config, model_cfg.lora, model_cfg.path), []
    except KeyedValueError as err:  # LoRA targets the model lacks, or an untrained multimodal family
        return None, [err.problem(model_cfg.lora.target_modules if err.key.startswith("model.lora") else model_cfg.path)]
    except ValueError as err:
        return None, [ConfigProblem("model.path", model_cfg.path, str(err), "use a causal LM transformers can build from its config")]


def _rollout_mode_notes(trainer: TrainerConfig, rollout: RolloutConfig, batch: int, shape: Any, param_bytes: int) -> list[str]:
    """The modes that carry groups across steps (the ``trainer`` and ``rollout`` sections;
    ``batch``: ``data.batch_size``): how many sequences generate at once, and (with rollout
    workers of their own, ``separate_async``) what those hold outside this estimate, which covers
    a trainer rank (`packrl.config.rollout_modes.RolloutModeInfo`)."""
    from packrl.config.rollout_modes import default_over_provision, mode_info

    mode = trainer.rollout_mode
    info = mode_info(mode)
    if not info.carries_groups:
        return []
    over = rollout.over_provision if rollout.over_provision is not None else default_over_provision(batch)
    out = [f"trainer.rollout_mode={mode}: up to {(batch + over) * rollout.n} sequences generate per step "
           f"((data.batch_size={batch} + rollout.over_provision={over}) x rollout.n={rollout.n}), in engine batches of "
           f"rollout.max_num_seqs={rollout.max_num_seqs}; carried groups are re-prefilled when they resume"]
    rows = (batch + over) * rollout.n
    stops_one_call = (not info.rollout_workers and trainer.num_workers == 1
                      and engine_capabilities(rollout).stop_on_condition)
    if stops_one_call and rows > rollout.max_num_seqs:
        lower = " or lower rollout.over_provision" if (batch + 1) * rollout.n <= rollout.max_num_seqs else ""
        out.append(f"the {rows} sequences of a step do not fit one engine batch (rollout.max_num_seqs={rollout.max_num_seqs}): "
                   "the hf engine runs its batches one after another and a step stops once its groups are complete, so "
                   "members of later batches may not advance (carried groups then finish only at rollout.max_staleness); "
                   f"set rollout.max_num_seqs={rows}{lower}")
    if info.rollout_workers:
        copy = param_bytes * shape.num_params / 2**30
        out.append(f"trainer.num_rollout_workers={trainer.num_rollout_workers}: each rollout worker holds its own policy "
                   f"copy (about {copy:.2f} GiB of parameters) and its engine's KV cache in its own process (its own GPU on "
                   "CUDA), outside this estimate, which covers one trainer rank")
    return out


def _modality_checks(cfg: RunConfig, model_config: Any, room: PromptRoom | None) -> tuple[list[str], list[ConfigProblem]]:
    """For a multimodal model: what it cannot run with (its modality's
    `packrl.models.modality.Modality.run_problems`, with the engine's declared modalities, the
    list worker set-up reads too) and its modality's own notes and budget checks (its declared
    `packrl.models.modality.Modality.preflight`; images:
    `packrl.inspect.preflight_images.image_preflight`); a prompt budget it proposes stays within
    ``room`` (what the model context leaves for a prompt; None when unknown)."""
    from packrl.config.plan import BatchPlan
    from packrl.models.modality import modality_of

    modality = modality_of(model_config)
    if modality is None:
        return [], []
    out = modality.run_problems(cfg, engine_modalities=engine_capabilities(cfg.rollout).modalities,
                                has_critic=BatchPlan.from_config(cfg).has_critic)
    if not modality.preflight:
        return [], out
    notes, problems = _call_hook(f"model.path={cfg.model.path}: its Modality.preflight", modality.preflight,
                                 "(model, data, train, room)", cfg.model, cfg.data, cfg.train, room)
    return notes, out + problems


def _sequence_parallel_problems(size: int, model_config: Any, packing: Any) -> list[ConfigProblem]:
    """``trainer.sequence_parallel_size`` (``size``) > 1 needs attention heads it divides and
    layers that keep a pack's sequences apart (it splits packs)."""
    from packrl.models.ulysses import check_heads

    if size <= 1:
        return []
    out = []
    heads = check_heads(model_config, size)
    if heads is not None:
        out.append(ConfigProblem("trainer.sequence_parallel_size", size, heads, "set it to a divisor of the attention heads"))
    if not packing.packs:
        out.append(ConfigProblem("trainer.sequence_parallel_size", size, f"splits packs, but {packing.describe()}",
                                 "set trainer.sequence_parallel_size=1 for this model"))
    return out


def _engine_notes(engine: str, options: EngineOptions, compute: ComputeDtype, shape: ModelShape, budgets: Budgets,
                  device: str) -> list[str]:
    """The notes ``rollout.engine`` (``engine``) declares on the settings it derives from the run
    (`packrl.capabilities.EngineCapabilities.preflight_notes`; vllm: its KV cache), given its
    ``options``, the model's KV bytes per token in the ``compute`` dtype and the context (the
    model's, else the longest sequence)."""
    target = declared_capabilities(engine).preflight_notes
    if target is None:
        return []
    owner = f"rollout.engine={engine}: its EngineCapabilities.preflight_notes"
    notes = _call_hook(owner, target, "(options, *, max_context_tokens, kv_bytes_per_token, dtype, cuda)", options,
                       max_context_tokens=budgets.max_context_tokens or budgets.max_sequence_tokens,
                       kv_bytes_per_token=shape.kv_bytes_per_token(compute.num_bytes), dtype=compute.name, cuda=device == "cuda")
    if not isinstance(notes, list | tuple) or not all(isinstance(note, str) for note in notes):
        raise ValueError(f"{owner}={target!r} returned {type(notes).__name__}; it must return a list of str")
    return list(notes)


def _call_hook(owner: str, target: str, signature: str, *args: Any, **kwargs: Any) -> Any:
    """The ``"module:function"`` a part declares for preflight (``owner`` names where), called.

    Raises:
        ValueError: it cannot be imported, or the call fails; names the part, the target, the
            error and the ``signature`` it must take (a plugin's hook, instead of a bare traceback).
    """
    try:
        return resolve_target(target)(*args, **kwargs)
    except Exception as err:
        raise ValueError(f"{owner}={target!r} failed ({type(err).__name__}: {err}); it must name an importable "
                         f"'module:function' taking {signature}") from err


def _critic_path_problems(critic: CriticConfig, adv_estimator: str) -> list[ConfigProblem]:
    """``critic.model.path`` that does not resolve to a model config (the critic loads it at
    set-up, when ``critic`` is on for ``algorithm.adv_estimator``)."""
    path = critic.model.path
    if path is None or not critic.enabled(adv_estimator):
        return []
    from packrl.models.model_config import ModelConfigFileError, load_model_config

    try:
        load_model_config(path)
    except ModelConfigFileError as err:
        return [ConfigProblem("critic.model.path", path, err.problem, err.fix)]
    except ValueError as err:
        return [ConfigProblem("critic.model.path", path, str(err), "set critic.model.path to a model dir, .gguf file or hub id, "
                              "or null for the policy's checkpoint")]
    return []


def _loss_hook_problems(algorithm: AlgorithmConfig) -> list[ConfigProblem]:
    """The ``prepare`` hook the policy loss declares imports (`packrl.capabilities.LossInfo.prepare`;
    the update imports it only when it first runs)."""
    if POLICY_LOSSES.problem(algorithm.policy_loss) is not None or (target := POLICY_LOSSES.info(algorithm.policy_loss).prepare) is None:
        return []
    try:
        resolve_target(target, f"algorithm.policy_loss={algorithm.policy_loss}'s LossInfo(prepare=)")
    except ValueError as err:
        return [ConfigProblem("algorithm.policy_loss", algorithm.policy_loss, str(err), "fix the loss's registration, or pick another "
                              "algorithm.policy_loss")]
    return []


def _wrapper_problems(cfg: RunConfig, bad: set[str], found: list[ConfigProblem]) -> list[ConfigProblem]:
    """What the engine wrappers that apply find as set-up would (`packrl.rollout.engine.wrapper_problems`:
    the thinking budgets with the policy's tokenizer); not where a key of the sections a hook reads
    did not parse or already has a problem (``bad``, ``found``)."""
    return wrapper_problems(cfg, bad.union(*(p.involved_keys for p in found)))


def _read_model_config(path: str) -> tuple[Any, list[ConfigProblem]]:
    """The config of the model at ``path`` (``model.path``), or a problem naming it. A
    ``config.json`` without ``max_position_embeddings`` is a problem too: transformers would fill
    in its class default (2,048 for Llama) and every context check would rest on a guess."""
    import json

    from packrl.models.model_config import ModelConfigFileError, check_text_model, load_model_config
    from packrl.models.resolve import resolve_model

    fix = "set model.path to a model dir, .gguf file or hub id"
    try:
        model_config = load_model_config(path)
        check_text_model(model_config, path)
    except ModelConfigFileError as err:
        return None, [ConfigProblem("model.path", path, err.problem, err.fix)]
    except KeyedValueError as err:  # a multimodal checkpoint of a family packrl does not train
        return None, [err.problem(path)]
    except ValueError as err:
        return None, [ConfigProblem("model.path", path, str(err), fix)]
    config_json = resolve_model(path, weights=False).model_dir / "config.json"
    if config_json.is_file():
        raw = json.loads(config_json.read_text())
        if "max_position_embeddings" not in raw and "max_position_embeddings" not in (raw.get("text_config") or {}):
            return None, [ConfigProblem(
                "model.path", path, f"{config_json} has no max_position_embeddings, so the model context is unknown",
                "add max_position_embeddings (the model's context in tokens) to that config.json",
            )]
    return model_config, []


def _context(rope_scaling: RopeScalingConfig, model_config: Any) -> tuple[int, float, int]:
    """``(context, rope factor, context without packrl's scaling)`` in tokens, with
    ``rope_scaling`` (``model.rope_scaling``) applied the way `load_policy` applies it
    (`apply_rope_scaling`).

    Raises:
        ValueError: no usable ``max_position_embeddings``, or a scaling that cannot apply.
    """
    from packrl.models.model_config import apply_rope_scaling

    base, _ = model_context_tokens(model_config)
    context, factor = model_context_tokens(apply_rope_scaling(model_config, rope_scaling))
    return context, factor, base


def _rope_factor_needed(budgets: Budgets, base: int) -> int | None:
    """The smallest integer RoPE factor >= 2 whose context ``base x factor`` holds prompt +
    response; None when the budgets fit the context already (or it is unknown)."""
    if budgets.max_context_tokens is None or budgets.max_sequence_tokens <= budgets.max_context_tokens:
        return None
    return max(2, math.ceil(budgets.max_sequence_tokens / base))


def _rope_proposal(budgets: Budgets, base: int) -> dict[str, Any] | None:
    """``yarn`` with `_rope_factor_needed`, or None when none is needed or it is above `MAX_ROPE_FACTOR`."""
    factor = _rope_factor_needed(budgets, base)
    if factor is None or factor > MAX_ROPE_FACTOR:
        return None
    return {"type": "yarn", "factor": float(factor), "max_context_tokens": base * factor}


def _with_rope_fix(problem: ConfigProblem, rope: dict[str, Any] | None, budgets: Budgets, base: int) -> ConfigProblem:
    """Add the RoPE proposal to the fix of the prompt + response > context problem, or say that
    the factor it would take is beyond `MAX_ROPE_FACTOR`."""
    factor = _rope_factor_needed(budgets, base)
    if factor is None or "model context" not in problem.message:
        return problem
    if rope is not None:
        fix = (f"{problem.fix}; or set model.rope_scaling.type={rope['type']} model.rope_scaling.factor={rope['factor']:g} "
               f"(model context {rope['max_context_tokens']:,} tokens)")
    else:
        fix = (f"{problem.fix}; RoPE scaling cannot make up the difference: it would take model.rope_scaling.factor={factor:,} "
               f"on the model's {base:,} tokens, more than the factor {MAX_ROPE_FACTOR} packrl proposes (the YaRN extension "
               "Qwen2.5 and Qwen3 document)")
    return ConfigProblem(problem.key, problem.value, problem.message, fix, problem.keys)


def _memory_problems(cfg: RunConfig, shape: ModelShape, memory: MemoryEstimate, memory_bytes: int, recommended: int,
                     budgets: Budgets) -> list[ConfigProblem]:
    out = []
    gib = memory_bytes / GIB
    if memory.phases["update"] > memory_bytes:
        limit = f"the update needs about {memory.phases['update'] / GIB:.2f} GiB > {gib:.2f} GiB per device"
        out.append(ConfigProblem("train.max_tokens_per_microbatch", cfg.train.max_tokens_per_microbatch, limit,
                                 _update_fix(cfg.model, cfg.trainer.num_workers, memory, memory_bytes, recommended, budgets)))
    if memory.phases["generation"] > memory_bytes:
        fits = _largest_fitting(lambda n: _replace(cfg, "rollout", max_num_seqs=n), shape, memory, memory_bytes, "generation",
                                cfg.rollout.max_num_seqs)
        out.append(ConfigProblem(
            "rollout.max_num_seqs", cfg.rollout.max_num_seqs,
            f"generation needs about {memory.phases['generation'] / GIB:.2f} GiB > {gib:.2f} GiB per device "
            f"(KV cache {memory.parts['rollout KV cache'] / GIB:.2f} GiB)",
            f"set rollout.max_num_seqs={fits}" if fits else "no generation batch fits; see the other memory fixes",
        ))
    if memory.phases["logprob"] > memory_bytes:
        fits = _largest_fitting(lambda n: _replace(cfg, "train", max_tokens_per_logprob_microbatch=n), shape, memory, memory_bytes,
                                "logprob", cfg.train.max_tokens_per_logprob_microbatch)
        fix = (f"set train.max_tokens_per_logprob_microbatch={fits}" if fits >= budgets.max_sequence_tokens
               else "no log-prob micro-batch holding the longest sequence fits; see the other memory fixes")
        out.append(ConfigProblem(
            "train.max_tokens_per_logprob_microbatch", cfg.train.max_tokens_per_logprob_microbatch,
            f"log-prob micro-batches need about {memory.phases['logprob'] / GIB:.2f} GiB > {gib:.2f} GiB per device", fix,
        ))
    return out


def _update_fix(model_cfg: ModelConfig, num_workers: int, memory: MemoryEstimate, memory_bytes: int, recommended: int,
                budgets: Budgets) -> str:
    """The fix of an update phase over ``memory_bytes``, for the ``model`` section ``model_cfg`` on
    ``trainer.num_workers=num_workers``: the largest budget that fits, else what frees memory."""
    if recommended >= budgets.max_sequence_tokens:
        return f"set train.max_tokens_per_microbatch={recommended} (the largest that fits)"
    held = ("runtime", "parameters", "reference model", "rollout engine copy", "gathered parameters (FSDP2)")
    fixed = sum(memory.parts[k] for k in held)
    if fixed > memory_bytes:
        drop_copy = resolve_for_device(model_cfg.dtype, memory.device).name == "bf16" and num_workers == 1
        can_offload = num_workers > 1 and memory.device == "cuda" and not model_cfg.param_offload
        return (f"the weights and runtime alone need {fixed / GIB:.2f} GiB: use a device with more memory"
                + (" (or model.dtype=fp32 to drop the bf16 rollout engine copy)" if drop_copy else "")
                + (" (or model.param_offload=true to keep the parameter shards in host memory)" if can_offload else ""))
    offload = model_cfg.param_offload or num_workers == 1 or memory.device != "cuda"  # FSDP2 on CUDA only
    options = [o for o, on in (("model.gradient_checkpointing=true", model_cfg.gradient_checkpointing),
                               ("model.lora.rank=16", model_cfg.lora.rank > 0),
                               ("model.param_offload=true", offload)) if not on]
    return ("no micro-batch holding the longest sequence fits: " + ", ".join(
        [*(f"set {o}" for o in options), "lower data.max_prompt_tokens / rollout.max_response_tokens"]))


def _replace(cfg: RunConfig, section: str, **values: Any) -> RunConfig:
    from dataclasses import replace

    return replace(cfg, **{section: replace(getattr(cfg, section), **values)})


def _largest_fitting(make: Any, shape: ModelShape, memory: MemoryEstimate, memory_bytes: int, phase: str, current: int) -> int:
    """The largest value <= ``current`` whose ``phase`` fits, by bisection; 0 if none."""
    lo, hi = 0, current
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_memory(make(mid), shape, device=memory.device).phases[phase] <= memory_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
