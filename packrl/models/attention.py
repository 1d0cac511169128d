"""Attention over packs: every path keeps packed sequences from attending to each other.

Shapes: ``K`` tokens in a pack · ``S`` sequences in it · ``H`` hidden size · ``h`` heads · ``d`` head dim.

Three paths (``model.packed_attention``):

- ``varlen``: attention runs per sequence, cost sum(L_i^2). On CUDA with a model loaded as
  ``flash_attention_2``, flash-attn's varlen kernel reads ``cu_seq_lens_*``. Elsewhere the model
  uses ``packrl_sdpa``, registered here through transformers' `AttentionInterface`: plain SDPA
  for ordinary calls (generation included), and causal SDPA per sequence when a pack's
  ``cu_seq_lens_q`` is passed.
- ``block_mask``: an explicit block-diagonal causal mask [1, 1, K, K] (bool for SDPA, float for
  eager); cost K^2 per layer, exact for every implementation that accepts 4D masks.
- ``position_ids``: no mask; transformers detects the restarting position ids and builds the
  block mask itself. That detection is skipped when a cache exists, so ``use_cache=False`` is
  always passed (a config's ``use_cache=True`` default otherwise makes sequences leak).

Every path passes ``use_cache=False`` and never a 2D padding mask: with either, transformers
falls back to a plain causal mask over the whole pack and sequences silently attend across
their boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.utils import is_flash_attn_2_available

from packrl.seqlen.packing import Pack

if TYPE_CHECKING:
    # torch types a module's attributes beyond its own as ``Tensor | Module``; the model functions
    # here view their model as the transformers model it is (a peft model forwards these
    # attributes to the transformers model it wraps) through ``cast``
    from transformers import PreTrainedModel

PackedAttention = Literal["varlen", "block_mask", "position_ids"]
PACKRL_SDPA = "packrl_sdpa"
_FLASH = ("flash_attention_2", "flash_attention_3")
_MASK_IMPLS = ("sdpa", "eager", PACKRL_SDPA)


@torch.compiler.disable  # per-pack Python planning: eager, a graph break between compiled regions
def _packrl_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    packrl_prefix_of: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that runs causal attention per segment when ``cu_seq_lens_q`` marks a pack; a segment
    with a shared prompt (``packrl_prefix_of`` [S] int64: `Pack.prefix_of`, see
    `packrl.seqlen.packing.pack_shared`) also attends to all of its prompt segment.

    The responses sharing a prompt run as one right-padded batch (`_buckets`): one masked SDPA
    call instead of one per response, about 15% less attention time for groups of 4 on CPU.
    Exact: a real query sees only real keys, and padded queries' outputs are dropped, so their
    gradients are 0. Unshared segments run one call each: batching them saved nothing measurable.

    query: [1, h, K, d]; key/value: [1, h_kv, K, d]. Returns ([1, K, h, d], None) as
    transformers' attention functions do.
    """
    if cu_seq_lens_q is None:
        if _grouped_on_cpu(query, key, attention_mask, kwargs):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(f"packed attention expects one pack without cache; got query {tuple(query.shape)}, key {tuple(key.shape)}")
    bounds = tuple(cu_seq_lens_q.tolist())
    prefix_of = tuple(packrl_prefix_of.tolist()) if packrl_prefix_of is not None else (-1,) * (len(bounds) - 1)
    plan = _bucket_plan(bounds, prefix_of, query.device)
    q, k, v = query[0], key[0], value[0]  # [h, K, d], [h_kv, K, d]
    sdpa = dict(dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    outs = [_bucket_attention(q, k, v, bucket, sdpa) for bucket in plan.buckets]
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if plan.inverse is not None:
        out = out.index_select(1, plan.inverse)
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def _grouped_on_cpu(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """A masked call with grouped KV heads on the CPU (a padded generation batch), which
    transformers' SDPA forward would run on KV heads repeated to the query heads (its
    `use_gqa_in_sdpa` keeps them grouped only without a mask on CUDA): a copy of every layer's
    whole KV cache at each decode step. Torch's CPU SDPA takes grouped heads with a mask
    (``enable_gqa``) and gives the same values: 2.1 against 26 ms per layer for 64 rows x 640
    cached positions of SmolLM2-135M in bf16 on 2 cores."""
    return (attention_mask is not None and query.device.type == "cpu" and key.shape[1] != query.shape[1]
            and kwargs.get("position_bias") is None and type(kwargs.get("cache")).__name__ != "PagedAttentionCache"
            and not kwargs.get("output_attentions", False))


@dataclass(frozen=True)
class _Bucket:
    """Segments attended in one SDPA call: ``span`` (start, end) for an unshared segment, else the
    responses of one shared ``prompt`` span: ``index`` [n, Lmax] (pack positions, padding repeats
    a segment's last token) and ``valid`` [n * Lmax] (True at real tokens)."""

    span: tuple[int, int] | None = None
    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    prompt: tuple[int, int] | None = None


@dataclass(frozen=True)
class _BucketPlan:
    buckets: tuple[_Bucket, ...]
    inverse: torch.Tensor | None  # [K]: bucket order -> pack order; None when already in pack order


_PADDED_COST_LIMIT = 1.5  # a bucket's padded attention cost over its segments' own cost


def _buckets(lengths: list[int], prompt: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped longest first, each group's padded cost ``n * c(Lmax)``
    at most `_PADDED_COST_LIMIT` times ``sum c(L_i)``, where ``c(L) = L * (prompt + L)``."""
    cost = lambda n: n * (prompt + n)  # noqa: E731
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * cost(lengths[groups[-1][0]]) <= _PADDED_COST_LIMIT * (total + cost(lengths[i])):
            groups[-1].append(i)
            total += cost(lengths[i])
        else:
            groups.append([i])
            total = cost(lengths[i])
    return groups


@functools.lru_cache(maxsize=16)
def _bucket_plan(bounds: tuple[int, ...], prefix_of: tuple[int, ...], device: torch.device) -> _BucketPlan:
    """The buckets of one pack (the same for every layer of a forward, hence cached): each unshared
    segment alone; the segments sharing a prompt grouped by length (`_buckets`)."""
    by_prompt: dict[int, list[int]] = {}
    for seg, p in enumerate(prefix_of):
        by_prompt.setdefault(p, []).append(seg)
    buckets: list[_Bucket] = []
    order: list[range] = []
    for p, segs in by_prompt.items():
        lengths = [bounds[s + 1] - bounds[s] for s in segs]
        if p < 0:  # one call per unshared segment
            order.extend(range(bounds[s], bounds[s + 1]) for s in segs)
            buckets.extend(_Bucket(span=(bounds[s], bounds[s + 1])) for s in segs)
            continue
        prompt = (bounds[p], bounds[p + 1])
        for group in _buckets(lengths, prompt[1] - prompt[0]):
            chosen = [segs[i] for i in group]
            order.extend(range(bounds[s], bounds[s + 1]) for s in chosen)
            starts = torch.tensor([bounds[s] for s in chosen])
            lens = torch.tensor([bounds[s + 1] - bounds[s] for s in chosen])
            steps = torch.arange(int(lens.max()))
            index = starts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
            buckets.append(_Bucket(index=index.to(device), valid=(steps[None, :] < lens[:, None]).flatten().to(device), prompt=prompt))
    positions = torch.tensor([t for r in order for t in r])
    if torch.equal(positions, torch.arange(bounds[-1])):
        return _BucketPlan(tuple(buckets), None)
    return _BucketPlan(tuple(buckets), torch.empty_like(positions).index_put_((positions,), torch.arange(bounds[-1])).to(device))


def _bucket_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bucket: _Bucket, sdpa: dict) -> torch.Tensor:
    """One bucket's attention: q [h, K, d], k/v [h_kv, K, d] -> [h, tokens of its segments, d]."""
    if bucket.span is not None:
        s, e = bucket.span
        return F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], is_causal=True, **sdpa)[0]
    assert bucket.index is not None and bucket.valid is not None and bucket.prompt is not None, "a shared-prompt bucket"
    n, lmax = bucket.index.shape
    gather = lambda x: x.index_select(1, bucket.index.flatten()).unflatten(1, (n, lmax)).transpose(0, 1)  # noqa: E731  [n, h, Lmax, d]
    qb, kb, vb = gather(q), gather(k), gather(v)
    # each segment sees its whole prompt, then itself causally (bottom-right aligned)
    ps, pe = bucket.prompt
    kb = torch.cat([k[None, :, ps:pe].expand(n, -1, -1, -1), kb], dim=2)
    vb = torch.cat([v[None, :, ps:pe].expand(n, -1, -1, -1), vb], dim=2)
    allowed = torch.ones(lmax, pe - ps + lmax, dtype=torch.bool, device=q.device).tril(diagonal=pe - ps)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, **sdpa)
    return out.transpose(0, 1).flatten(1, 2)[:, bucket.valid]  # [h, real tokens, d]


