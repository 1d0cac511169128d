"""Log-probs and entropy from hidden states and the LM head, ``chunk`` tokens at a time.

Shapes: ``K`` tokens · ``H`` hidden size · ``V`` vocabulary · ``c`` tokens per chunk.

Full logits cost ``K x V`` floats: 1.5 GiB in float32 for K = 8,192 and V = 49,152, and autograd
keeps them (and their softmax) for backward. Here the forward keeps only the per-token
log-sum-exp; the backward recomputes each chunk's logits, so neither pass holds more than one
chunk of ``c x V`` logits (plus the softmax of that chunk). The gradient is exact:
d logp_t / d z = onehot(y_t) - softmax(z_t), and for entropy H_t = -sum p log p,
d H_t / d z = -p * (log p + H_t).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

_DEFAULT_CHUNK = 1024


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax math runs in float32 at least (float64 models keep float64)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, temperature, entropy_grad):
        num_tokens, dtype = hidden.shape[0], _math_dtype(hidden.dtype)
        logprobs = hidden.new_empty(num_tokens, dtype=dtype)
        entropy = hidden.new_empty(num_tokens, dtype=dtype)
        lse = hidden.new_empty(num_tokens, dtype=dtype)
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.compiled = _COMPILED.get()
        forward_math = _compiled_math()[0] if ctx.compiled else _forward_math
        matmul_hidden, matmul_weight = _matmul_operands(hidden, weight, ctx.autocast[1])
        buffer = matmul_weight.new_empty(min(chunk, num_tokens), weight.shape[0])
        for s in range(0, num_tokens, chunk):
            e = min(s + chunk, num_tokens)
            logits = _chunk_logits(matmul_hidden[s:e], matmul_weight, buffer)
            logprobs[s:e], entropy[s:e], lse[s:e] = forward_math(logits, bias, labels[s:e], temperature)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.chunk, ctx.temperature, ctx.entropy_grad = chunk, temperature, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        return _backward(ctx, grad_logprobs, grad_entropy)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """One chunk's ``hidden @ weight.T`` [c, V] in the matmul dtype, written into the first c rows of
    ``buffer`` [min(chunk, K), V], which every chunk of a pass reuses: on CPU a fresh c x V tensor
    per chunk pays its page faults again each time. The math functions may overwrite it."""
    return torch.mm(hidden, weight.t(), out=buffer[: hidden.shape[0]])


def _math_logits(logits: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``(logits + bias) / temperature`` in float32 or wider; may alias ``logits``."""
    dtype = _math_dtype(logits.dtype)
    z = logits.to(dtype) if bias is None else logits.to(dtype) + bias.to(dtype)
    return z.div_(temperature) if temperature != 1.0 else z


def _forward_math(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's ``(log p of each label, entropy, log-sum-exp)``, each [c] in float32 or wider,
    from its matmul output [c, V] (which it may overwrite)."""
    z = _math_logits(logits, bias, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(1, labels[:, None]).squeeze(1) - lse
    z.sub_(lse[:, None])  # z is now log p
    entropy = -z.exp().mul_(z).sum(-1)  # -sum p log p; the product reuses exp's buffer
    return logprobs, entropy, lse


def _grad_logits(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's gradient with respect to its matmul output, in that output's dtype [c, V], and
    with ``bias_grad`` its column sums in float32 or wider [V] (the bias gradient)."""
    logp = _math_logits(logits, bias, temperature).sub_(lse[:, None])
    g = grad_logprobs[:, None]
    if grad_entropy is not None:
        p = logp.exp()
        # d/dz of g*logp_y + gH*H  =  g*(onehot - p) - gH*p*(logp + H)
        dz = logp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None]).sub_(p.mul_(g))
    else:
        dz = logp.exp_().mul_(-g)
    dz.scatter_add_(1, labels[:, None], g)
    if temperature != 1.0:
        dz.div_(temperature)
    return dz.to(logits.dtype), (dz.sum(0) if bias_grad else None)


