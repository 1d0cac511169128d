"""LoRA dropout whose masks do not depend on packing, micro-batches or ranks (``model.lora.dropout``).

Shapes: ``K`` tokens in a pack · ``n`` tokens a forward holds (``K``, or a rank's share under
sequence parallelism) · ``F`` input features of an adapted Linear.

peft's LoRA dropout is a ``torch.nn.Dropout`` on each adapter's input (``lora_B(lora_A(dropout(x)))``,
peft ``tuners/lora/layer.py``, ``Linear.forward``). It draws its masks from the process's generator
in the order the forwards run, so a token gets another mask when its mini-batch is split into other
micro-batches or over other ranks, and a run on 2 ranks does not train as one process does
(invariant 4). `KeyedDropout` replaces it: the keep bit of feature ``f`` of a token is a hash of

- the layer's salt, drawn from torch's generator when the adapters are made (the worker seeds it
  with ``train.seed`` for the load, as for the A matrices, so every rank draws the same salts),
- the draw: the optimizer steps taken before the token's mini-batch, so every mini-batch and
  every epoch draws afresh, and a resumed run (its schedule restored) draws what it drew,
- the token: a prompt token by its prompt's ids and its position (a prompt written once for its
  group in a shared pack gets the mask it has in each unshared sequence), a response token by its
  sequence's index in the batch and its position,
- ``f``,

through a 32-bit integer mixer (`mix32`), kept when the hash is at least ``p x 2^32``: a keep
probability of ``1 - p`` to 2^-32, scaled by ``1 / (1 - p)`` as ``torch.nn.Dropout`` does. A
mask is then a function of what the token is, whatever pack, rank or recomputation (gradient
checkpointing) computes it, and the invariance tests hold with dropout on.

Trade-off: the hash is about 12 int64 operations per input element of each adapted Linear, on
[n, F] temporaries of 8 bytes per element, where ``torch.nn.Dropout`` draws one random number per
element. It runs only in the update's forwards (and their recomputation), only with
``model.lora.dropout > 0``.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch

from packrl.models import ulysses
from packrl.seqlen.packing import Pack

_M32 = 0xFFFFFFFF
_PROMPT, _RESPONSE = 0x2545F491, 0x6C8E9CF5  # tags: a prompt's hash and a sequence index never share a key space
_GOLDEN = 0x9E3779B9


@overload
def mix32(x: int) -> int: ...
@overload
def mix32(x: torch.Tensor) -> torch.Tensor: ...
def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A bijective 32-bit mixer (xorshift-multiply rounds, the finalizer of Wang's and
    MurmurHash3's family) on non-negative integers below 2^32: int64 tensors or Python ints,
    computed the same way. Each product stays below 2^63 (a 32-bit value times a 31-bit odd
    constant), so int64 never overflows and the result is exact on every device.

    | x | mix32(x) |
    |---|---|
    | 0 | 0 |
    | 1 | 4293290225 |
    | 12345 | 3870921022 |
    | 2^32 - 1 | 3846949589 |
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def prompt_key(prompt_ids: Sequence[int]) -> int:
    """A 32-bit key of a prompt's ids (blake2b), the same in every process."""
    return int.from_bytes(hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=4).digest(), "little")