AttentionInterface.register(PACKRL_SDPA, _packrl_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKRL_SDPA, sdpa_mask)


def use_packed_attention(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> str:
    """Give an SDPA model an attention implementation that runs ``varlen`` packs.

    On CUDA, with flash-attn installed and a bf16/fp16 compute dtype (the parameters' dtype, or
    ``compute_dtype`` when forwards run under autocast): ``flash_attention_2`` (its varlen
    kernel). Otherwise ``packrl_sdpa``, which is SDPA for every call without ``cu_seq_lens_q``,
    so generation and padded forwards are unchanged. Eager and flash models are left as they are.

    Returns:
        The model's attention implementation afterwards.
    """
    hf = cast("PreTrainedModel", model)
    if hf.config._attn_implementation == "sdpa":
        param = next(model.parameters())
        half = (compute_dtype or param.dtype) in (torch.bfloat16, torch.float16)
        if param.is_cuda and half and is_flash_attn_2_available():
            hf.set_attn_implementation("flash_attention_2")
        else:
            hf.set_attn_implementation(PACKRL_SDPA)
    return hf.config._attn_implementation


def supports_shared_prompts(model: torch.nn.Module, attention: str) -> bool:
    """Whether ``model`` runs packs with shared prompts (`packrl.seqlen.packing.pack_shared`):
    ``varlen`` through ``packrl_sdpa`` or ``block_mask`` through SDPA/eager. flash-attn's varlen
    kernel and transformers' position-id detection cannot express a segment that sees another."""
    impl = cast("PreTrainedModel", model).config._attn_implementation
    return (attention == "varlen" and impl == PACKRL_SDPA) or (attention == "block_mask" and impl in _MASK_IMPLS)


def _check_impl(model: torch.nn.Module, attention: str) -> str:
    impl = cast("PreTrainedModel", model).config._attn_implementation
    if attention == "varlen" and impl not in (PACKRL_SDPA, *_FLASH):
        raise ValueError(
            f"model.packed_attention=varlen needs attn_implementation {PACKRL_SDPA!r} or flash_attention_2, "
            f"but the model uses {impl!r}; load it with attn_implementation='sdpa' and call "
            "packrl.models.attention.use_packed_attention(model), or set model.packed_attention=block_mask"
        )
    if attention == "block_mask" and impl not in _MASK_IMPLS:
        raise ValueError(f"model.packed_attention=block_mask needs sdpa or eager attention, the model uses {impl!r}; "
                         "set model.packed_attention=varlen")
    if attention == "position_ids" and impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"model.packed_attention=position_ids needs an attention with mask support, the model uses {impl!r}")
    if attention not in ("varlen", "block_mask", "position_ids"):
        raise ValueError(f"model.packed_attention={attention!r} is not one of varlen, block_mask, position_ids")
    return impl


