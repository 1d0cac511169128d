"""Compiled decoder layers for the training passes (``model.compile``).

Each decoder layer's ``forward`` gets a ``torch.compile`` twin (inductor, dynamic shapes: one
graph serves every pack length). The twins are switched on only inside `CompiledLayers.active`,
which the worker wraps around the log-prob, value and update passes (backward and activation
recomputation included), so generation, which runs the same modules on a KV cache, stays eager.
`CompiledLayers.active` also runs the chunked LM head's softmax math compiled
(`packrl.seqlen.chunked.compiled_math`).

Attention itself is not compiled: packrl's packed attention plans each pack in Python
(`packrl.models.attention`, ``torch.compiler.disable``), so each layer compiles into the part
before attention and the part after it; the norms, RoPE, projections and the MLP's element-wise
ops fuse there. Pack metadata reaches attention as tensors, so new pack layouts reuse the graphs.
On 2 CPU cores this made a GSM8K-sized SmolLM2-135M update 1.38x faster, 1.45x with the LM
head's math compiled too (``python bench/bench_update.py``); the first pass pays the compilation
(30-60 s there; inductor keeps its artifacts on disk, so later runs start faster).

Not with gradient checkpointing: ``torch.utils.checkpoint`` runs its function with dynamo
disabled, so the twins would silently run eagerly (`ModelConfig.compile_blocker`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from packrl.seqlen.chunked import compiled_math


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the first ``ModuleList`` named ``layers`` or ``h``
    (Llama/Qwen/Mistral ``model.layers``, GPT-2 ``transformer.h``; through peft wrappers too).

    Raises:
        ValueError: the model has no such list (``model.compile`` cannot apply; the fix is named).
    """
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h") and len(module):
            return module
    raise ValueError(f"model.compile=true compiles each decoder layer, but {type(model).__name__} has no ModuleList named "
                     "'layers' or 'h'; set model.compile=false for this model")


class CompiledLayers:
    """Compiled twins of ``model``'s decoder layers' ``forward``, used only inside `active`.

    Compilation is lazy: the first forward inside `active` compiles (a second time with dynamic
    shapes when the first lengths change), later forwards reuse the graphs.
    """

    def __init__(self, model: torch.nn.Module):
        self.layers = list(decoder_layers(model))
        self.forwards = [torch.compile(layer.forward, dynamic=True) for layer in self.layers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Every layer runs its compiled ``forward`` inside, and the LM head its compiled softmax
        math; the class's own ``forward`` again after."""
        for layer, forward in zip(self.layers, self.forwards):
            layer.forward = forward
        try:
            with compiled_math():
                yield
        finally:
            for layer in self.layers:
                del layer.forward  # the instance attribute; the class's forward shows again


def active(compiled: CompiledLayers | None) -> contextlib.AbstractContextManager:
    """``compiled.active()``, or nothing to switch when the run does not compile (None)."""
    return compiled.active() if compiled is not None else contextlib.nullcontext()
