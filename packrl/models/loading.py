"""Load the policy model, its tokenizer and the reference policy for training.

`packrl.models.resolve.resolve_model` finds what ``model.path`` names; `load_policy` loads it for
training (with RoPE scaling, gradient checkpointing and LoRA as ``model.*`` asks) and
`load_reference` freezes a copy for the KL term (with LoRA: the policy itself, run with its
adapters disabled). `resolve_policy` resolves ``model.path`` once on the controller into a
`ResolvedPolicy` (where it is, its config, tokenizer and context), so the data can be built and
checked before any weight loads, and the in-process worker loads from the same place.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from packrl.hardware import ComputeDtype, resolve_dtype
from packrl.models.resolve import ResolvedModel, first_line, has_weights, resolve_model

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from packrl.config.schema import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPolicy:
    """``model.path`` resolved once on the controller (`resolve_policy`), with what the controller
    reads from it before any weight loads. The recipes build their data with it, the worker group
    takes its tokenizer from it, and the in-process worker loads its weights from ``where``; Ray
    ranks resolve ``model.path`` where they run (another node may not hold this directory).

    Attributes:
        path: the ``model.path`` value, for messages.
        where: where it was found (`packrl.models.resolve.ResolvedModel`: the model directory, the
            GGUF file (None: a ``.gguf`` is converted once into a cached directory), the tokenizer
            directory, the source for logs), resolved with its weights as `load_policy` needs.
        config: the model's transformers config as its files state it (``model.rope_scaling`` not
            applied), a text model or a registered multimodal family (`check_text_model`).
        tokenizer: the tokenizer (`load_tokenizer`: left padding, a pad token), or the one given.
        max_context_tokens: the context a run gets, in tokens (`packrl.models.model_config.context_of`:
            ``model.rope_scaling`` applied to a text model); None when ``model.rope_scaling`` does
            not apply to this config, which the workers raise when they load the model.
    """

    path: str
    where: ResolvedModel
    config: Any
    tokenizer: Any
    max_context_tokens: int | None

    def prompt_encoder(self) -> Any:
        """What renders the policy's prompts (`prompt_encoder`): the tokenizer for a text model,
        its modality's processor for a multimodal one. Reads configs, no weights.

        Raises:
            ValueError: a multimodal model without its processor's files.
        """
        return prompt_encoder(self.where, self.config, self.tokenizer)


def resolve_policy(cfg: ModelConfig, tokenizer: Any = None) -> ResolvedPolicy:
    """Resolve ``model.path`` once and read what the controller needs before any weight loads:
    its config, its tokenizer (unless ``tokenizer`` is given: a worker group built by the caller)
    and the model context. A ``.gguf`` is converted (once, cached) exactly as for `load_policy`,
    so the token ids are the same.

    Raises:
        ValueError: as `resolve_model` and `load_tokenizer`; a broken ``config.json``
            (`packrl.models.model_config.ModelConfigFileError`); a multimodal checkpoint of a
            family packrl does not train (`packrl.models.model_config.check_text_model`).
    """
    from packrl.models.model_config import check_text_model, context_of, read_model_config

    where = resolve_model(cfg.path)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(where, cfg.path)
    config = read_model_config(where, cfg.path)
    check_text_model(config, cfg.path)  # another multimodal family: refused here, before its rows are read
    try:  # the context bounds the prompt budgets the data errors may propose
        context: int | None = context_of(config, cfg)
    except ValueError:  # the same problem stops the run when the workers read the model
        context = None
    return ResolvedPolicy(cfg.path, where, config, tokenizer, context)


def load_policy(cfg: ModelConfig, *, device: str | torch.device = "cpu", compute_dtype: ComputeDtype | None = None,
                resolved: ResolvedModel | None = None) -> tuple[Any, Any]:
    """Load the policy model and its tokenizer for training, with the memory features applied.

    Parameters are float32 (float64 for ``fp64``) whatever the checkpoint holds: the optimizer
    updates float32 master weights, and a bf16 compute dtype is applied by autocast around
    forwards and generation. Attention is SDPA, switched to packrl's packed path by `use_packed_attention`.
    In order: ``model.rope_scaling`` is applied to the config before the weights load
    (`packrl.models.model_config.apply_rope_scaling`), ``model.lora.rank > 0`` wraps the model
    with LoRA adapters (`packrl.models.lora.apply_lora`), leaving only the adapters trainable,
    and ``model.gradient_checkpointing`` turns on transformers' non-reentrant checkpointing
    (`enable_gradient_checkpointing`). ``model.activation_offload`` belongs to the update's
    context (`packrl.worker.policy.PolicyWorker.update_context`), not to the model.

    Args:
        cfg: the ``model`` config section; ``model.path`` is resolved with `resolve_model`.
        device: where to put the model.
        compute_dtype: ``model.dtype`` resolved for the machine (`packrl.hardware.resolve_dtype`,
            as `packrl.config.plan.BatchPlan.compute_dtype` holds it); default: resolved here.
        resolved: where ``model.path`` was found, resolved with weights (`ResolvedPolicy.where`
            on the controller); default: `resolve_model` here.

    Returns:
        ``(model, tokenizer)``: the model (a ``peft`` model with LoRA) in train mode with
        ``generation_config.pad_token_id`` set; the tokenizer pads on the left and has a pad
        token (its eos when it had none).

    Raises:
        ValueError: ``model.path`` does not resolve, its directory has no weights, its tokenizer
            is missing, has no chat template or no eos/pad token, or has more tokens than the
            model's embedding; ``model.rope_scaling`` cannot apply to its config; or
            ``model.lora.target_modules`` names no Linear module. A broken ``config.json`` is a
            `packrl.models.model_config.ModelConfigFileError` (a ValueError) naming the file.
    """
    import torch

    from packrl.models.attention import use_packed_attention
    from packrl.models.lora import apply_lora, parameter_counts

    compute = compute_dtype or resolve_dtype(cfg.dtype)
    resolved = resolved or resolve_model(cfg.path)
    if resolved.gguf_file is None and not has_weights(resolved.model_dir):
        raise ValueError(_missing_weights_message(cfg.path, resolved.model_dir))
    tokenizer = load_tokenizer(resolved, cfg.path)
    model = _load_weights(cfg, resolved, torch.float64 if compute.name == "fp64" else torch.float32)
    num_embeddings = cast(int, model.get_input_embeddings().num_embeddings)  # torch types it Tensor | Module
    if len(tokenizer) > num_embeddings:
        raise ValueError(
            f"the tokenizer of model.path={cfg.path!r} has {len(tokenizer)} tokens > the model's {num_embeddings} embeddings; "
            f"the tokenizer in {resolved.tokenizer_dir} belongs to another model: put the model's own tokenizer files there"
        )
    # transformers decorates PreTrainedModel.to with functools.wraps, whose stub does not bind self
    cast("torch.nn.Module", model).to(device)
    use_packed_attention(model, compute_dtype=compute.torch_dtype())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    policy = apply_lora(model, cfg.lora) if cfg.lora.rank > 0 else model
    if cfg.gradient_checkpointing:  # after LoRA: peft then adds no input-grad hook of its own
        enable_gradient_checkpointing(policy)
    trainable, total = parameter_counts(policy)
    log.info("loaded policy %s: %.1fM parameters (%.2fM trainable), attention %s",
             resolved.source, total / 1e6, trainable / 1e6, cast("PreTrainedModel", policy).config._attn_implementation)
    return policy.train(), tokenizer


def _load_weights(cfg: ModelConfig, resolved: ResolvedModel, param_dtype: torch.dtype) -> Any:
    """The model of ``resolved`` in ``param_dtype`` with SDPA attention where its architecture has
    it: a text model with ``model.rope_scaling`` applied, through ``AutoModelForCausalLM``; a
    multimodal one through its modality's auto class, then prepared as the ``model`` section asks
    (`packrl.models.modality.Modality.prepare`).

    Raises:
        ValueError: as `packrl.models.model_config.check_text_model` and `apply_rope_scaling`.
    """
    from transformers import AutoModelForCausalLM

    from packrl.models.modality import modality_of
    from packrl.models.model_config import apply_rope_scaling, check_text_model, read_model_config

    config = read_model_config(resolved, cfg.path)
    check_text_model(config, cfg.path)
    modality = modality_of(config)
    config = config if modality is not None else apply_rope_scaling(config, cfg.rope_scaling)
    auto = AutoModelForCausalLM if modality is None else modality.auto_class()
    try:
        model = auto.from_pretrained(
            resolved.model_dir, config=config, dtype=param_dtype, attn_implementation="sdpa", **resolved.load_kwargs()
        )
    except ValueError as err:  # an architecture without SDPA attention (e.g. Mamba): its own implementation
        if "does not support an attention implementation" not in str(err):
            raise
        model = auto.from_pretrained(resolved.model_dir, config=config, dtype=param_dtype, **resolved.load_kwargs())
    if modality is not None:
        modality.prepare(model, cfg)
    return model


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Turn on transformers' gradient checkpointing, non-reentrant, for every decoder layer.

    A checkpointed layer keeps only its input ([K, H] per pack) for the backward and runs its
    forward again there: about one more forward of compute for the update, in exchange for the
    layer's intermediate activations. Transformers checkpoints only when the model is in train
    mode and grad is enabled, so the no-grad log-prob forwards and generation are unchanged.
    Non-reentrant checkpointing passes keyword arguments (the packed path's ``cu_seq_lens_*``)
    through and gives LoRA adapters their gradients without inputs that require grad.

    Measured on one H200 with the SmolLM2-135M shape, one 32,768-token pack (8 x 4,096), bf16
    autocast: the update's peak memory above the weights falls from 30.3 GiB to 4.4 GiB and its
    forward + backward grows from 0.45 s to 0.56 s.
    """
    kwargs = {"use_reentrant": False}
    # getattr: the installed transformers may not declare the newer name (a peft model forwards both)
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        getattr(model, "activation_checkpointing_enable")(activation_checkpointing_kwargs=kwargs)
    else:
        cast("PreTrainedModel", model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Undo `enable_gradient_checkpointing` (and the input-embedding grad hook it registers)."""
    hf = cast("PreTrainedModel", model)  # torch types a module's attributes beyond its own as Tensor | Module
    if hasattr(model, "activation_checkpointing_disable"):
        getattr(model, "activation_checkpointing_disable")()
    else:
        hf.gradient_checkpointing_disable()
    hf.disable_input_require_grads()


def _missing_weights_message(path: str, model_dir: Path) -> str:
    ggufs = sorted(model_dir.glob("*.gguf"))
    hint = f"set model.path={str(ggufs[0])!r} (the .gguf beside it)" if ggufs else "put the model's *.safetensors files there"
    return (
        f"model.path={path!r} resolved to {model_dir}, which has config.json but no weights "
        f"(no *.safetensors, pytorch_model*.bin or index file); {hint}, or set model.path to a complete model"
    )


def processor_files(cfg: ModelConfig, model_config: Any, resolved: ResolvedModel | None = None) -> list[Path]:
    """The processor config files beside ``model.path``'s config that its modality names
    (`packrl.models.modality.Modality.processor_files`), copied into checkpoints; none for a text
    model (``model_config``: the loaded model's config) or a .gguf. ``resolved``: where
    ``model.path`` was found (default: `resolve_model` of its configs here)."""
    from packrl.models.modality import modality_of

    modality = modality_of(model_config)
    if modality is None:
        return []
    resolved = resolved or resolve_model(cfg.path, weights=False)
    if resolved.gguf_file is not None:
        return []
    return [resolved.model_dir / name for name in modality.processor_files if (resolved.model_dir / name).is_file()]


def load_prompt_encoder(cfg: ModelConfig, tokenizer: Any) -> Any:
    """What renders the policy's prompts (`prompt_encoder`) for ``model.path`` resolved here, its
    configs only (a hub id fetches no weights). A run resolves once instead (`ResolvedPolicy.prompt_encoder`).

    Raises:
        ValueError: as `resolve_model`; a multimodal checkpoint of a family packrl does not train;
            a multimodal model without its processor's files.
    """
    from packrl.models.model_config import check_text_model, read_model_config

    resolved = resolve_model(cfg.path, weights=False)
    if resolved.gguf_file is not None:
        return tokenizer
    config = read_model_config(resolved, cfg.path)
    check_text_model(config, cfg.path)  # another multimodal family: refused here, before its rows are read
    return prompt_encoder(resolved, config, tokenizer)


def prompt_encoder(resolved: ResolvedModel, config: Any, tokenizer: Any) -> Any:
    """What renders the policy's prompts: ``tokenizer`` for a text model, its modality's processor
    (`packrl.models.modality.Modality.load_processor`) for a multimodal one (``config``: the model
    config, already checked by `packrl.models.model_config.check_text_model`). Reads configs, no weights.

    Raises:
        ValueError: a multimodal model without its processor's files.
    """
    from packrl.models.modality import modality_of

    modality = modality_of(config)
    return tokenizer if modality is None else modality.load_processor(resolved.model_dir, config.model_type, tokenizer)


def load_policy_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer `load_policy` returns for ``cfg``, without loading the weights. A ``.gguf``
    is converted (once, cached) exactly as for `load_policy`, so the ids are the same. A run
    resolves once instead (`resolve_policy`).

    Raises:
        ValueError: as `resolve_model` and `load_tokenizer`.
    """
    return load_tokenizer(resolve_model(cfg.path), cfg.path)


def load_tokenizer(resolved: ResolvedModel, path: str) -> Any:
    """The tokenizer of a resolved model, ready for left-padded batches of chat prompts.

    Args:
        resolved: from `resolve_model`.
        path: the ``model.path`` value, for messages.

    Returns:
        The tokenizer with ``padding_side="left"`` and a pad token (the eos token if it had none).

    Raises:
        ModelConfigFileError: the model's ``config.json`` (which transformers reads to pick the
            tokenizer class) is not valid JSON or has a wrong-typed field
            (`packrl.models.model_config.check_config_file`).
        ValueError: no tokenizer can be loaded, it has no chat template, or no pad/eos token.
    """
    from transformers import AutoTokenizer

    from packrl.models.model_config import check_config_file

    check_config_file(resolved, path)  # else a broken config.json reads as a tokenizer problem
    where = resolved.tokenizer_dir / (resolved.gguf_file or "")
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved.tokenizer_dir, padding_side="left", **resolved.load_kwargs())
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"cannot load the tokenizer of model.path={path!r} from {where}: {first_line(err)}; "
            "put tokenizer.json and tokenizer_config.json beside the model's config.json"
        ) from err
    if not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer of model.path={path!r} ({where}) has no chat template, which packrl needs to render prompts; "
            "add the model's chat_template.jinja (or a chat_template entry in tokenizer_config.json) there, "
            "or set model.path to an instruct/chat model"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer of model.path={path!r} ({where}) has neither a pad nor an eos token; "
                "set pad_token and eos_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reference(policy: torch.nn.Module) -> torch.nn.Module:
    """The reference policy of the KL term: the base model the policy started from.

    Without LoRA, a frozen copy: one more copy of the weights in memory, 4 bytes per parameter
    in float32 (0.54 GB for SmolLM2-135M), no gradients and no optimizer state; call it before
    wrapping the policy (FSDP). With LoRA (a peft ``policy``), the policy itself and no copy:
    its frozen base weights are the reference, and its reference forwards must run under
    `packrl.models.lora.base_policy` (adapters disabled), as `packrl.worker.policy.PolicyWorker` does for the
    ``ref`` role. Either way it shares the policy's tokenizer.

    Args:
        policy: the model from `load_policy`.

    Returns:
        Without LoRA, a deep copy in eval mode with ``requires_grad=False`` everywhere and no
        ``.grad``; with LoRA, ``policy``.
    """
    from packrl.models.lora import is_lora

    if is_lora(policy):
        log.info("reference policy: the LoRA policy with its adapters disabled (no copy)")
        return policy
    ref = copy.deepcopy(policy)
    ref.requires_grad_(False)
    for p in ref.parameters():
        p.grad = None
    ref.eval()
    num_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    log.info("reference policy: a frozen copy, %.2f GiB more weights", num_bytes / 2**30)
    return ref
