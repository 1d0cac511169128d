"""LoRA adapters through peft: wrap the policy, run its base model, merge, save and restore.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Eq. 3) replaces the
weight W [out, in] of each targeted Linear by ``W + (alpha / r) B A`` with A [r, in] and
B [out, r]. B starts at zero, so the wrapped model starts as the base model; only A and B train.
The frozen base weights double as the reference policy: forwards run under `base_policy`
(peft's ``disable_adapter``) give the base model's outputs without a second copy of the weights.

Trade-off, SmolLM2-135M with rank 16 on the seven attention and MLP projections: 4.9M
trainable parameters of 139.4M (3.5%), so the AdamW state (8 bytes per trainable parameter)
drops from 1.08 GB to 39 MB and the reference copy (0.54 GB) is gone; each targeted Linear
costs two extra rank-16 matmuls per forward.

A ``peft`` model is ``PeftModel -> LoraModel -> the transformers model``; attribute lookups fall
through to the transformers model, so ``get_decoder()``, ``get_output_embeddings()`` and
``config`` (what `packrl.models.attention.packed_forward` and the chunked LM head use) are the
transformers model's own, with the adapters sitting inside its Linear layers.

Under FSDP2 (`packrl.worker.strategy.FSDP2`) the adapters are sharded with the decoder layer they
sit in, beside its frozen base weights. `merged_weights` takes the function that gathers a
parameter whole, so the rollout engine gets the weights one process gives it; a checkpoint
gathers the `adapter_parameters` alone, and `read_adapter` gives every rank the whole adapter to
shard again.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    # for ``cast``: torch types a module's attributes beyond its own as ``Tensor | Module``
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel
    from transformers import PreTrainedModel

    from packrl.config.schema import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_ALL_LINEAR = "all-linear"
_ADAPTER = "default"  # the adapter's name in peft (`apply_lora` makes one)


def is_lora(model: torch.nn.Module) -> bool:
    """True when ``model`` is a peft model (peft is only imported once something wrapped one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of the model's ``torch.nn.Linear`` modules, the output embedding (LM head) excluded."""
    head = cast("PreTrainedModel", model).get_output_embeddings()
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and module is not head]


def peft_target_modules(model: torch.nn.Module, targets: list[str]) -> str | list[str]:
    """``model.lora.target_modules`` as peft takes it, checked against the model.

    A name matches a Linear whose full name equals it or ends with ``.name`` (peft's rule);
    ``[all-linear]`` passes through as peft's string ``all-linear`` (every Linear except the LM head).

    Raises:
        ValueError: a name matches no Linear module, or matches the LM head (the chunked log-prob
            path needs a plain Linear head); the message lists the model's Linear module names.
    """
    names = [t.strip() for t in targets if t.strip()]
    if names == [_ALL_LINEAR]:
        return _ALL_LINEAR
    linears = linear_module_names(model)
    head = next((n for n, m in model.named_modules() if m is cast("PreTrainedModel", model).get_output_embeddings()), "lm_head")
    on_head = [t for t in names if head == t or head.endswith(f".{t}")]
    unmatched = [t for t in names if t not in on_head and not any(n == t or n.endswith(f".{t}") for n in linears)]
    if on_head or unmatched:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        what = (f"{on_head} would put an adapter on the LM head {head!r}, which packrl's chunked log-prob path reads as a "
                "plain Linear" if on_head else f"{unmatched} match no Linear module of the model")
        raise ValueError(
            f"model.lora.target_modules={targets}: {what}. The model's Linear modules are named {suffixes} "
            f"({len(linears)} in all, e.g. {linears[:3]}); set model.lora.target_modules to some of those names, "
            f"or to [{_ALL_LINEAR}]"
        )
    return names


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters named ``default``; freeze everything else.

    Args:
        model: a transformers causal LM (float32 parameters).
        cfg: the ``model.lora`` section with ``rank > 0``.

    Returns:
        The ``peft.PeftModelForCausalLM``. Its adapters are float32, A Kaiming-uniform and B zero,
        so its outputs equal ``model``'s until the first update. With ``cfg.dropout > 0`` their
        dropout is `packrl.models.lora_dropout.KeyedDropout` (masks that do not depend on the
        micro-batches or ranks), its salts drawn from torch's generator after the A matrices.

    Raises:
        ValueError: ``cfg.rank`` < 1 or a bad target (see `peft_target_modules`).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from packrl.models.lora_dropout import use_keyed_dropout
    from packrl.models.modality import modality_of

    if cfg.rank < 1:
        raise ValueError(f"apply_lora needs model.lora.rank >= 1, got {cfg.rank}; set model.lora.rank=16 (0 = LoRA off)")
    targets = peft_target_modules(model, list(cfg.target_modules))
    # peft annotates lora_alpha as int, but takes a float: its scaling is lora_alpha / r
    # a multimodal model: adapters on its language model only, never in its encoder
    modality = modality_of(cast("PreTrainedModel", model).config)
    exclude = None if modality is None else rf".*\b{modality.encoder_module}\b.*"
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,  # type: ignore[arg-type]
                              target_modules=targets, bias="none", task_type="CAUSAL_LM", exclude_modules=exclude)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, peft_cfg)
    if cfg.dropout > 0:
        use_keyed_dropout(peft_model, cfg.dropout)
    return peft_model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts, tied weights counted once."""
    params = list(model.parameters())  # deduplicated by torch
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def base_policy(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which ``model`` runs as its base model: adapters disabled for a peft model
    (restored on exit), nothing for any other model."""
    return cast("PeftModel", model).disable_adapter() if is_lora(model) else contextlib.nullcontext()


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model whose Linear weights are ``W + (alpha / r) B A`` of ``model``.

    Costs one float32 copy of the weights while it is built. Keep it current with
    `merged_weights`.
    """
    twin = cast("PeftModel", copy.deepcopy(model)).merge_and_unload()
    twin.requires_grad_(True)  # as the base model had them; see packrl.rollout.weights.rollout_copy
    return twin


def _detached(param: torch.Tensor) -> torch.Tensor:
    return param.detach()


@torch.no_grad()
def _merged_weight(module: Any, leaf: str, whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A LoRA layer's base parameter ``leaf``, plus its adapters' delta for the weight: peft's
    ``get_delta_weight``, ``transpose(B @ A, fan_in_fan_out) * scaling`` with ``scaling = alpha / r``
    (Hu et al. 2021, Eq. 3), computed on whole tensors (``whole`` of each parameter), so a sharded
    model merges exactly as an unsharded one."""
    value = whole(getattr(module.get_base_layer(), leaf))
    if leaf != "weight" or module.merged or module.disable_adapters:
        return value
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            delta = whole(module.lora_B[adapter].weight) @ whole(module.lora_A[adapter].weight)  # [out, r] @ [r, in]
            value = value + (delta.T if module.fan_in_fan_out else delta) * module.scaling[adapter]
    return value


