"""Packing: sequences concatenated into one row without padding, and back.

Shapes: ``S`` sequences in a pack · ``K`` tokens in the pack · ``L_i`` tokens of sequence i.

A pack carries what every attention path needs to keep its sequences apart: ``cu_seqlens``
for varlen kernels, ``position_ids`` restarting at 0 for RoPE and for transformers' packed-mask
detection, and, on request, an explicit block-diagonal causal mask. Packing removes padding
entirely (pad fraction 0); the cost moves to making attention respect the boundaries.

Shared prompts (`pack_shared`): sequences that follow each other with the same prompt ids (a
GRPO group) hold that prompt once. The pack's segments are then a prompt segment and one
segment per response; a response segment attends to its prompt segment and causally to itself,
its positions continue from the prompt's, and the prompt's last position predicts the first
token of every response of the group. A sequence's values live in its own segment
(`Pack.unpack`), its response being that segment's last ``R_i`` tokens either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from packrl.types import ExtraInputs


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
        prefix_of: per segment of ``cu_seqlens``, the segment it attends to before itself (its
            shared prompt), -1 for none; None = no shared prompts (every segment a sequence).
        owners: per segment, the position in ``indices`` of the sequence whose own segment it
            is, -1 for a shared prompt segment; None = segment i is sequence i.
        extra_inputs: per packed sequence (in pack order), its prompt's inputs beyond its ids
            (`packrl.types.ExtraInputs`) or None; None = a text pack. Sequences of one prompt
            hold the same object, which the packed forward encodes once.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: tuple[int, ...]
    prefix_of: tuple[int, ...] | None = None
    owners: tuple[int, ...] | None = None
    extra_inputs: tuple[ExtraInputs | None, ...] | None = None

    @property
    def shares_prompts(self) -> bool:
        return self.prefix_of is not None and any(p >= 0 for p in self.prefix_of)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def seq_lens(self) -> list[int]:
        return torch.diff(self.cu_seqlens).tolist()

    def grouped_loads(self) -> dict[str, int]:
        """Per load name, what the pack's forward encodes (`ExtraInputs.grouped_loads`): each
        distinct inputs object once; empty for a text pack."""
        out: dict[str, int] = {}
        for x in {id(x): x for x in self.extra_inputs or () if x is not None}.values():
            for name, load in x.grouped_loads().items():
                out[name] = out.get(name, 0) + load
        return out

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens)

    def to(self, device: torch.device | str) -> Pack:
        """The pack on ``device``; sequences that shared an `ExtraInputs` object still share one."""
        moved: dict[int, ExtraInputs] = {}
        for x in self.extra_inputs or ():
            if x is not None and id(x) not in moved:
                moved[id(x)] = x.to(device)
        extra = None if self.extra_inputs is None else tuple(None if x is None else moved[id(x)] for x in self.extra_inputs)
        return Pack(self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device), self.indices,
                    self.prefix_of, self.owners, extra)

    def segment_owners(self) -> tuple[int, ...]:
        """Per segment, the sequence (position in ``indices``) it belongs to, -1 for a shared prompt."""
        return self.owners if self.owners is not None else tuple(range(len(self.indices)))

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
        parts = torch.split(values, self.seq_lens, dim=0)
        if self.owners is None:
            return list(parts)
        return [part for part, owner in zip(parts, self.owners) if owner >= 0]  # own segments, in sequence order

    def sequence_ids(self) -> torch.Tensor:
        """Index of the packed sequence each token belongs to. Shape [K], int64, values 0..S-1
        (a shared prompt's tokens count as its first sequence's; they carry no loss)."""
        lens = torch.diff(self.cu_seqlens).to(torch.int64)
        owners = list(self.segment_owners())
        for s in range(len(owners) - 1, -1, -1):  # a prompt segment takes the sequence after it
            if owners[s] < 0:
                owners[s] = owners[s + 1]
        return torch.repeat_interleave(torch.tensor(owners, device=lens.device), lens)

    def predictions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Which position predicts which token: ``(sources, targets)``, Shape [M] int64 each:
        position ``sources[m]``'s hidden state scores token ``targets[m]`` (the previous token of
        its segment; for a response's first token, its shared prompt's last one). Every token
        but each sequence's first is a target exactly once."""
        device = self.input_ids.device
        cu = self.cu_seqlens.to(device=device, dtype=torch.long)
        has_previous = torch.ones(self.num_tokens, dtype=torch.bool, device=device)
        has_previous[cu[:-1]] = False
        targets = has_previous.nonzero().squeeze(1)
        sources = targets - 1
        if self.shares_prompts:
            prefix_of = self.prefix_of
            assert prefix_of is not None  # shares_prompts implies it
            segments = [s for s, p in enumerate(prefix_of) if p >= 0]
            firsts = cu[torch.tensor(segments, device=device)]
            heads = cu[torch.tensor([prefix_of[s] + 1 for s in segments], device=device)] - 1
            targets, order = torch.sort(torch.cat([targets, firsts]))
            sources = torch.cat([sources, heads])[order]
        return sources, targets

    def block_causal_mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """Block-diagonal causal attention mask: token q may attend to token k iff both are in
        the same segment and k <= q, or k is in q's shared prompt segment.

        Args:
            dtype: ``torch.bool`` (True = may attend; for SDPA) or a float dtype (0 where
                allowed, the dtype's minimum elsewhere; for eager attention).

        Returns:
            Shape [1, 1, K, K]. Memory is K^2 elements: 64 MiB as bool at K = 8,192.
        """
        lens = torch.diff(self.cu_seqlens).to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)  # [K] segment of each token
        pos = torch.arange(self.num_tokens, device=seg.device)
        allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        if self.shares_prompts:  # a response also sees its whole prompt segment
            prefix = torch.tensor(self.prefix_of, device=seg.device)[seg]  # [K]
            allowed |= seg[None, :] == prefix[:, None]
        allowed = allowed[None, None]
        if dtype == torch.bool:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _as_ids(seq: torch.Tensor | Sequence[int], i: int) -> torch.Tensor:
    t = torch.as_tensor(seq)
    if t.dim() != 1:
        raise ValueError(f"sequence {i} must be 1-D token ids, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise ValueError(f"sequence {i} must hold integer token ids, got {t.dtype}")
    return t.to(torch.int64)


def pack_sequences(sequences: Sequence[torch.Tensor | Sequence[int]], indices: Sequence[int] | None = None,
                   extra_inputs: Sequence[ExtraInputs | None] | None = None) -> Pack:
    """Concatenate sequences into one `Pack`.

    Args:
        sequences: S token-id sequences, each Shape [L_i] int (tensor or list), L_i >= 1.
        indices: the caller's index of each sequence (default 0..S-1), kept for restoring order.
        extra_inputs: each sequence's inputs beyond its ids (`Pack.extra_inputs`), or None for a text pack.

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
    if extra_inputs is not None and len(extra_inputs) != len(ids):
        raise ValueError(f"got extra inputs for {len(extra_inputs)} sequences, packing {len(ids)}")
    extra = None if extra_inputs is None else tuple(extra_inputs)
    return Pack(torch.cat(ids)[None], position_ids[None], cu, indices, extra_inputs=extra)


def pack_shared(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], indices: Sequence[int] | None = None) -> Pack:
    """Pack the sequences ``prompts[i] + responses[i]``, writing a prompt once for each run of
    consecutive sequences with the same prompt ids and a response of at least one token (module
    docstring); other sequences are packed whole. Exact: every token's hidden state equals the
    unshared pack's (the invariance tests check log-probs, losses and gradients).

    Returns:
        The `Pack`, ``K = sum over runs of (P + sum R)``.

    Raises:
        ValueError: as `pack_sequences`.
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"got {len(prompts)} prompts and {len(responses)} responses; give one prompt per response, at least one")
    indices = tuple(range(len(prompts))) if indices is None else tuple(int(i) for i in indices)
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    prefix_of: list[int] = []
    owners: list[int] = []
    k = 0
    while k < len(prompts):
        prompt = tuple(prompts[k])
        run = k + 1
        while run < len(prompts) and tuple(prompts[run]) == prompt and len(responses[run]) and len(responses[k]):
            run += 1
        if run - k == 1:  # nothing to share: the whole sequence is its own segment
            pieces.append(_as_ids(list(prompt) + list(responses[k]), k))
            positions.append(torch.arange(len(pieces[-1])))
            prefix_of.append(-1)
            owners.append(k)
        else:
            pieces.append(_as_ids(prompt, k))
            positions.append(torch.arange(len(prompt)))
            prefix_of.append(-1)
            owners.append(-1)
            head = len(prefix_of) - 1
            for j in range(k, run):
                pieces.append(_as_ids(responses[j], j))
                positions.append(torch.arange(len(prompt), len(prompt) + len(responses[j])))
                prefix_of.append(head)
                owners.append(j)
        k = run
    lens = [len(t) for t in pieces]
    if min(lens) < 1:
        raise ValueError(f"sequence {owners[lens.index(min(lens))]} has length 0; every packed sequence needs >= 1 token")
    if len(set(indices)) != len(indices) or len(indices) != len(prompts):
        raise ValueError(f"indices {list(indices)} must name each of the {len(prompts)} sequences once")
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    shared = any(p >= 0 for p in prefix_of)
    return Pack(torch.cat(pieces)[None], torch.cat(positions)[None], cu, indices,
                tuple(prefix_of) if shared else None, tuple(owners) if shared else None)
