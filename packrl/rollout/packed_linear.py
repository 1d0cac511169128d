"""Linear layers with pre-packed bf16 weights for the HF engine's generation on CPU.

A plain bf16 ``F.linear`` on CPU hands oneDNN a weight in PyTorch's row-major layout, and oneDNN
reorders it into its blocked layout (the one its AMX and AVX-512 bf16 kernels read) on every call.
In a decode step a layer's matmul has only a few rows per weight, so that reorder is a large share
of the call: on 2 CPU cores with AMX, a 16 x 576 by 576 x 576 bf16 matmul took 52 us plain and
35 us with the weight reordered beforehand, the 49,152 x 576 LM head 3.4 ms against 2.0 ms.
`packed_linears` reorders every ``nn.Linear`` weight of the engine's model once per ``generate``
call (``torch.ops.mkldnn._reorder_linear_weight``, as inductor's CPU weight prepacking does) and
runs the layers on the packed copies (``torch.ops.mkldnn._linear_pointwise``) until the call ends.
The products are the same up to bf16 rounding (accumulation order), and the policy's new weights
reach the next call, which packs them again. Cost: 0.11-0.12 s (``pack_s``) and one more bf16 copy of the
weights (0.27 GB for SmolLM2-135M) per call. On GSM8K-shaped work (16 rows, SmolLM2-135M, 2 cores
with AMX) a decode step took a median 70.2 ms against 79.1 ms plain (1.13x), and ``generate``
1.12x less time per response token (``python bench/bench_decode.py``).

Only where it applies: a CPU model whose ``nn.Linear`` weights are bf16 on a build whose oneDNN
runs bf16 (`packs`); elsewhere (CUDA, float32, Linear subclasses such as quantized layers) the
layers run unchanged, and so does a call whose input is not bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def packs(model: torch.nn.Module) -> bool:
    """Whether `packed_linears` changes anything for ``model``: it has plain ``nn.Linear`` layers
    with bf16 weights on the CPU, and this torch build's oneDNN runs bf16 matmuls."""
    return bool(_linears(model)) and _onednn_bf16()


def _onednn_bf16() -> bool:
    """Whether this torch build's oneDNN runs bf16 matmuls on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain ``nn.Linear`` layers (not subclasses) with bf16 CPU weights (and bf16 bias, if any)."""
    return [
        module for module in model.modules()
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"
        and (module.bias is None or module.bias.dtype == torch.bfloat16)
    ]


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, num_rows: int) -> Iterator[None]:
    """Inside, every bf16 ``nn.Linear`` of ``model`` on the CPU multiplies by a packed copy of its
    weight, taken on entry; on exit (also on an error) the layers run their own ``forward`` again
    and the copies go. Nothing changes where `packs` is False. A layer that already has a
    ``forward`` of its own (a hook's wrapper, or an enclosing `packed_linears`) is left as it is,
    so the context nests. Calls with gradients enabled, or with a non-bf16 input, run the plain
    layer (the packed op has no backward). Weights must not change inside.

    Args:
        model: the model generation runs on.
        num_rows: the matmuls' typical row count (decode: the rows of a generation batch), which
            oneDNN may use to pick a layout; any row count gives the same products.
    """
    layers = [layer for layer in _linears(model) if "forward" not in layer.__dict__] if _onednn_bf16() else []
    patched: list[torch.nn.Linear] = []
    try:
        for layer in layers:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), max(1, num_rows))
            # an instance attribute shadowing the class's forward (deleted below), hence setattr
            setattr(layer, "forward", _packed_forward(layer, packed))
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward  # the instance attribute; nn.Linear's forward shows again


def _packed_forward(layer: torch.nn.Linear, packed: torch.Tensor):
    """``layer``'s forward on ``packed`` (its weight in oneDNN's layout): x [..., in] -> [..., out]."""
    bias = None if layer.bias is None else layer.bias.detach()
    plain = type(layer).forward.__get__(layer)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or torch.is_grad_enabled():  # autocast, dtype errors, gradients: as nn.Linear
            return plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward
