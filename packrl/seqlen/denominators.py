"""Loss denominators: the token and sequence counts of a whole mini-batch, counted once (over every
micro-batch and every rank, after every mask) before any loss is formed. Each loss aggregation
mode divides by them (`packrl.algos.loss_agg.aggregate_loss`), which is what makes the loss of a
mini-batch independent of how it is split (invariant 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LossDenominators:
    """Global counts of one mini-batch.

    Attributes:
        num_tokens: loss tokens (True in ``loss_mask``) over the whole mini-batch.
        num_sequences: sequences with at least one loss token.
        loss_scale_factor: the constant C of ``seq-mean-token-sum-norm``, in tokens.
    """

    num_tokens: int
    num_sequences: int
    loss_scale_factor: int

    def __post_init__(self) -> None:
        if self.loss_scale_factor < 1:
            raise ValueError(f"algorithm.loss_scale_factor={self.loss_scale_factor!r} must be a positive integer (tokens)")
        if self.num_tokens < 0 or self.num_sequences < 0 or self.num_sequences > self.num_tokens:
            raise ValueError(
                f"inconsistent denominators: num_tokens={self.num_tokens}, num_sequences={self.num_sequences} "
                "(counts are >= 0 and every counted sequence has a loss token); build them with LossDenominators.from_masks"
            )

    @classmethod
    def from_masks(cls, loss_masks: Sequence[torch.Tensor], loss_scale_factor: int) -> LossDenominators:
        """Count over every sequence's loss mask of the mini-batch.

        Args:
            loss_masks: one mask per sequence, each Shape [R_s] (or [T_s]), bool.
            loss_scale_factor: C of ``seq-mean-token-sum-norm``, tokens.

        Raises:
            ValueError: a mask that is not a 1-D bool tensor, or ``loss_scale_factor`` < 1.
        """
        counts = []
        for i, m in enumerate(loss_masks):
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() != 1:
                raise ValueError(f"loss mask {i} must be a 1-D bool tensor (one per sequence), got {getattr(m, 'dtype', type(m))} "
                                 f"of shape {tuple(getattr(m, 'shape', ()))}")
            counts.append(int(m.sum()))
        if isinstance(loss_scale_factor, bool) or not isinstance(loss_scale_factor, int):
            raise ValueError(f"algorithm.loss_scale_factor={loss_scale_factor!r} must be a positive integer (tokens)")
        return cls(sum(counts), sum(1 for c in counts if c > 0), loss_scale_factor)

    def token_share(self, values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mini-batch's token mean of ``values``: the sum of
        ``values`` at loss tokens over ``num_tokens`` (0 when the mini-batch has none). Summed over
        the micro-batches and ranks of a mini-batch, the shares are the mean over its loss tokens.

        Args:
            values: per token, Shape [K], float (detached for a metric).
            loss_mask: True = the token counts. Shape [K], bool.

        Returns:
            A 0-d float tensor.
        """
        total = torch.where(loss_mask, values.float(), 0.0).sum()
        return total / self.num_tokens if self.num_tokens else total * 0.0
