"""Rollouts with transformers' `model.generate` and its KV cache (CPU default, or one GPU).

Shapes: ``B`` prompts · ``G`` responses per prompt · ``N = B*G`` requests · ``b`` requests in a
generation batch (at most ``max_num_seqs``) · ``P`` prompt tokens (``P_max``: longest prompt of
a batch) · ``R`` response tokens (``R_gen``: columns a batch generated) · ``V`` vocabulary.

A call expands each prompt G times, sorts the N requests by prompt length and cuts batches of at
most ``max_num_seqs``, so a batch holds prompts of similar length and pads little: on 256 requests
with prompt lengths drawn uniformly from 16..512 tokens, sorted batches of 64 pad 19% of their
prompt slots against 47% for batches in arrival order (the prefill of a batch costs its padded
width). Prompts are left-padded with the pad id under an attention mask; results come back in
input order.

Each request has its own cap, ``min(max_response_tokens, max_context_tokens - P)``. A batch
generates up to its largest cap and each response is cut at its own. The finish reason comes
from the response's own tokens: the first EOS id (kept as the last token) -> ``eos``; the first
step where a stop string completes (HF's own `StopStringCriteria`, rerun on the returned ids, so
it agrees with where generation stopped) -> ``stop``; otherwise the response filled its cap ->
``length`` when the cap is ``max_response_tokens``, ``context`` when the model context was the
smaller cap.

Sampling is exactly ``temperature``/``top_k``/``top_p``: every other logits processor a model's
``generation_config`` could switch on (``top_k=50`` by default, repetition penalty, minimum
lengths, suppressed tokens, ...) is switched off per call. Randomness comes from the seeds the
caller passes, one per prompt (`GumbelMaxSampler`): response g of prompt b depends on
``(seeds[b], g)`` alone, not on its batch; without seeds they are drawn from torch's global RNG.
The noise of each token is keyed by the request's seed and the token's absolute position, so a
response continued from prompt + its first tokens (a resumed partial rollout,
`packrl.trainer.stages.pool`) draws what it would have drawn uninterrupted.

Prefill once per group: the G samples of a prompt are adjacent rows of a batch, so the prompt's
KV cache (all but its last token) is computed once per distinct prompt and copied to its rows
before the first decode step (`HFEngine._shared_prefill`); vLLM's prefix cache does the same.
Prompts of very different lengths in one batch are prefilled in length buckets, so a long prompt
(a resumed partial rollout's prompt + prefix) does not make every short one compute its padding.
Rows are copied and dropped with `packrl.rollout.kv_cache.select_rows`, which also moves the conv
and recurrent states of hybrid models' non-attention layers. A model whose cache holds only such
states (pure Mamba) or is of its own kind generates each batch in one call on the cache the model
builds itself, without the shared prefill (`packrl.rollout.kv_cache.cache_reuse`; model.txt says
which).

Speed: a batch generates in rounds of ``HFEngineOptions.round_tokens`` tokens and rows that finished leave
the batch and its KV cache between rounds, so later rounds decode only the rows still running
(on an earlier 2-core host the demo preset's 32 requests took 4.6 s this way against 6.5 s when
every row decoded until the longest ended). The KV cache appends each step's keys and values in
place (`packrl.rollout.kv_cache`) rather than concatenating the whole cache at every step. On the
CPU, bf16 Linear layers run on weights packed into oneDNN's layout once per call
(`packrl.rollout.packed_linear`, ``HFEngineOptions.pack_linears``) rather than reordered at every
matmul; calls capped below ``pack_min_tokens`` new tokens, too short to repay the packing, skip it.

``rollout_logprobs`` are ``log_softmax(logits / temperature)`` of the sampled token, from the raw
logits (``output_logits=True``) before top-k/top-p filtering: the distribution the trainer scores.
Greedy responses report them at temperature 1. transformers keeps these logits for one round:
``b * round_tokens * V`` float32 values (64 x 16 x 49,152 is 201 MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from packrl.capabilities import HF_ENGINE
from packrl.models.modality import modality_of
from packrl.registry import ROLLOUT_ENGINES
from packrl.rollout.engine import EngineContext, SamplingParams, eos_ids, pad_id, request_seed
from packrl.rollout.kv_cache import CACHE_ARGUMENT, AppendingLayer, appending_cache, cache_reuse, select_rows
from packrl.rollout.packed_linear import packed_linears
from packrl.rollout.sampling import GumbelMaxSampler
from packrl.rollout.weights import rollout_copy
from packrl.types import ExtraInputs, FinishReason, Response

# Generation settings that would add a logits processor or a stopping rule beyond the requested
# sampling; a model's generation_config may set any of them, so every call pins them to "off".
_OFF: dict[str, Any] = {
    "num_beams": 1, "num_return_sequences": 1, "min_length": 0, "min_new_tokens": None, "max_time": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "remove_invalid_values": False, "renormalize_logits": False,
    "guidance_scale": None, "watermarking_config": None, "dola_layers": None, "min_p": None, "top_h": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "output_scores": False,
}
_CACHE_KEY = CACHE_ARGUMENT  # transformers 5 renamed generate's `past_key_values` (argument and output field) to `cache`
_NEVER = 1 << 62  # "no event" step index, larger than any response


@dataclass(frozen=True, slots=True)
class _Request:
    """One response to generate: which prompt, which sample of its group, and its cap in tokens."""

    prompt_index: int
    sample_index: int
    prompt: tuple[int, ...]
    cap: int
    cap_reason: FinishReason
    seed: int = 0
    extra_inputs: ExtraInputs | None = None


@dataclass(frozen=True)
class HFEngineOptions:
    """How the HF engine generates; every field has the measured default.

    Attributes:
        round_tokens: new tokens per ``generate`` call before finished rows leave the batch.
        kv_cache: model config -> the empty KV cache of a batch (`appending_cache`).
        pack_linears: run bf16 CPU Linear layers on weights packed for oneDNN while generating
            (`packrl.rollout.packed_linear`).
        pack_min_tokens: calls capped below this many new tokens run the plain layers: packing
            costs 0.11-0.12 s a call for SmolLM2-135M and saved about 9 ms of a 16-row decode
            step (`bench/bench_decode.py`: pack_s; 79.1 vs 70.2 ms).
    """

    round_tokens: int = 16
    kv_cache: Callable[[Any], Any] = field(default=appending_cache)
    pack_linears: bool = True
    pack_min_tokens: int = 32


class HFEngine:
    """`RolloutEngine` over a transformers causal LM.

    Args:
        model: a transformers causal LM (any attention implementation that takes a 2D padding
            mask; ``packrl_sdpa`` is plain SDPA here).
        tokenizer: its tokenizer; gives the EOS and pad ids and matches stop strings.
        max_context_tokens: model context in tokens (`packrl.seqlen.Budgets.max_context_tokens`);
            prompt + response never exceeds it.
        max_num_seqs: sequences per generation batch (``rollout.max_num_seqs``).
        autocast_dtype: run generation under ``torch.autocast`` with this dtype (e.g.
            ``torch.bfloat16``); None = the model's own dtype.
        shares_policy: ``model`` is the policy being trained, so `load_weights` has nothing to do.
        options: how it generates (`HFEngineOptions`).

    Raises:
        ValueError: a size is < 1, or neither the tokenizer nor the model names an EOS id.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_context_tokens: int,
        max_num_seqs: int,
        autocast_dtype: torch.dtype | None = None,
        shares_policy: bool = False,
        options: HFEngineOptions = HFEngineOptions(),
    ) -> None:
        if options.round_tokens < 1:
            raise ValueError(f"HFEngineOptions.round_tokens={options.round_tokens} must be >= 1")
        if max_context_tokens < 1:
            raise ValueError(f"max_context_tokens={max_context_tokens} must be >= 1; pass the model context (see packrl.seqlen.Budgets)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1; set rollout.max_num_seqs")
        self.model = model
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.max_num_seqs = max_num_seqs
        self.autocast_dtype = autocast_dtype
        self.options = options
        self.modality = modality_of(cast(Any, model).config)
        self.shares_policy = shares_policy
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = pad_id(model, tokenizer, self.eos_ids)
        self.cache_reuse = cache_reuse(model, _CACHE_KEY)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None,
        extra_inputs: Sequence[ExtraInputs | None] | None = None,
    ) -> list[list[Response]]:
        """Generate `params.n` responses for each prompt; see `RolloutEngine.generate`.

        Args:
            prompt_ids: B prompts, ``[B][P_b]`` token ids, each non-empty.
            params: how to sample.
            seeds: one seed per prompt; sample g of prompt b draws its noise from a generator
                seeded with ``request_seed(seeds[b], g)``. Default: seeds drawn from torch's
                global RNG, so a call is reproducible under ``torch.manual_seed``.
            extra_inputs: each prompt's inputs beyond its ids (its images; None for text), whose
                placeholders ``prompt_ids`` holds expanded; a multimodal model only
                (`packrl.models.modality.Modality.check_prompts`).

        Returns:
            ``[B][G]`` responses in input order.

        Raises:
            ValueError: a prompt is empty, or fills the context (``P_b >= max_context_tokens``);
                the message names the prompt index, its length and the context.
        """
        if seeds is None:
            seeds = torch.randint(0, 1 << 62, (len(prompt_ids),)).tolist()
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompt_ids)} prompts; pass one seed per prompt")
        out: list[list[Response | None]] = [[None] * params.n for _ in prompt_ids]
        self._check_extra_inputs(prompt_ids, extra_inputs)
        requests = self._requests(prompt_ids, params, seeds)
        if extra_inputs is not None and any(x is not None for x in extra_inputs):
            requests = [dataclasses.replace(r, extra_inputs=extra_inputs[r.prompt_index]) for r in requests]
        for req, response in zip(requests, self._run(requests, params)):
            out[req.prompt_index][req.sample_index] = response
        return out  # type: ignore[return-value]

    def generate_until(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                       caps: Sequence[int], enough: Callable[[Sequence[bool]], bool]) -> list[Response]:
        """One response per prompt (``params.n`` is ignored), each capped at its own ``caps[i]``
        tokens (and the context), generation stopping between decode rounds once
        ``enough(finished)`` holds: ``finished[i]`` is True once prompt i's response ended (EOS, a
        stop string or its cap). Responses still running then come back with the tokens they
        have and finish reason ``abort``; so do prompts of batches not started. Prompt i draws as
        sample 0 of ``seeds[i]`` (`request_seed`), its noise keyed by position, so a response cut
        here and continued later draws what it would have drawn uninterrupted (same weights).
        Partial rollouts (`packrl.trainer.stages.partial`) cut the long tail this way without
        re-prefilling the members that keep running.

        Raises:
            ValueError: as `generate`; a cap < 1, or caps not one per prompt.
        """
        if len(caps) != len(prompt_ids) or len(seeds) != len(prompt_ids) or any(c < 1 for c in caps):
            raise ValueError(f"generate_until needs one seed and one cap >= 1 per prompt; got {len(prompt_ids)} prompts, "
                             f"{len(seeds)} seeds, caps {list(caps)[:8]}")
        one = dataclasses.replace(params, n=1, max_response_tokens=max(caps))
        requests = [dataclasses.replace(r, cap=min(r.cap, int(cap)))
                    for r, cap in zip(self._requests(prompt_ids, one, seeds), caps)]
        return self._run(requests, one, enough)

    def _run(self, requests: list[_Request], params: SamplingParams,
             enough: Callable[[Sequence[bool]], bool] | None = None) -> list[Response]:
        """The responses to ``requests``, in their order: sorted by prompt length into batches of
        at most ``max_num_seqs``, each generated by `_generate_batch`. With ``enough`` (see
        `generate_until`) a batch stops between rounds once it holds, and batches not started by
        then come back empty with finish reason ``abort``."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))
        out: list[Response | None] = [None] * len(requests)
        finished = [False] * len(requests)
        pack = self.options.pack_linears and params.max_response_tokens >= self.options.pack_min_tokens
        with self._generation_mode(min(self.max_num_seqs, len(requests)), pack=pack):
            for start in range(0, len(order), self.max_num_seqs):
                rows = order[start:start + self.max_num_seqs]
                if enough is not None and enough(finished):
                    for i in rows:
                        out[i] = Response((), "abort", rollout_logprobs=() if params.return_logprobs else None)
                    continue
                on_round = None if enough is None else functools.partial(_mark_finished, rows, finished, enough)
                for i, response in zip(rows, self._generate_batch([requests[i] for i in rows], params, on_round)):
                    out[i] = response
        assert all(r is not None for r in out), "a request got no response"
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (and cast) the policy's new weights into the engine's model, by name; nothing when
        the engine generates on the policy itself (``shares_policy``).

        Raises:
            ValueError: a name the engine's model does not have (the weights of another model).
        """
        if self.shares_policy:
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under every name
        for name, value in weights:
            if name not in params:
                raise ValueError(f"the rollout engine's model has no parameter {name!r}; its weights come from another model")
            params[name].copy_(value)

    def describe(self) -> str:
        """One phrase for ``model.txt``: how this engine's cache works for this model (`CacheReuse`)."""
        return self.cache_reuse.describe()

    def sleep(self) -> None:
        """Nothing to release: the KV cache lives only inside `generate`."""

    def wake_up(self) -> None:
        """Nothing to reacquire (see `sleep`)."""

    def close(self) -> None:
        """Nothing to release: the model goes with the engine."""

    def _requests(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[_Request]:
        """Expand each prompt into `params.n` requests with their caps; reject prompts without room."""
        requests = []
        for b, ids in enumerate(prompt_ids):
            prompt = tuple(int(t) for t in ids)
            room = self.max_context_tokens - len(prompt)
            if not prompt:
                raise ValueError(f"prompt {b} is empty; the engine needs at least one prompt token (check the data and chat template)")
            if room < 1:
                raise ValueError(
                    f"prompt {b} has {len(prompt):,} tokens >= max_context_tokens={self.max_context_tokens:,}, leaving no "
                    "room for a response; lower data.max_prompt_tokens below the model context (over-long prompts are then "
                    "handled by data.overlong_prompt)"
                )
            cap = min(params.max_response_tokens, room)
            reason: FinishReason = "length" if cap == params.max_response_tokens else "context"
            requests += [_Request(b, g, prompt, cap, reason, request_seed(int(seeds[b]), g)) for g in range(params.n)]
        return requests

    @contextlib.contextmanager
    def _generation_mode(self, num_rows: int, *, pack: bool) -> Iterator[None]:
        """No grad, eval mode (restored afterwards), autocast when ``autocast_dtype`` is set, and with
        ``pack`` the bf16 CPU Linear layers on weights packed for batches of ``num_rows`` rows
        (`packrl.rollout.packed_linear`)."""
        was_training = self.model.training
        device_type = next(self.model.parameters()).device.type
        autocast = (
            torch.autocast(device_type, dtype=self.autocast_dtype) if self.autocast_dtype is not None else contextlib.nullcontext()
        )
        self.model.eval()
        try:
            with torch.no_grad(), autocast, (packed_linears(self.model, num_rows) if pack else contextlib.nullcontext()):
                yield
        finally:
            self.model.train(was_training)

    def _generate_batch(self, batch: list[_Request], params: SamplingParams,
                        on_round: Callable[[Sequence[bool]], bool] | None = None) -> list[Response]:
        """Left-pad one batch, generate in rounds, and cut each response at its own end.

        Generation runs in rounds of at most ``options.round_tokens`` new tokens over one KV cache. After
        each round, rows that are done (EOS, a stop string, or their own cap) leave the batch and
        the cache (`Cache.batch_select_indices`), so the remaining rounds decode only the rows
        still running: a decode step costs about 20 ms + 3 ms per row for the 135M shape on 2
        CPU cores, and most responses end well before the longest.

        ``on_round(done)`` (per batch row, True = ended) is asked after each round; when it returns
        True the rows still running stop and come back with finish reason ``abort``.
        """
        device = next(self.model.parameters()).device
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [b, P_max]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # 1 = real token
        for i, req in enumerate(batch):
            input_ids[i, width - len(req.prompt):] = torch.tensor(req.prompt)
            attention_mask[i, width - len(req.prompt):] = 1
        rows = _Rows(len(batch), params.return_logprobs)
        alive = torch.arange(len(batch))  # batch rows still generating, in cache order
        ended = torch.zeros(len(batch), dtype=torch.bool)  # rows whose response ended
        cut: set[int] = set()  # rows stopped by on_round
        ids, mask = input_ids.to(device), attention_mask.to(device)
        extra = self._generate_inputs(batch, ids)
        reuses = self.cache_reuse.reuses and not extra  # a modality's state (M-RoPE offsets) is kept per batch: one round
        cache = self._new_cache(ids, mask, batch) if reuses else None
        cap = max(r.cap for r in batch)
        round_tokens = self.options.round_tokens if reuses else cap
        generators = [torch.Generator(device=device).manual_seed(r.seed) for r in batch]
        while len(alive) and rows.steps < cap:
            kwargs = self._generate_kwargs(params, max_new_tokens=min(round_tokens, cap - rows.steps),
                                           generators=[generators[int(row)] for row in alive],
                                           seeds=[batch[int(row)].seed for row in alive],
                                           positions=[len(batch[int(row)].prompt) + rows.steps for row in alive])
            reused = {self.cache_reuse.argument: cache} if cache is not None else {}
            # torch types a module's attributes as Tensor | Module; this is the transformers model's generate, which
            # returns this dataclass for a decoder-only model under return_dict_in_generate (`_generate_kwargs`)
            generate = cast(Callable[..., GenerateDecoderOnlyOutput], self.model.generate)
            out = generate(input_ids=ids, attention_mask=mask, **{**kwargs, **reused, **extra})
            new = out.sequences[:, ids.shape[1]:]  # [a, r] this round's tokens
            logprobs = None
            if params.return_logprobs:
                assert out.logits is not None  # asked for with output_logits (`_generate_kwargs`)
                logprobs = _token_logprobs(out.logits, new, params.logprob_temperature)
            rows.add(alive, new.cpu(), logprobs, pad_id=self.pad_id)
            stop = self._stop_steps(out.sequences.cpu(), ids.shape[1], params)
            done = [
                bool(any(int(t) in self.eos_ids for t in new[i].tolist())) or stop[i] != _NEVER or rows.steps >= batch[int(row)].cap
                for i, row in enumerate(alive)
            ]
            keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long)
            ended[alive[torch.tensor([i for i, d in enumerate(done) if d], dtype=torch.long)]] = True
            if len(keep) == 0:
                break
            if on_round is not None and on_round(ended.tolist()):
                cut = set(alive[keep].tolist())
                break
            assert reuses, "a batch without a reusable cache generates in one round"
            cache = getattr(out, _CACHE_KEY)  # the same object the engine made
            if len(keep) < len(alive):
                select_rows(cache, keep.to(device))
            alive = alive[keep]
            ids = out.sequences[keep.to(device)]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], new.shape[1])], dim=1)[keep.to(device)]
        generated, logprobs = rows.stack()  # [b, R_gen]
        sequences = torch.cat([input_ids, generated], dim=1)
        stop_steps = self._stop_steps(sequences, width, params)
        return [
            _aborted(generated[i], None if logprobs is None else logprobs[i]) if i in cut else
            self._cut(req, generated[i], stop_steps[i], None if logprobs is None else logprobs[i])
            for i, req in enumerate(batch)
        ]

    def _check_extra_inputs(self, prompt_ids: Sequence[Sequence[int]], extra_inputs: Sequence[ExtraInputs | None] | None) -> None:
        """Raises: ValueError: as the model's modality checks its prompts
        (`packrl.models.modality.Modality.check_prompts`), or a text model got extra inputs."""
        if self.modality is not None:
            self.modality.check_prompts(self.model, prompt_ids, extra_inputs)
            return
        given = [(b, type(x).__name__) for b, x in enumerate(extra_inputs or ()) if x is not None]
        if given:
            raise ValueError(f"prompt {given[0][0]} comes with extra inputs ({given[0][1]}) but the model takes text only; "
                             "such prompts need a multimodal model.path")

    def _generate_inputs(self, batch: list[_Request], ids: torch.Tensor) -> dict[str, Any]:
        """The extra arguments of ``generate`` for ``batch`` (rows ``ids``): its modality's
        (`packrl.models.modality.Modality.generate_inputs`, every row's inputs in row order); empty
        for a text batch."""
        rows = [r.extra_inputs for r in batch if r.extra_inputs is not None]
        if self.modality is None or not rows:
            return {}
        return self.modality.generate_inputs(self.model, rows, ids)

    def _new_cache(self, ids: torch.Tensor, mask: torch.Tensor, batch: list[_Request]) -> Any:
        """A batch's KV cache (``options.kv_cache``), each group's prompt prefilled once (`_shared_prefill`)."""
        cache = self.options.kv_cache(self.model.config)
        self._shared_prefill(ids, mask, batch, cache)
        return cache

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, batch: list[_Request], cache: Any) -> None:
        """Fill the empty ``cache`` with every row's prompt but its last token, computed once per
        distinct prompt (the G samples of a prompt are adjacent rows) and copied to each of its
        rows; the first decode step then runs only the last prompt token. Prompts of very different
        lengths (a resumed partial rollout's prompt + prefix next to fresh prompts) are prefilled
        in length buckets (`prefill_buckets`), each at its own width, and placed right-aligned in
        the batch's left-padded cache: the padding of the widest prompt is not computed for every
        row. Nothing when no two rows share a prompt, one bucket holds them all, or prompts are one
        token wide (``generate`` then prefills every row). Positions follow the attention mask as
        ``generate``'s own do (left padding), so the cache holds what ``generate`` would put there
        at every real position; padded positions are masked.

        Args:
            ids: the left-padded prompts, Shape [b, P_max], int64; mask: 1 = real token, same shape.
        """
        firsts = [i for i in range(len(batch)) if i == 0 or batch[i].prompt != batch[i - 1].prompt]
        if ids.shape[1] < 2:
            return
        lengths = [len(batch[i].prompt) - 1 for i in firsts]
        buckets = prefill_buckets(lengths) if _mergeable(cache) else [list(range(len(firsts)))]
        if len(firsts) == len(batch) and len(buckets) == 1:
            return
        owner = torch.tensor([len([f for f in firsts if f <= i]) - 1 for i in range(len(batch))], device=ids.device)
        width = ids.shape[1] - 1
        parts = []
        for bucket in buckets:
            w = width if len(buckets) == 1 else max(lengths[k] for k in bucket)
            if w == 0:
                continue  # one-token prompts: nothing before their last token
            rows = torch.tensor([firsts[k] for k in bucket], device=ids.device)
            prefix_mask = mask[rows, width - w:width]
            positions = (prefix_mask.cumsum(-1) - 1).masked_fill_(prefix_mask == 0, 1)
            target = cache if len(buckets) == 1 else self.options.kv_cache(self.model.config)
            self.model(input_ids=ids[rows, width - w:width], attention_mask=prefix_mask, position_ids=positions, use_cache=True,
                       **{self.cache_reuse.argument: target})
            parts.append((torch.tensor(bucket, device=ids.device), w, target))
        if len(buckets) > 1:
            _merge_right_aligned(cache, parts, len(firsts), width)
        select_rows(cache, owner)  # one copy per row

    def _generate_kwargs(self, params: SamplingParams, *, max_new_tokens: int, generators: Sequence[torch.Generator],
                         seeds: Sequence[int], positions: Sequence[int]) -> dict[str, Any]:
        """Arguments for `model.generate`: the requested sampling (row i's noise from
        ``generators[i]``, reseeded per token from ``seeds[i]`` and its absolute position, which
        starts at ``positions[i]``: `GumbelMaxSampler`) and nothing else."""
        kwargs: dict[str, Any] = dict(
            _OFF,
            max_new_tokens=max_new_tokens,
            do_sample=not params.greedy,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            stop_strings=list(params.stop) or None,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=params.return_logprobs,
        )
        if params.stop:
            # Only with stop strings: this transformers release also hands `tokenizer` on to
            # the model's forward as an extra keyword.
            kwargs["tokenizer"] = self.tokenizer
        if not params.greedy:
            # Sampling runs as greedy decoding over scores that single out a Gumbel-max draw
            # (exact, and faster than multinomial): the warpers and the sampler are passed as
            # processors, and the generation_config's own temperature/top-k/top-p (top_k=50 by
            # default) are disabled. Temperature 1 divides by 1: no warper.
            warpers: list[LogitsProcessor] = [] if params.temperature == 1.0 else [TemperatureLogitsWarper(params.temperature)]
            if params.top_k > 0:
                warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(params.top_p))
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None,
                          logits_processor=LogitsProcessorList([*warpers, GumbelMaxSampler(generators, seeds, positions)]))
        return kwargs

    def _stop_steps(self, sequences: torch.Tensor, width: int, params: SamplingParams) -> list[int]:
        """Per row, the first generated step at which a stop string completes (`_NEVER` if none).

        Runs transformers' `StopStringCriteria` on every prefix of the returned ids, the same
        check generation ran after each step, so the step found is the one it stopped at.

        Args:
            sequences: prompt + generated ids. Shape [b, P_max + R_gen], int64.
            width: P_max, the padded prompt width.
        """
        if not params.stop:
            return [_NEVER] * sequences.shape[0]
        criteria = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(params.stop))
        hits = torch.stack(
            [criteria(sequences[:, : width + t + 1], None) for t in range(sequences.shape[1] - width)], dim=1
        )  # [b, R_gen] bool
        return [int(row.nonzero()[0]) if row.any() else _NEVER for row in hits]

    def _cut(self, req: _Request, generated: torch.Tensor, stop_step: int, logprobs: torch.Tensor | None) -> Response:
        """One row's response: up to its first EOS, its first stop string, or its cap.

        Args:
            req: the request (its cap and which cap that is).
            generated: this row's generated ids. Shape [R_gen], int64; later columns of a row
                that stopped are padding.
            stop_step: first step completing a stop string, or `_NEVER`.
            logprobs: this row's token log-probs. Shape [R_gen], float32, nats; or None.
        """
        ids = generated[: req.cap].tolist()
        eos_step = next((t for t, tok in enumerate(ids) if tok in self.eos_ids), _NEVER)
        end = min(eos_step, stop_step)
        if end < len(ids):
            reason: FinishReason = "eos" if eos_step <= stop_step else "stop"
            ids = ids[: end + 1]
        else:
            assert len(ids) == req.cap, f"generation stopped a row after {len(ids)} < {req.cap} tokens without EOS or stop string"
            reason = req.cap_reason
        lps = None if logprobs is None else tuple(logprobs[: len(ids)].tolist())
        return Response(response_ids=tuple(ids), finish_reason=reason, rollout_logprobs=lps)


