"""Packing: sequences concatenated into one row without padding, and back.

Shapes: ``S`` sequences in a pack · ``K`` tokens in the pack · ``L_i`` tokens of sequence i.

A pack carries what every attention path needs to keep its sequences apart: ``cu_seqlens``
for varlen kernels, ``position_ids`` restarting at 0 for RoPE and for transformers' packed-mask
detection, and, on request, an explicit block-diagonal causal mask. Packing removes padding
entirely (pad fraction 0); the cost moves to making attention respect the boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pack:
    """One packed row of ``S`` sequences, ``K`` tokens in all.

    Attributes:
        input_ids: token ids. Shape [1, K], int64.
        position_ids: position of each token within its own sequence, restarting at 0.
            Shape [1, K], int64.
        cu_seqlens: cumulative sequence starts, ``cu_seqlens[i]`` = first token of sequence i
            and ``cu_seqlens[S] = K``. Shape [S + 1], int32 (flash-attn's convention).
        indices: for each packed sequence, its index in the caller's input list.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def seq_lens(self) -> list[int]:
        return torch.diff(self.cu_seqlens).tolist()

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens)

    def to(self, device: torch.device | str) -> Pack:
        return Pack(self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device), self.indices)

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split per-token ``values`` back into per-sequence tensors, in pack order.

        Args:
            values: Shape [K, ...] or [1, K, ...].

        Returns:
            S tensors, the i-th of shape [L_i, ...] (views of ``values``).

        Raises:
            ValueError: the token dimension is not K.
        """
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == self.num_tokens:
            values = values[0]
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"values have {values.shape[0]} tokens on dim 0 but the pack has {self.num_tokens}")
        return list(torch.split(values, self.seq_lens, dim=0))

    def sequence_ids(self) -> torch.Tensor:
        """Index of the packed sequence each token belongs to. Shape [K], int64, values 0..S-1."""
        lens = torch.diff(self.cu_seqlens).to(torch.int64)
        return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)

    def block_causal_mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """Block-diagonal causal attention mask: token q may attend to token k iff both are in
        the same sequence and k <= q.

        Args:
            dtype: ``torch.bool`` (True = may attend; for SDPA) or a float dtype (0 where
                allowed, the dtype's minimum elsewhere; for eager attention).

        Returns:
            Shape [1, 1, K, K]. Memory is K^2 elements: 64 MiB as bool at K = 8,192.
        """
        seq = self.sequence_ids()
        pos = torch.arange(self.num_tokens, device=seq.device)
        allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
        allowed = allowed[None, None]
        if dtype == torch.bool:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    def next_token_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels for next-token log-probs: position k predicts token k + 1 of the same sequence.

        Returns:
            ``(labels, has_label)``: labels Shape [K], int64 (0 where there is none);
            has_label Shape [K], bool, False at the last token of every sequence.
        """
        ids = self.input_ids[0]
        labels = torch.zeros_like(ids)
        labels[:-1] = ids[1:]
        has_label = torch.ones_like(ids, dtype=torch.bool)
        has_label[self.cu_seqlens[1:].to(torch.int64) - 1] = False
        labels[~has_label] = 0
        return labels, has_label


def _as_ids(seq: torch.Tensor | Sequence[int], i: int) -> torch.Tensor:
    t = torch.as_tensor(seq)
    if t.dim() != 1:
        raise ValueError(f"sequence {i} must be 1-D token ids, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise ValueError(f"sequence {i} must hold integer token ids, got {t.dtype}")
    return t.to(torch.int64)


def pack_sequences(sequences: Sequence[torch.Tensor | Sequence[int]], indices: Sequence[int] | None = None) -> Pack:
    """Concatenate sequences into one `Pack`.

    Args:
        sequences: S token-id sequences, each Shape [L_i] int (tensor or list), L_i >= 1.
        indices: the caller's index of each sequence (default 0..S-1), kept for restoring order.

    Returns:
        The `Pack`, K = sum(L_i).

    Raises:
        ValueError: no sequences, an empty, non-1-D or non-integer sequence, or ``indices`` of
            another length or with repeats.
    """
    if len(sequences) == 0:
        raise ValueError("cannot pack an empty list of sequences")
    ids = [_as_ids(s, i) for i, s in enumerate(sequences)]
    lens = [len(t) for t in ids]
    if min(lens) < 1:
        raise ValueError(f"sequence {lens.index(min(lens))} has length 0; every packed sequence needs >= 1 token")
    indices = tuple(range(len(ids))) if indices is None else tuple(int(i) for i in indices)
    if len(indices) != len(ids):
        raise ValueError(f"got {len(indices)} indices for {len(ids)} sequences")
    if len(set(indices)) != len(indices):
        raise ValueError(f"indices {list(indices)} repeat a sequence; each packed sequence needs its own index")
    device = ids[0].device
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lens, device=device), 0)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lens])
    return Pack(torch.cat(ids)[None], position_ids[None], cu, indices)
