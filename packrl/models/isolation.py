"""Whether a pack is exact for a model: every layer must keep the sequences of a pack apart.

Attention layers do, through the packed paths of `packrl.models.attention`. Layers that carry
state along the sequence do not: a Mamba/SSM state (Jamba, Mamba), a short convolution (LFM2) or
linear attention (Qwen3-Next's Gated DeltaNet) would carry one sequence's state into the next, so
a sample's log-probs inside a pack differ from the same sample alone (by 1-2 nats on tiny random
models of these families). packrl therefore decides per model, at load:

- from the config (`layer_types`: transformers 5 names every layer's kind, e.g. ``full_attention``,
  ``sliding_attention``, ``linear_attention``, ``conv``): a layer of any kind other than attention
  makes packs inexact;
- by a self-check on the loaded model (`check_packing`): two short random sequences packed into
  one row against each alone, through the same packed forward training uses; final hidden states
  that differ by more than `TOLERANCE` (relative) make packs inexact whatever the config says.
  Hidden states, not log-probs: on tiny random models a leaking short convolution moves the
  hidden states by 2e-4 (relative) but the log-probs by only 2e-5 nats, under a log-prob bound.

Where packs are not exact, micro-batches hold one sequence each (still within the token
budgets): exact, at the cost of more, smaller forwards. The worker says which in ``model.txt``
and the budgets plan; ``packrl preflight`` says the same from the config alone (`config_packing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from packrl.models.attention import PackedAttention

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
TOLERANCE = 1e-5  # relative; packed vs alone differ by ~1e-7 in float32 when every layer isolates the pack
_CHECK_LENGTHS = (9, 6)


def layer_types(config: Any) -> tuple[str, ...]:
    """The kinds of the model's decoder layers as its config names them (``layer_types``, or the
    text config's for multimodal configs); ``("full_attention",)`` when the config names none."""
    for source in (config, getattr(config, "text_config", None)):
        kinds = getattr(source, "layer_types", None) if source is not None else None
        if kinds:
            return tuple(str(k) for k in kinds)
    return ("full_attention",)


def stateful_layer_types(config: Any) -> list[str]:
    """The layer kinds that carry state along the sequence (everything but attention), sorted."""
    return sorted(set(layer_types(config)) - ATTENTION_LAYER_TYPES)


@dataclass(frozen=True)
class PackingCheck:
    """What packrl decided about packing for a model.

    Attributes:
        packs: packed rows are exact, so a micro-batch may hold several sequences.
        stateful_types: layer kinds that carry state along the sequence (empty for attention-only).
        max_diff: largest |packed - alone| final hidden state of the self-check, relative to the
            largest |alone|; None when it did not run (a config-only check) or the model refused
            packed inputs.
        detail: why, in words (the refusal, when the model refused a packed forward).
    """

    packs: bool
    stateful_types: tuple[str, ...] = ()
    max_diff: float | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for ``model.txt``, the budgets plan and preflight."""
        measured = "" if self.max_diff is None else f"; self-check: packed vs alone hidden states differ by {self.max_diff:.2g} (relative)"
        if self.packs:
            return f"packing: on (every layer keeps a pack's sequences apart{measured})"
        kinds = (f"layer types {', '.join(self.stateful_types)} carry state along the sequence" if self.stateful_types
                 else "packed rows are not exact")
        extra = f"; {self.detail}" if self.detail else ""
        return f"packing: off, one sequence per micro-batch ({kinds}{measured}{extra})"


def config_packing(config: Any) -> PackingCheck:
    """The decision from the model config alone (what ``packrl preflight`` reports)."""
    stateful = tuple(stateful_layer_types(config))
    return PackingCheck(packs=not stateful, stateful_types=stateful)


@torch.no_grad()
def check_packing(model: torch.nn.Module, attention: PackedAttention) -> PackingCheck:
    """Decide for a loaded model: the config's layer types, then the self-check (two random
    sequences of `_CHECK_LENGTHS` tokens, packed vs alone, through `packed_forward` with
    ``attention``; the model's own dtype, no autocast; a few milliseconds for a 135M model).

    Returns:
        `PackingCheck`; ``packs`` only when no layer is stateful and the self-check stays within
        `TOLERANCE`.
    """
    from packrl.models.attention import packed_forward
    from packrl.seqlen.packing import pack_sequences

    stateful = tuple(stateful_layer_types(model.config))
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    # torch types a module's attributes beyond its own as ``Tensor | Module``
    vocab = cast(int, cast("PreTrainedModel", model).get_input_embeddings().num_embeddings)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in _CHECK_LENGTHS]
    was_training = model.training
    model.eval()
    try:
        alone = [packed_forward(model, pack_sequences([s]).to(device), attention).float() for s in sequences]
        packed = packed_forward(model, pack_sequences(sequences).to(device), attention).float()
    except (ValueError, RuntimeError, TypeError) as err:  # a model that refuses packed inputs
        return PackingCheck(packs=False, stateful_types=stateful, detail=f"the model refuses a packed forward: {type(err).__name__}: {err}")
    finally:
        model.train(was_training)
    scale = max(float(a.abs().max()) for a in alone) or 1.0
    diff = max(float((a - b).abs().max()) for a, b in zip(alone, torch.split(packed, list(_CHECK_LENGTHS)))) / scale
    return PackingCheck(packs=not stateful and diff <= TOLERANCE, stateful_types=stateful, max_diff=diff)