PREFILL_CALL_TOKENS = 128
"""The fixed cost of one prefill forward, counted in prompt tokens of work, that `prefill_buckets`
weighs against padding: a forward of the 135M shape on 2 CPU cores costs about as much as this
many extra tokens do."""


def prefill_buckets(lengths: Sequence[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[list[int]]:
    """Split prompts into prefill batches, each padded to its longest prompt, that minimise the
    tokens computed (rows x width, summed) plus ``call_tokens`` per batch: the best split of the
    prompts sorted by length into contiguous runs (dynamic programming, O(n^2) for n prompts).

    Args:
        lengths: tokens per prompt.

    Returns:
        Batches of indices into ``lengths``, shortest prompts first; one batch when padding costs
        less than another forward.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best, cut = [0] + [1 << 62] * len(order), [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):
            cost = best[j] + (i - j) * lengths[order[i - 1]] + call_tokens
            if cost < best[i]:
                best[i], cut[i] = cost, j
    buckets, i = [], len(order)
    while i:
        buckets.append(order[cut[i]:i])
        i = cut[i]
    return buckets[::-1]


def _mergeable(cache: Any) -> bool:
    """Whether ``cache`` holds only full-attention key/value layers, which bucketed prefills can fill."""
    layers: list[Any] = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) in (DynamicLayer, AppendingLayer) for layer in layers)


def _merge_right_aligned(cache: Any, parts: Sequence[tuple[torch.Tensor, int, Any]], num_rows: int, width: int) -> None:
    """Write each part's keys and values ``(rows [k] int64, w positions, its cache)`` into rows
    ``rows`` and the last ``w`` of ``width`` positions of the empty ``cache`` (zeros elsewhere:
    padding, masked), one ``update`` per layer."""
    for layer_idx in range(len(cache.layers)):
        first = parts[0][2].layers[layer_idx]  # keys, values: [k, h, w, d]
        keys = first.keys.new_zeros(num_rows, first.keys.shape[1], width, first.keys.shape[3])
        values = first.values.new_zeros(num_rows, first.values.shape[1], width, first.values.shape[3])
        for rows, w, part in parts:
            keys[rows, :, width - w:] = part.layers[layer_idx].keys
            values[rows, :, width - w:] = part.layers[layer_idx].values
        cache.update(keys, values, layer_idx)


def _mark_finished(rows: list[int], finished: list[bool], enough: Callable[[Sequence[bool]], bool], done: Sequence[bool]) -> bool:
    """After a round of the batch of requests ``rows``: record which ended (``done``, per batch row)
    in ``finished`` (per request of the call) and ask ``enough``."""
    for i, d in zip(rows, done):
        finished[i] = d
    return enough(finished)


def _aborted(generated: torch.Tensor, logprobs: torch.Tensor | None) -> Response:
    """A row stopped while running: every column it generated (it has not ended, so none is padding)."""
    return Response(tuple(generated.tolist()), "abort", rollout_logprobs=None if logprobs is None else tuple(logprobs.tolist()))


class _Rows:
    """Generated ids (and log-probs) of a batch's rows, gathered across rounds; a row that left
    the batch is padded with the pad id (log-prob 0), as `model.generate` pads finished rows."""

    def __init__(self, num_rows: int, with_logprobs: bool) -> None:
        self.ids: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
        self.logprobs: list[list[torch.Tensor]] | None = [[] for _ in range(num_rows)] if with_logprobs else None
        self.steps = 0  # tokens generated per running row so far

    def add(self, rows: torch.Tensor, new: torch.Tensor, logprobs: torch.Tensor | None, *, pad_id: int) -> None:
        """Append a round: ``new`` [a, r] int64 for batch ``rows`` [a]; others get ``r`` pads."""
        running = set(rows.tolist())
        for i in range(len(self.ids)):
            if i not in running:
                self.ids[i].append(torch.full((new.shape[1],), pad_id, dtype=torch.long))
                if self.logprobs is not None:
                    self.logprobs[i].append(torch.zeros(new.shape[1]))
        for j, i in enumerate(rows.tolist()):
            self.ids[i].append(new[j])
            if self.logprobs is not None:
                assert logprobs is not None
                self.logprobs[i].append(logprobs[j])
        self.steps += new.shape[1]

    def stack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shapes [b, R_gen] int64 and [b, R_gen] float32 (or None)."""
        ids = torch.stack([torch.cat(r) for r in self.ids])
        lps = None if self.logprobs is None else torch.stack([torch.cat(r) for r in self.logprobs])
        return ids, lps


def _token_logprobs(logits: tuple[torch.Tensor, ...], generated: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-prob of each generated token under ``softmax(logits / temperature)``.

    Args:
        logits: raw logits per step, as `model.generate` returns them. R_gen tensors of Shape [b, V].
        generated: the generated ids. Shape [b, R_gen], int64.
        temperature: > 0.

    Returns:
        Shape [b, R_gen], float32, nats.
    """
    assert len(logits) == generated.shape[1], f"{len(logits)} logit steps for {generated.shape[1]} generated tokens"
    steps = [
        torch.log_softmax(step.float() / temperature, dim=-1).gather(1, generated[:, t : t + 1].to(step.device)).squeeze(1)
        for t, step in enumerate(logits)
    ]
    return torch.stack(steps, dim=1).cpu()


@ROLLOUT_ENGINES.register("hf", info=HF_ENGINE)
def build_hf_engine(context: EngineContext) -> HFEngine:
    """The ``hf`` engine (`packrl.registry.ROLLOUT_ENGINES`): `HFEngine` on the policy's own
    parameters when it may share them and the compute dtype is the parameters' own (fp32, fp64),
    else on a copy of the weights in the compute dtype (`rollout_copy`), refreshed by
    `HFEngine.load_weights` after every update."""
    compute = context.compute_dtype
    dtype = compute.torch_dtype() if compute.autocast or not context.may_share_policy else None
    model = rollout_copy(context.policy, dtype)
    return HFEngine(model, context.tokenizer, max_context_tokens=context.max_context_tokens,
                    max_num_seqs=context.options.max_num_seqs, shares_policy=model is context.policy)