def token_keys(pack: Pack, prompt_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """The dropout key of every token of ``pack``: a prompt token's from its prompt's ids and
    position, a response token's from its sequence's index (``pack.indices``) and position.

    Args:
        pack: the micro-batch's pack (whole, or with shared prompts).
        prompt_ids: the prompt ids of each packed sequence, in ``pack.indices`` order.

    Returns:
        Shape [K], int64, values below 2^32, on the pack's device.
    """
    device = pack.input_ids.device
    seq = pack.sequence_ids().to(device)  # [K] position in pack.indices; a shared prompt's tokens take its next sequence's
    position = pack.position_ids[0].to(torch.int64)
    prompt_len = torch.tensor([len(p) for p in prompt_ids], dtype=torch.int64, device=device)[seq]
    prompt = torch.tensor([mix32(prompt_key(p) ^ _PROMPT) for p in prompt_ids], dtype=torch.int64, device=device)[seq]
    response = torch.tensor([mix32((i & _M32) ^ _RESPONSE) for i in pack.indices], dtype=torch.int64, device=device)[seq]
    owner = torch.where(position < prompt_len, prompt, response)
    return mix32(mix32(owner) ^ (position & _M32))


@dataclass
class DropoutDraw:
    """The masks of one micro-batch's forward and backward: its pack's token keys (None: an idle
    rank's forward, every key 0) and the draw (the optimizer steps taken before its mini-batch)."""

    pack: Pack | None
    prompt_ids: Sequence[Sequence[int]]
    draw: int
    _keys: torch.Tensor | None = field(default=None, repr=False)

    def keys(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The keys of the ``num_tokens`` tokens a forward holds: the pack's (this rank's share of
        the padded pack under sequence parallelism, `packrl.models.ulysses`), computed once.

        Raises:
            RuntimeError: a forward of another token count than the pack's.
        """
        if self.pack is None:
            return torch.zeros(num_tokens, dtype=torch.int64, device=device)
        if self._keys is None:
            keys = token_keys(self.pack, self.prompt_ids)
            sp = ulysses.active()
            if sp is not None:  # the rank's tokens of the padded pack (the pad keyed 0: it carries no loss)
                keys = torch.cat([keys, keys.new_zeros(sp.padded(len(keys)) - len(keys))])
                start, end = sp.bounds(self.pack.num_tokens)
                keys = keys[start:end]
            self._keys = keys.to(device)
        if len(self._keys) != num_tokens:
            raise RuntimeError(f"a LoRA dropout forward holds {num_tokens} tokens but its micro-batch's pack has {len(self._keys)}; "
                               "a training forward must run on the pack of the draw it runs in")
        return self._keys


_ACTIVE: list[DropoutDraw] = []


@contextlib.contextmanager
def dropout_draw(pack: Pack | None, prompt_ids: Sequence[Sequence[int]], draw: int) -> Iterator[None]:
    """Run a micro-batch's forward and backward (gradient checkpointing recomputes inside the
    backward) with the masks of ``pack`` and ``draw`` (`DropoutDraw`). Costs nothing where no
    `KeyedDropout` runs: the keys are computed on first use."""
    _ACTIVE.append(DropoutDraw(pack, prompt_ids, draw))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> DropoutDraw | None:
    """The draw the current micro-batch's forward and backward run in, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class KeyedDropout(torch.nn.Module):
    """Dropout of probability ``p`` on an adapter's input with keyed masks (module docstring).

    Args:
        p: ``model.lora.dropout``, in (0, 1).
        salt: the layer's salt, below 2^32.
    """

    def __init__(self, p: float, salt: int) -> None:
        super().__init__()
        self.p, self.salt = p, salt
        self.threshold = min(round(p * 2**32), _M32)

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt}"

    @torch.compiler.disable  # the draw is read per micro-batch: eager, a graph break inside compiled layers
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (Shape [..., n, F]) with dropout in training mode, as it is in eval mode.

        Raises:
            RuntimeError: a training forward outside a `dropout_draw` (the update enters one per micro-batch).
        """
        if not self.training:
            return x
        draw = active()
        if draw is None:
            raise RuntimeError("LoRA dropout (model.lora.dropout > 0) ran a training forward outside an update's draw; "
                               "run training forwards through packrl.worker.update, or the model in eval mode")
        num_tokens, features = x.shape[:-1].numel(), x.shape[-1]
        keys = draw.keys(num_tokens, x.device)  # [n]
        column = mix32(self.salt ^ mix32(draw.draw & _M32))  # the layer's and the draw's, a Python int
        feature = mix32((torch.arange(features, dtype=torch.int64, device=x.device) * _GOLDEN & _M32) ^ column)  # [F]
        keep = mix32(keys[:, None] ^ feature[None, :]) >= self.threshold  # [n, F]
        return x * keep.reshape(x.shape).to(x.dtype) * (1.0 / (1.0 - self.p))


def use_keyed_dropout(model: torch.nn.Module, p: float) -> int:
    """Replace the dropout of every LoRA layer of a peft ``model`` by a `KeyedDropout` of
    probability ``p``, each with a salt drawn from torch's generator (module order). Returns the
    number of layers."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_dropout:
                module.lora_dropout[adapter] = KeyedDropout(p, int(torch.randint(0, 2**32, ())))
                count += 1
    return count