def _grad_logits_fused(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                       grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float,
                       bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_grad_logits` without in-place ops or a scatter, so that compiled it is one element-wise
    pass over the chunk (the in-place form saves eager allocations but splits a compiled graph)."""
    logp = _math_logits(logits, bias, temperature) - lse[:, None]
    p = logp.exp()
    g = grad_logprobs[:, None]
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels[:, None]
    dz = torch.where(onehot, g, 0.0) - p * g
    if grad_entropy is not None:
        dz = dz - grad_entropy[:, None] * p * (logp + entropy[:, None])
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(logits.dtype), (dz.sum(0) if bias_grad else None)


_COMPILED: contextvars.ContextVar[bool] = contextvars.ContextVar("packrl_compiled_lm_head_math", default=False)


@functools.cache
def _compiled_math() -> tuple:
    """``torch.compile`` twins of `_forward_math` and `_grad_logits_fused` (inductor, dynamic
    shapes): each reads a chunk's logits in one to three fused passes instead of one pass per
    element-wise op (SmolLM2's 49,152-token vocabulary on 2 CPU cores, ``bench_chunked_logprobs``)."""
    return torch.compile(_forward_math, dynamic=True), torch.compile(_grad_logits_fused, dynamic=True)


@contextlib.contextmanager
def compiled_math() -> Iterator[None]:
    """Inside, `chunked_logprobs` runs its softmax math compiled (`_compiled_math`); a backward
    uses what its forward used. Values equal the eager math's up to float rounding (fused
    reductions sum in another order). Part of ``model.compile`` (`packrl.models.compile`)."""
    token = _COMPILED.set(True)
    try:
        yield
    finally:
        _COMPILED.reset(token)


def _autocast_state(device: str) -> tuple[str, torch.dtype | None]:
    """``(device type, autocast dtype)``; the dtype is None where autocast is off."""
    return device, (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)


def _matmul_operands(hidden: torch.Tensor, weight: torch.Tensor, autocast_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` and ``weight`` in the dtype their matmuls run in: autocast's under autocast
    (which casts every floating dtype but float64 for a built-in matmul), else their own.
    Cast once per pass rather than by autocast once per chunk and matmul; the backward uses the
    forward's autocast state, as autograd runs a built-in matmul's backward in the forward's dtype
    (backward is called outside the autocast region)."""
    if autocast_dtype is None or weight.dtype == torch.float64:
        return hidden, weight
    return hidden.to(autocast_dtype), weight.to(autocast_dtype)


def _backward(ctx, grad_logprobs, grad_entropy):
    hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
    grad_math = _compiled_math()[1] if ctx.compiled else _grad_logits
    matmul_hidden, matmul_weight = _matmul_operands(hidden, weight, ctx.autocast[1])
    grad_entropy = grad_entropy if ctx.entropy_grad else None
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    acc = _math_dtype(weight.dtype)
    grad_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
    grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    buffer = matmul_weight.new_empty(min(ctx.chunk, hidden.shape[0]), weight.shape[0])
    for s in range(0, hidden.shape[0], ctx.chunk):
        e = min(s + ctx.chunk, hidden.shape[0])
        logits = _chunk_logits(matmul_hidden[s:e], matmul_weight, buffer)
        dz, dz_sum = grad_math(logits, bias, labels[s:e], lse[s:e], entropy[s:e], grad_logprobs[s:e],
                               None if grad_entropy is None else grad_entropy[s:e], ctx.temperature, grad_bias is not None)
        if grad_bias is not None:
            grad_bias.add_(dz_sum)
        if grad_hidden is not None:
            grad_hidden[s:e] = dz @ matmul_weight
        if grad_weight is not None:
            grad_weight.add_(dz.t() @ matmul_hidden[s:e])
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = _DEFAULT_CHUNK,
    temperature: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and the entropy of each token's distribution, chunk by chunk.

    Equal to ``log_softmax(hidden @ weight.T + bias) / temperature)`` gathered at ``labels``
    (and its entropy), values and gradients, without materialising ``K x V`` logits.

    Args:
        hidden: final hidden states (after the last norm). Shape [K, H], model dtype.
        weight: LM head weight. Shape [V, H], model dtype (tied embeddings work).
        labels: target token at each position. Shape [K], int64, values in [0, V).
        bias: LM head bias, Shape [V], or None.
        chunk_tokens: tokens per chunk c (``train.logits_chunk_tokens``); logits buffers peak
            at about 2 x c x V floats, on top of the LM-head weight gradient.
        temperature: logits are divided by it (the sampling temperature).
        entropy_grad: let gradients flow through the entropy (for an entropy bonus). By default
            the entropy is returned without grad.

    Returns:
        ``(logprobs, entropy)``, each Shape [K], float32 (float64 for float64 models), nats.

    Raises:
        ValueError: mismatched shapes or dtypes, labels that are not integer ids in [0, V),
            ``chunk_tokens`` < 1 or ``temperature`` <= 0. Double backward is not supported.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [K, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [K] = [{hidden.shape[0]}]; got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ValueError(f"labels must lie in [0, V={weight.shape[0]}); got min {int(labels.min())}, max {int(labels.max())}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype; run under autocast or cast one")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}]; got {tuple(bias.shape)}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"train.logits_chunk_tokens={chunk_tokens!r} must be a positive integer")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    return _ChunkedLogprobs.apply(hidden, weight, bias, labels.long(), chunk_tokens, float(temperature), entropy_grad)


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the same values through full ``[K, V]`` logits (benchmarks and tests)."""
    logits = _math_logits(hidden @ weight.t(), bias, temperature)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, labels[:, None].long()).squeeze(1), entropy
