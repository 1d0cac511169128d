"""Loss aggregation with global denominators, so splitting a mini-batch never changes its loss.

Shapes: ``M`` tokens in a micro-batch (packed, flat) · ``N`` sequences · ``R`` response tokens.

The four modes and their meanings follow verl's ``loss_agg_mode`` (``core_algos.agg_loss``):

==========================  ==================================================================
token-mean                  sum_{s,t} l*m / T            (T = loss tokens in the mini-batch; DAPO)
seq-mean-token-sum          sum_{s,t} l*m / S            (S = sequences with >= 1 loss token)
seq-mean-token-mean         sum_s [sum_t l*m / n_s] / S  (n_s = loss tokens of s; original GRPO)
seq-mean-token-sum-norm     sum_{s,t} l*m / (S * C)      (C constant; Dr. GRPO, arXiv 2503.20783)
==========================  ==================================================================

Each mode is a sum of per-sequence terms over denominators counted once for the whole
mini-batch (every micro-batch, every rank, after every mask). Summing the micro-batch and rank
results therefore gives exactly the full-batch value: gradients across ranks must be summed,
not averaged (or multiply by the rank count before an averaging all-reduce). A micro-batch whose
tokens are all masked contributes exactly 0.

Against verl 0.9.1's ``agg_loss``: its token-mean is split-invariant too (its engine all-reduces
the mini-batch's token count, ``batch_num_tokens``), so T agrees. Its sequence-mean modes divide
by ``global_batch_size`` = the mini-batch's sequences (prompts x n), counting sequences whose
tokens are all masked (cut under ``truncated=mask``, rejected by rollout correction, filtered by
entropy); here S counts only sequences with a loss token, so a masked response does not dilute
the others' weight (docs/verl.md, deliberate differences). verl's default C for sum-norm is the
padded width, which changes with batching; here C is a constant.
"""

from __future__ import annotations

from typing import get_args

import torch

from packrl.config.schema import LossAggMode
from packrl.seqlen.denominators import LossDenominators

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


def aggregate_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: LossAggMode,
    denominators: LossDenominators,
    *,
    sequence_ids: torch.Tensor | None = None,
    sequence_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    Args:
        token_loss: per-token loss. Shape [M] (packed; give ``sequence_ids``) or [N, R]
            (rows are sequences), float.
        loss_mask: True = the token counts in the loss. Same shape, bool. Masked positions may
            hold anything (even NaN): they are never read.
        mode: one of `LOSS_AGG_MODES` (``algorithm.loss_agg_mode``).
        denominators: the whole mini-batch's `LossDenominators`.
        sequence_ids: for [M] input, the sequence of each token. Shape [M], int64. A sequence
            must lie entirely inside one micro-batch.
        sequence_counts: loss tokens of each sequence over the whole micro-batch, Shape [S]
            (S = the number of sequences ``sequence_ids`` numbers), for ``seq-mean-token-mean``
            when ``loss_mask`` holds only part of them (a sequence-parallel rank's tokens, a
            trajectory's samples); default: counted from ``loss_mask``. Given, the function reads
            nothing back to the host (no device synchronisation).

    Returns:
        A scalar tensor, differentiable w.r.t. ``token_loss``.

    Raises:
        ValueError: unknown mode, mismatched shapes, a non-bool mask, or [M] input without
            ``sequence_ids``. (Denominators must count the whole mini-batch, every micro-batch and
            rank: `LossDenominators.from_masks`; that is not re-checked here, which would cost a
            device synchronisation per call.)
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode={mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if token_loss.shape != loss_mask.shape:
        raise ValueError(f"token_loss {tuple(token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    if token_loss.dim() == 2:
        sequence_ids = torch.arange(token_loss.shape[0], device=token_loss.device)[:, None].expand_as(token_loss)
    elif sequence_ids is None or sequence_ids.shape != token_loss.shape:
        raise ValueError("packed [M] token_loss needs sequence_ids of the same shape")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be bool (True = counts in the loss), got {loss_mask.dtype}")
    mask = loss_mask
    loss = torch.where(mask, token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device))
    total = loss.sum()  # exactly 0 for a fully masked micro-batch; nothing is read back to the host here
    if denominators.num_tokens == 0:
        return total * 0.0
    if mode == "token-mean":
        return total / denominators.num_tokens
    if mode == "seq-mean-token-sum":
        return total / denominators.num_sequences
    if mode == "seq-mean-token-sum-norm":
        return total / (denominators.num_sequences * denominators.loss_scale_factor)
    seq = sequence_ids.reshape(-1)
    num_seqs = sequence_counts.shape[0] if sequence_counts is not None else int(seq.max()) + 1
    seq_sum = loss.new_zeros(num_seqs).index_add(0, seq, loss.reshape(-1))
    if sequence_counts is None:
        seq_count = loss.new_zeros(num_seqs).index_add(0, seq, mask.reshape(-1).to(loss.dtype))
    else:
        seq_count = sequence_counts.to(loss)
    per_seq = torch.where(seq_count > 0, seq_sum / seq_count.clamp(min=1), torch.zeros_like(seq_sum))
    return per_seq.sum() / denominators.num_sequences
