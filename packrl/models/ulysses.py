"""Ulysses sequence parallelism: one pack's tokens split across the ``S`` ranks of a sequence-parallel
group (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509; verl's ``ulysses_sequence_parallel_size``).

Shapes: ``K`` tokens in the pack · ``Kp`` = K padded to a multiple of S · ``n = Kp / S`` tokens per
rank · ``h`` attention heads · ``g`` key/value heads · ``d`` head dim · ``H`` hidden size.

Every rank runs the decoder on its contiguous ``n`` tokens (embeddings, norms, MLPs and RoPE, with
each token's own position, are per token). Inside each attention layer an all-to-all trades the
sequence split for a head split: a rank then holds ``h / S`` heads over all ``Kp`` tokens, runs the
model's own packed attention on them (the pack's sequence boundaries intact), and a second
all-to-all trades back. Key/value heads are split the same way when ``g`` is a multiple of ``S``
and repeated to ``h`` heads first otherwise. The pad tokens (``Kp - K``, fewer than S) form a
sequence of their own: no real token attends to them, and they have no label and no loss.

Each rank computes the log-probs of the tokens its hidden states predict (`shard_rows`); a
no-grad pass sums the ranks' parts (all-reduce), the update keeps them apart and each rank's loss
is its share of the globally normalised loss, so gradients summed over all ranks are exact.

The all-to-all goes through ``torch.distributed.nn.functional.all_to_all_single``, which carries
gradients back through the same exchange. Its forward time is counted per pass (`SequenceParallel.all_to_all_s`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PACKRL_ULYSSES = "packrl_ulysses"


@dataclass
class SequenceParallel:
    """One rank's view of its sequence-parallel group.

    Attributes:
        group: the torch.distributed group of the S ranks.
        size: S.
        rank: this rank's index in the group (which token shard it holds).
        inner: the attention implementation that runs on the gathered heads (``packrl_sdpa`` or flash).
        all_to_all_s: seconds spent in forward all-to-alls since the last reset.
        num_exchanges: forward all-to-alls since the last reset (two per attention layer: q, k and v
            together, then the output).
    """

    group: Any
    size: int
    rank: int
    inner: str
    all_to_all_s: float = field(default=0.0)
    num_exchanges: int = field(default=0)

    def padded(self, num_tokens: int) -> int:
        """``Kp``: ``num_tokens`` rounded up to a multiple of the group size."""
        return -(-num_tokens // self.size) * self.size

    def bounds(self, num_tokens: int) -> tuple[int, int]:
        """This rank's token range ``[start, end)`` of the padded pack."""
        n = self.padded(num_tokens) // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (no gradient); returns it."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor


_ACTIVE: list[SequenceParallel] = []


@contextlib.contextmanager
def sequence_parallel(sp: SequenceParallel | None) -> Iterator[None]:
    """Run the packed forwards inside the block split over ``sp``'s group (None: as they are)."""
    if sp is None:
        yield
        return
    _ACTIVE.append(sp)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> SequenceParallel | None:
    """The sequence-parallel group the current forwards are split over, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _exchange(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """All-to-all of ``x`` [S, ...]: chunk i goes to rank i; returns [S, ...] with chunk j from rank j."""
    from torch.distributed.nn.functional import all_to_all_single

    start = time.perf_counter()
    x = x.contiguous()  # the output buffer must be contiguous too: the exchange writes it flat
    out = all_to_all_single(torch.empty_like(x), x, group=sp.group)
    sp.all_to_all_s += time.perf_counter() - start
    sp.num_exchanges += 1
    return out


def _to_heads(tensors: list[torch.Tensor], sp: SequenceParallel) -> list[torch.Tensor]:
    """Each of ``tensors`` [1, heads_i, n, d] (sequence shards) -> [1, heads_i / S, Kp, d] (head
    shards over the whole pack), all in one exchange."""
    n, d = tensors[0].shape[2:]
    local = [t.shape[1] // sp.size for t in tensors]
    chunks = torch.cat([t[0].reshape(sp.size, h, n, d) for t, h in zip(tensors, local)], dim=1)  # [S, sum(heads_i)/S, n, d]
    parts = _exchange(chunks, sp)  # [S (token shard), sum(heads_i)/S, n, d]
    whole = parts.permute(1, 0, 2, 3).reshape(sum(local), sp.size * n, d)
    return [t[None] for t in whole.split(local, dim=0)]


def _to_tokens(y: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[1, Kp, heads / S, d] (an attention output) -> [1, n, heads, d] this rank's tokens, all heads."""
    _, kp, local_heads, d = y.shape
    n = kp // sp.size
    parts = _exchange(y[0].reshape(sp.size, n, local_heads, d), sp)  # [S (head shard), n, heads/S, d]
    return parts.permute(1, 0, 2, 3).reshape(n, sp.size * local_heads, d)[None]


def _ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a token shard (query [1, h, n, d], key/value [1, g, n, d]) over the whole pack;
    outside a sequence-parallel pass (or without a pack) the inner implementation as it is."""
    sp = active()
    if sp is None or kwargs.get("cu_seq_lens_q") is None:
        inner = ALL_ATTENTION_FUNCTIONS[sp.inner if sp is not None else "packrl_sdpa"]
        return inner(module, query, key, value, attention_mask, **kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:  # too few KV heads to split: repeat them to one per query head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = _to_heads([query, key, value], sp)
    out, _ = ALL_ATTENTION_FUNCTIONS[sp.inner](module, q, k, v, None, **kwargs)
    return _to_tokens(out, sp), None


AttentionInterface.register(PACKRL_ULYSSES, _ulysses_attention)


def check_heads(config: Any, size: int) -> str | None:
    """None when a model's attention can be split ``size`` ways, else why not (heads must divide)."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % size:
        valid = [d for d in range(2, heads + 1) if heads % d == 0] if isinstance(heads, int) and heads > 0 else []
        return (f"the model's {heads} attention heads are not a multiple of trainer.sequence_parallel_size={size}"
                + (f" (sizes that divide them: {', '.join(map(str, valid))})" if valid else ""))
    return None


def shard_pack_inputs(pack: Any, sp: SequenceParallel) -> dict[str, Any]:
    """The decoder's inputs for this rank's shard of ``pack``: ids and positions of its tokens of
    the padded pack, and the padded pack's boundaries (the pad is a sequence of its own)."""
    k = pack.num_tokens
    kp = sp.padded(k)
    ids, positions, cu = pack.input_ids, pack.position_ids, pack.cu_seqlens.to(torch.int32)
    if kp > k:
        ids = torch.cat([ids, ids.new_zeros(1, kp - k)], dim=1)
        positions = torch.cat([positions, torch.arange(kp - k, device=positions.device)[None]], dim=1)
        cu = torch.cat([cu, cu.new_tensor([kp])])
    start, end = sp.bounds(k)
    longest = int(torch.diff(cu).max())
    return {"input_ids": ids[:, start:end], "position_ids": positions[:, start:end], "use_cache": False,
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
