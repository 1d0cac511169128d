"""Laying per-response values over packs, and reading them back: what every pass over packed
micro-batches (log-probs, values, the actor's and the critic's updates) shares.

Shapes: ``N`` sequences · ``R_i`` response tokens of sequence i · ``K`` tokens in a pack ·
``S`` sequences in a pack.

In a pack, sequence i's response occupies the last ``R_i`` tokens of its own segment
(`packrl.seqlen.packing.Pack`), and `pack_logprobs` puts log p(x_k | x_<k) at k, so a response's
values are read back by position, whether its prompt is written in its segment or shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from packrl.config.schema import PackedAttention, RunConfig
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.packing import Pack, pack_sequences, pack_shared
from packrl.types import RolloutBatch, TrainBatch


@dataclass(frozen=True, slots=True)
class PackForward:
    """How a pack's log-probs are computed (`pack_logprobs`): the same for every pass.

    Attributes:
        attention: ``model.packed_attention``.
        chunk_tokens: ``train.logits_chunk_tokens``.
        temperature: ``rollout.temperature`` (the trainer scores what the engine sampled).
        share_prompts: write a group's prompt once per pack (``train.share_prompts``, where the
            model's attention path can: `packrl.models.attention.supports_shared_prompts`).
    """

    attention: PackedAttention
    chunk_tokens: int
    temperature: float
    share_prompts: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig, share_prompts: bool = False) -> PackForward:
        return cls(cfg.model.packed_attention, cfg.train.logits_chunk_tokens, cfg.rollout.temperature, share_prompts)

    def pack(self, rollout: RolloutBatch, indices: Sequence[int], device: torch.device) -> Pack:
        """The micro-batch ``indices`` of ``rollout`` as one pack: a group's prompt written once
        when prompts are shared (`packrl.seqlen.packing.pack_shared`), else every sequence whole."""
        if self.share_prompts:
            return pack_shared([rollout.prompt_ids_of(i) for i in indices], [rollout.responses[i].response_ids for i in indices],
                               indices).to(device)
        extra = None if rollout.prompts.extra_inputs is None else [rollout.extra_inputs_of(i) for i in indices]
        return pack_sequences([sequence_ids(rollout, i) for i in indices], indices=indices, extra_inputs=extra).to(device)

    def __call__(self, model: torch.nn.Module, pack: Pack, needed: torch.Tensor, entropy_grad: bool = False) -> Any:
        return pack_logprobs(model, pack, attention=self.attention, chunk_tokens=self.chunk_tokens,
                             temperature=self.temperature, entropy_grad=entropy_grad, needed=needed)


def sequence_ids(rollout: RolloutBatch, i: int) -> torch.Tensor:
    """Prompt + response ids of sequence i. Shape [T_i], int64."""
    return torch.tensor(rollout.prompt_ids_of(i) + rollout.responses[i].response_ids, dtype=torch.long)


def response_parts(pack: Pack, values: torch.Tensor, rollout: RolloutBatch) -> list[torch.Tensor]:
    """The last R_i entries of each packed sequence's per-token ``values`` ([K])."""
    return [part[len(part) - len(rollout.responses[i].response_ids):] for i, part in zip(pack.indices, pack.unpack(values))]


def scatter_response(pack: Pack, rollout: RolloutBatch, per_seq: Sequence[torch.Tensor] | dict[int, torch.Tensor],
                      fill: float | bool) -> torch.Tensor:
    """Lay per-response values ([R_i] each, indexed like the rollout) over the pack: each
    response fills the last R_i tokens of its sequence's own segment; prompt tokens (shared or
    not) get ``fill``. Returns Shape [K]."""
    device = pack.input_ids.device
    template = per_seq[pack.indices[0]]  # the dtype every part takes
    parts = []
    for length, owner in zip(pack.seq_lens, pack.segment_owners()):
        if owner < 0:  # a shared prompt segment
            parts.append(template.new_full((length,), fill, device=device))
        else:  # the sequence's own segment: its response is the last R_i tokens
            values = per_seq[pack.indices[owner]].to(device)
            parts.append(torch.cat([values.new_full((length - len(values),), fill), values]))
    return torch.cat(parts)


def response_positions(pack: Pack, rollout: RolloutBatch) -> torch.Tensor:
    """True at every response token of the pack. Shape [K], bool."""
    ones = {i: torch.ones(len(rollout.responses[i].response_ids), dtype=torch.bool) for i in pack.indices}
    return scatter_response(pack, rollout, ones, False)


def rollout_logprobs_over(pack: Pack, rollout: RolloutBatch) -> torch.Tensor | None:
    """The engine's log-probs laid over the pack (Shape [K], float32), or None when a response lacks them."""
    values = {i: rollout.responses[i].rollout_logprobs for i in pack.indices}
    if any(v is None for v in values.values()):
        return None
    return scatter_response(pack, rollout, {i: torch.tensor(v, dtype=torch.float32) for i, v in values.items()}, 0.0)


def sequence_counts(pack: Pack, batch: TrainBatch, full_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """The loss tokens of each packed sequence as ``seq-mean-token-mean`` divides by them, Shape
    [S], float: counted from ``full_mask`` (Shape [K], bool, the whole micro-batch's loss tokens),
    or for step-wise samples their trajectory's count (`TrainBatch.trajectory_loss_tokens`), since
    the trajectory is the sequence the seq-mean modes average over."""
    if batch.trajectory_loss_tokens is None:
        return torch.zeros(len(pack.indices), device=full_mask.device).index_add_(0, seq_ids, full_mask.float())
    return torch.tensor([float(batch.trajectory_loss_tokens[i]) for i in pack.indices], device=full_mask.device)
