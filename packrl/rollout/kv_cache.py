"""A KV cache for the HF engine that appends in place instead of concatenating.

transformers' `DynamicLayer` grows its keys and values with ``torch.cat`` at every decode step, so
each step copies the whole cache of every layer: O(L) bytes per step and O(L^2) over a response.
`AppendingLayer` keeps each layer's keys and values in buffers with spare room along the sequence
and writes a step's new states into that room; the cache it hands to attention is a view of the
filled part. A buffer is reallocated (one copy) only when it is full, growing by
`AppendingLayer.GROWTH_TOKENS`. Attention reads the same values, so generation is unchanged. On
2 CPU cores, 16 GSM8K-shaped requests (4 prompts x 4, up to 256 new tokens, SmolLM2-135M in bf16)
generate in a median 27.2 s against 30.8 s with transformers' cache (1.13x; 1.06x in another run;
`bench/bench_kv_cache.py`).

Hybrid models (LFM2, Jamba, Qwen3-Next, Qwen3.5) keep conv and recurrent states per row in their
cache's other layers; `select_rows` moves those with their rows too (transformers' own
``batch_select_indices`` stops at keys and values). A cache of states alone (pure Mamba) cannot
say how many positions it holds, so it is never carried from one ``generate`` call into the
next (`cache_reuse`).

Shapes: ``b`` rows · ``h`` KV heads · ``L`` cached positions · ``C >= L`` buffer capacity ·
``d`` head dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

CACHE_ARGUMENT = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
"""The name of ``generate``'s and the forwards' KV-cache argument (and output field) in the installed
transformers: ``past_key_values`` up to 5.19, ``cache`` in later 5.x releases."""

try:  # transformers >= 5.x: conv, SSM and linear-attention layers keep per-row states, not keys and values
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - older transformers: no such layers
    LinearAttentionCacheLayerMixin = None  # type: ignore[assignment,misc]


class AppendingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values [b, h, L, d] are views of buffers [b, h, C, d]."""

    GROWTH_TOKENS = 128  # spare positions added when a buffer is full

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` [b, h, q, d] and return all cached [b, h, L + q, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, end + self.GROWTH_TOKENS)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, self._length:end] = key_states
        self._value_buffer[:, :, self._length:end] = value_states
        self._set_length(end)
        assert self.keys is not None and self.values is not None  # views _set_length just took
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """New buffers of ``capacity`` positions holding the cached ones (rows and heads as the new states)."""
        rows, heads, _, _ = key_states.shape
        keys = key_states.new_empty(rows, heads, capacity, key_states.shape[-1])
        values = value_states.new_empty(rows, heads, capacity, value_states.shape[-1])
        if self._length:
            assert self.keys is not None and self.values is not None  # set whenever positions are cached
            keys[:, :, :self._length] = self.keys
            values[:, :, :self._length] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def _set_length(self, length: int) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self._length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        if self.is_initialized and self._length:
            self._set_length(max(0, self._length + tokens_to_remove))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda buffer: buffer[indices])

    def _map_rows(self, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace both buffers by ``rows_of(buffer)`` (a selection or repeat of rows), when filled."""
        if self.is_initialized and self._length:
            assert self._key_buffer is not None and self._value_buffer is not None
            self._key_buffer, self._value_buffer = rows_of(self._key_buffer), rows_of(self._value_buffer)
            self._set_length(self._length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))


def appending_cache(config: Any) -> DynamicCache:
    """transformers' `DynamicCache` for ``config`` with every full-attention layer an `AppendingLayer`
    (sliding-window and other layer kinds keep transformers' own classes)."""
    cache = DynamicCache(config=config)
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = AppendingLayer
    cache.layers = [AppendingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def can_select_rows(cache: Any) -> bool:
    """Whether `select_rows` can keep or repeat rows of ``cache``: a transformers `Cache` made of
    layers, or any cache with its own ``batch_select_indices``."""
    return hasattr(cache, "layers") or hasattr(cache, "batch_select_indices")


def select_rows(cache: Any, indices: torch.Tensor) -> None:
    """Keep (or repeat) rows ``indices`` [b'] int64 of every layer of ``cache``, in that order.

    Attention layers select their keys and values (`AppendingLayer` its buffers); conv, SSM and
    linear-attention layers (transformers' `LinearAttentionCacheLayerMixin`: LFM2, Jamba, Mamba,
    Qwen3-Next, Qwen3.5) their conv and recurrent states, row for row; a layer with both (a
    "hybrid" layer) both. transformers' own `Cache.batch_select_indices` reaches only the first
    kind (it has no row selection for the second).

    Raises:
        ValueError: the cache has no layers and no ``batch_select_indices`` (`can_select_rows`).
    """
    if not hasattr(cache, "layers"):
        if not hasattr(cache, "batch_select_indices"):
            raise ValueError(f"a {type(cache).__name__} cannot select rows; check can_select_rows first")
        cache.batch_select_indices(indices)
        return
    for layer in cache.layers:
        stateful = LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)
        if stateful:
            # index_select of every initialised state; transformers annotates the legacy LongTensor type
            LinearAttentionCacheLayerMixin.reorder_cache(layer, cast(torch.LongTensor, indices))
        if not stateful or isinstance(layer, DynamicLayer):
            layer.batch_select_indices(indices.to(layer.keys.device) if getattr(layer, "keys", None) is not None else indices)


@dataclass(frozen=True)
class CacheReuse:
    """Whether the HF engine may build a batch's cache itself and keep it across generate calls.

    Attributes:
        reuses: the engine makes the cache (`appending_cache`), prefills each shared prompt once
            and lets finished rows leave it between rounds; False: one generate call per batch on
            the cache the model builds for itself, every row prefilling its own prompt.
        argument: the name under which the model's forward and ``generate`` take the cache.
        reason: why not, when ``reuses`` is False ("" otherwise).
    """

    reuses: bool
    argument: str = "past_key_values"
    reason: str = ""

    def describe(self) -> str:
        """One phrase for ``model.txt``."""
        if self.reuses:
            return "generation: engine-made KV cache (shared-prompt prefill, finished rows leave between rounds)"
        return f"generation: one generate call per batch on the model's own cache ({self.reason})"


def cache_reuse(model: Any, argument: str = CACHE_ARGUMENT) -> CacheReuse:
    """Decide `CacheReuse` for ``model`` (a transformers causal LM).

    A cache can be carried from one ``generate`` call into the next only if it says how many
    positions it holds (``generate`` feeds only the positions after them). Attention layers record
    that; a cache of conv/SSM states alone does not, so a pure Mamba model would prefill its whole
    sequence again on top of its states (5e-4 nats off the trainer's log-probs on a tiny random
    model) and gets one call per batch. transformers also gives some architectures (RWKV, xLSTM,
    Mamba under another argument name) a cache of their own kind; those get one call too.
    """
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    arch = type(model).__name__
    if supports is not None and not supports():
        return CacheReuse(False, argument, f"transformers gives {arch} a cache of its own kind")
    layers = DynamicCache(config=model.config).layers
    if layers and not any(isinstance(layer, DynamicLayer) for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        return CacheReuse(False, argument, f"its cache holds only recurrent states ({', '.join(kinds)}), which do not "
                                            "record how many positions they have seen")
    if argument not in inspect.signature(model.forward).parameters:
        return CacheReuse(False, argument, f"{arch}'s forward takes no {argument}")
    return CacheReuse(True, argument)