def merged_weights(model: torch.nn.Module,
                   whole: Callable[[torch.Tensor], torch.Tensor] = _detached) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``model`` as its plain transformers model would hold them: every parameter
    of the base model by its base name (``model.layers.0.self_attn.q_proj.weight``), the weight of
    each LoRA layer merged (``W + (alpha / r) B A``), the adapters themselves left out. These are
    the names and values of `merged_copy`'s parameters (tied weights under each of their names).

    Args:
        whole: the whole tensor of a parameter (detached); under FSDP2 its shards gathered
            (``DTensor.full_tensor``, a collective: every rank iterates in the same order).
    """
    from peft.tuners.lora import LoraLayer

    base = cast("PeftModel", model).get_base_model()
    adapted: list[str] = []
    for name, module in base.named_modules():
        if any(name.startswith(f"{owner}.") for owner in adapted):
            continue  # a LoRA layer's base layer and adapters
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer):
            adapted.append(name)
            for leaf, _ in module.get_base_layer().named_parameters(recurse=False):
                yield f"{prefix}{leaf}", _merged_weight(module, leaf, whole)
            continue
        for leaf, param in module.named_parameters(recurse=False):
            yield f"{prefix}{leaf}", whole(param)


def adapter_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The adapter parameters (A and B of every LoRA layer) of a model `apply_lora` wrapped, by
    their names in the model (``...q_proj.lora_A.default.weight``): what trains, and what a
    checkpoint holds."""
    return ((name, param) for name, param in model.named_parameters() if "lora_" in name)


def read_adapter(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter (``adapter_model.safetensors``), keyed by the names of ``model``'s
    adapter parameters (`adapter_parameters`) and checked against them. peft writes each tensor
    without the adapter's name (``...q_proj.lora_A.weight`` for ``...q_proj.lora_A.default.weight``,
    ``get_peft_model_state_dict``); this puts it back.

    Raises:
        ValueError: ``path`` holds no adapter; its ``adapter_config.json`` has another rank, alpha
            or target set than ``model`` (named with the ``model.lora.*`` keys to set); or its
            tensors do not cover every adapter parameter of ``model``, or hold others.
    """
    from safetensors.torch import load_file

    if not (path / ADAPTER_WEIGHTS).is_file() or not (path / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{path} holds no LoRA adapter ({ADAPTER_WEIGHTS} and {ADAPTER_CONFIG} expected), but model.lora.rank > 0; "
                         "set model.lora.rank=0 to load a full-weight checkpoint, or point at a checkpoint of a LoRA run")
    saved = json.loads((path / ADAPTER_CONFIG).read_text())
    ours = adapter_config(model)
    for key, cfg_key in (("r", "rank"), ("lora_alpha", "alpha")):
        if saved.get(key) != getattr(ours, key):
            raise ValueError(f"{path} holds an adapter with {key}={saved.get(key)}, but this model has {getattr(ours, key)}; "
                             f"set model.lora.{cfg_key}={saved.get(key)} to load it")
    if _as_set(saved.get("target_modules")) != _as_set(ours.target_modules):
        raise ValueError(f"{path} holds adapters on {saved.get('target_modules')}, but this model has them on {ours.target_modules}; "
                         f"set model.lora.target_modules to the checkpoint's")
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    names = {name.replace(f".{_ADAPTER}", ""): name for name, _ in adapter_parameters(model)}
    missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or unexpected:
        raise ValueError(f"{path}/{ADAPTER_WEIGHTS} does not match the model's adapters: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}; load it with the model.lora.* settings of its run")
    return {names[key]: value for key, value in tensors.items()}


def load_adapter(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's adapter (`read_adapter`) into an unsharded ``model`` in place, exactly.

    Raises:
        ValueError: see `read_adapter`.
    """
    model.load_state_dict(read_adapter(model, path), strict=False)


def adapter_config(model: torch.nn.Module) -> PeftLoraConfig:
    """The peft ``LoraConfig`` of the ``default`` adapter of a model `apply_lora` wrapped."""
    return cast("PeftLoraConfig", cast("PeftModel", model).peft_config[_ADAPTER])


def _as_set(targets: Any) -> Any:
    return set(targets) if isinstance(targets, (list, tuple, set)) else targets
