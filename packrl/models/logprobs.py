"""Per-token log-probs and entropy of a pack: packed forward + chunked LM head.

Shapes: ``K`` tokens in a pack · ``S`` sequences · ``L_i`` tokens of sequence i.

Output alignment: ``token_logprobs[k]`` is log p(x_k | x_<k) of token k under its own sequence's
prefix, so a sequence's response log-probs are simply its last R entries. The first token of
each sequence has no prefix: its entry is 0 and ``has_logprob`` is False there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from packrl.models import ulysses
from packrl.models.attention import PackedAttention, packed_forward, sharded_forward
from packrl.seqlen.chunked import chunked_logprobs
from packrl.seqlen.packing import Pack

if TYPE_CHECKING:
    # for ``cast``: torch types a module's attributes beyond its own as ``Tensor | Module``
    from transformers import PreTrainedModel

_UNSUPPORTED_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class PackLogprobs:
    """Log-probs and entropy of every token of a pack.

    Attributes:
        token_logprobs: log p(x_k | x_<k). Shape [K], float32, nats; 0 at sequence starts.
        entropy: entropy of the distribution that produced x_k. Shape [K], float32, nats;
            0 at sequence starts. Carries grad only when asked for.
        has_logprob: True where a log-prob was computed: every token but each sequence's first
            (only the ``needed`` ones when asked; under sequence parallelism only those this
            rank's hidden states predict). Shape [K], bool.
    """

    token_logprobs: torch.Tensor
    entropy: torch.Tensor
    has_logprob: torch.Tensor


def _lm_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    for key in _UNSUPPORTED_HEAD_KEYS:
        if getattr(model.config, key, None) not in (None, 0, 0.0, 1.0):
            raise ValueError(f"the model config sets {key}={getattr(model.config, key)!r}, which the chunked LM head does not apply yet")
    head = cast("PreTrainedModel", model).get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the model's output embedding is {type(head).__name__}, not a Linear LM head")
    return head.weight, head.bias


FSDP_FORWARD = "packrl_pack_logprobs"
"""The model method `enable_fsdp_forward` registers with FSDP2 as a forward method."""


def enable_fsdp_forward(model: torch.nn.Module) -> None:
    """Let `pack_logprobs` run on an FSDP2-sharded ``model``: it calls the decoder and the LM head
    weight directly (not ``model.forward``), so the computation is attached to the model as a
    method FSDP treats as a forward (``register_fsdp_forward_method``): the root's parameters
    (embeddings, final norm, LM head) are gathered around it and its gradients reduced after it."""
    import functools

    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, FSDP_FORWARD, functools.partial(_pack_logprobs, model))
    register_fsdp_forward_method(model, FSDP_FORWARD)


def pack_logprobs(
    model: torch.nn.Module,
    pack: Pack,
    *,
    attention: PackedAttention = "varlen",
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    needed: torch.Tensor | None = None,
) -> PackLogprobs:
    """Forward a pack and compute every token's log-prob and entropy without ``K x V`` logits.

    Args:
        model: a transformers causal LM with a Linear LM head.
        pack: the `Pack` on the model's device.
        attention: ``model.packed_attention``.
        chunk_tokens: ``train.logits_chunk_tokens``.
        temperature: the sampling temperature the responses were drawn with.
        entropy_grad: let gradients flow through the entropy.
        needed: True at the tokens whose log-prob and entropy are wanted (e.g. response
            tokens). Shape [K], bool; None = every token. The LM head (a ``V``-wide matmul and
            log-sum-exp per token, about a fifth of a 135M model's forward) then runs only on
            the hidden states that predict them; other tokens get 0 and ``has_logprob`` False.

    Returns:
        `PackLogprobs`; differentiable w.r.t. the model's parameters when grad is enabled.

    Raises:
        ValueError: an unsupported LM head or attention implementation.
    """
    kwargs: dict[str, Any] = dict(attention=attention, chunk_tokens=chunk_tokens, temperature=temperature, entropy_grad=entropy_grad,
                                  needed=needed)
    sharded = getattr(model, FSDP_FORWARD, None)
    return PackLogprobs(*(sharded(pack, **kwargs) if sharded is not None else _pack_logprobs(model, pack, **kwargs)))


def _pack_logprobs(model: torch.nn.Module, pack: Pack, *, attention: PackedAttention, chunk_tokens: int, temperature: float,
                   entropy_grad: bool, needed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_logprobs` as plain tensors ``(token_logprobs, entropy, has_logprob)`` (what FSDP's
    forward hooks can follow)."""
    weight, bias = _lm_head(model)
    ids = pack.input_ids[0]
    sources, targets = pack.predictions()  # position sources[m] scores token targets[m] (`Pack.predictions`)
    if needed is not None:
        if needed.shape != ids.shape:
            raise ValueError(f"needed has shape {tuple(needed.shape)}; expected [{ids.shape[0]}], one flag per packed token")
        keep = needed[targets]
        sources, targets = sources[keep], targets[keep]
    sp = ulysses.active()
    if sp is None:
        hidden, start = packed_forward(model, pack, attention), 0  # [K, H]
    else:  # this rank's tokens of the padded pack: the predictions its hidden states make
        hidden, (start, end) = sharded_forward(model, pack, sp), sp.bounds(pack.num_tokens)  # [n, H]
        mine = (sources >= start) & (sources < end)
        sources, targets = sources[mine], targets[mine]
    logprobs, entropy = chunked_logprobs(
        hidden[sources - start], weight, ids[targets], bias=bias, chunk_tokens=chunk_tokens, temperature=temperature,
        entropy_grad=entropy_grad,
    )
    # The log-prob of token k sits at k.
    token_logprobs = logprobs.new_zeros(ids.shape[0]).index_put((targets,), logprobs)
    token_entropy = entropy.new_zeros(ids.shape[0]).index_put((targets,), entropy)
    has_logprob = torch.zeros_like(ids, dtype=torch.bool).index_fill_(0, targets, True)
    return token_logprobs, token_entropy, has_logprob