def packed_forward(model: torch.nn.Module, pack: Pack, attention: PackedAttention = "varlen") -> torch.Tensor:
    """Final hidden states of a pack, each sequence seeing only itself.

    Args:
        model: a transformers causal LM (``model.model`` is the decoder, as for Llama/Qwen/Mistral).
        pack: the `Pack` (on the model's device).
        attention: the isolation path; see the module docstring.

    A pack of one sequence runs as an ordinary causal forward, without the packing arguments:
    that is how models whose layers carry state along the sequence (see
    `packrl.models.isolation`) are trained, one sequence per micro-batch.

    Returns:
        Hidden states after the final norm. Shape [K, H], model dtype.

    Raises:
        ValueError: the model's attention implementation cannot run the chosen path.
    """
    kwargs: dict[str, Any] = {"position_ids": pack.position_ids, "use_cache": False}
    impl = _check_impl(model, attention) if len(pack.indices) > 1 or pack.shares_prompts else None
    if pack.shares_prompts and not supports_shared_prompts(model, attention):
        raise ValueError(f"a pack with shared prompts needs model.packed_attention=varlen with {PACKRL_SDPA!r} or block_mask; "
                         f"this model runs {impl!r} with {attention!r}: set train.share_prompts=false")
    if impl is None:
        pass  # one sequence: an ordinary causal forward (what a model with stateful layers needs)
    elif attention == "varlen":
        cu = pack.cu_seqlens.to(torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=pack.max_seqlen, max_length_k=pack.max_seqlen)
        if pack.shares_prompts:
            kwargs["packrl_prefix_of"] = torch.tensor(pack.prefix_of)  # a tensor: compiled layers do not specialise on it
    elif attention == "block_mask":
        dtype = torch.bool if impl != "eager" else cast("PreTrainedModel", model).dtype
        kwargs["attention_mask"] = pack.block_causal_mask(dtype).to(pack.input_ids.device)
    if pack.extra_inputs is not None:
        from packrl.models.modality import modality_of

        modality = modality_of(cast("PreTrainedModel", model).config)
        if modality is not None:
            return modality.packed_forward(model, pack, kwargs)
        held = [type(x).__name__ for x in pack.extra_inputs if x is not None]
        if held:
            raise ValueError(f"a pack holds a prompt's extra inputs ({held[0]}) but the model takes text only; "
                             "such prompts need a multimodal model.path")
    decoder = cast("PreTrainedModel", model).get_decoder()
    out = decoder(input_ids=pack.input_ids, **kwargs)
    return out.last_hidden_state[0]


def sharded_forward(model: torch.nn.Module, pack: Pack, sp: Any) -> torch.Tensor:
    """Final hidden states of this rank's token shard of ``pack`` under Ulysses sequence
    parallelism (`packrl.models.ulysses`): the model must use the ``packrl_ulysses`` attention,
    which gathers each attention layer's heads over the whole pack.

    Returns:
        Shape [n, H], model dtype: the rank's ``n = Kp / S`` tokens of the padded pack.

    Raises:
        ValueError: the model's attention is not ``packrl_ulysses``.
    """
    from packrl.models.ulysses import PACKRL_ULYSSES, shard_pack_inputs

    hf = cast("PreTrainedModel", model)
    impl = hf.config._attn_implementation
    if impl != PACKRL_ULYSSES:
        raise ValueError(f"trainer.sequence_parallel_size > 1 needs the {PACKRL_ULYSSES!r} attention, the model uses {impl!r}; "
                         "the policy worker sets it up (packrl.worker.strategy.FSDP2)")
    return hf.get_decoder()(**shard_pack_inputs(pack, sp)).last_hidden_state[0]
