"""HFEngine: finish reasons, stop strings, order restore, prompt ids, rollout log-probs, caps.

A tiny random Llama (vocab 97) with a character-level tokenizer: ids 0..3 are <pad> <bos> <eos>
<unk>, ids 4..96 one printable character each.
"""

from __future__ import annotations

import dataclasses
import string
from collections import Counter
from dataclasses import replace

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from packrl.config.schema import RolloutConfig
from packrl.rollout import HFEngine, RolloutEngine, SamplingParams
from packrl.rollout.hf_engine import PREFILL_CALL_TOKENS, prefill_buckets
from tests.conftest import tiny_llama

PAD, EOS = 0, 2
CHARS = string.ascii_letters + string.digits + " " + string.punctuation[:30]  # 93 characters


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 97, (n,), generator=g).tolist() for n in lengths]


def _force_token(model: torch.nn.Module, token: int) -> torch.nn.Module:
    """Make `token` the model's argmax at every position: a zero LM head with a bias on `token`."""
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[token] = 30.0
    model.lm_head = head
    return model


def _engine(model, tokenizer, *, context: int = 512, max_num_seqs: int = 64, **kw) -> HFEngine:
    return HFEngine(model, tokenizer, max_context_tokens=context, max_num_seqs=max_num_seqs, **kw)


def _cache(kwargs: dict):
    """The KV cache a forward receives (``cache`` in newer transformers 5 releases, ``past_key_values`` before)."""
    return kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")


def _record_prefills(model) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Record (input_ids, attention_mask, model.training) of every prefill forward."""
    calls = []

    def hook(module, args, kwargs):
        cache = _cache(kwargs)
        if cache is None or cache.get_seq_length() == 0:  # the prefill: nothing cached yet
            ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
            if mask is None:  # transformers drops a mask without padding
                mask = torch.ones_like(ids)
            calls.append((ids.clone(), mask.clone(), module.training))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_hf_engine_is_a_rollout_engine(tokenizer):
    assert isinstance(_engine(tiny_llama(), tokenizer), RolloutEngine)


def test_response_and_context_caps_give_length_and_context(tokenizer):
    # context 20, budget 6: a 3-token prompt reaches the budget, a 17-token prompt the context
    # (room 3), a 14-token prompt both at once (room 6 == budget: the budget counts).
    engine = _engine(_force_token(tiny_llama(), 5), tokenizer, context=20)
    prompts = _prompts([3, 17, 14])
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_response_tokens=6))
    expected = [("length", 6), ("context", 3), ("length", 6)]
    for group, (reason, cap) in zip(out, expected):
        for r in group:
            assert r.finish_reason == reason and r.truncated
            assert r.response_ids == (5,) * cap
    assert all(len(p) + len(r.response_ids) <= 20 for p, g in zip(prompts, out) for r in g)


def test_eos_from_the_tokenizer_ends_the_response_and_is_kept(tokenizer):
    model = _force_token(tiny_llama(), EOS)
    model.generation_config.eos_token_id = None  # the tokenizer's EOS alone must count
    out = _engine(model, tokenizer).generate(_prompts([4, 9]), SamplingParams(n=3, max_response_tokens=8))
    assert all(r.response_ids == (EOS,) and r.finish_reason == "eos" and not r.truncated for g in out for r in g)


def test_eos_from_the_generation_config_list_cuts_mid_batch(tokenizer):
    model = tiny_llama()
    prompts = _prompts([6, 11])
    greedy = SamplingParams(temperature=0.0, max_response_tokens=16)
    ref = _engine(model, tokenizer).generate(prompts, greedy)[0][0].response_ids
    k = next(t for t in range(2, len(ref)) if ref[t] not in ref[:t])
    model.generation_config.eos_token_id = [EOS, ref[k]]
    engine = _engine(model, tokenizer)
    assert engine.eos_ids == {EOS, ref[k]}
    out = engine.generate(prompts, greedy)
    first = out[0][0]
    assert first.finish_reason == "eos" and first.response_ids == ref[: k + 1]
    for r in (first, out[1][0]):  # every row ends at its first EOS id, whatever the batch did
        ids = r.response_ids
        assert not any(t in engine.eos_ids for t in ids[:-1])
        assert (r.finish_reason == "eos") == (ids[-1] in engine.eos_ids)
        assert len(ids) <= 16


def test_stop_strings_end_a_response_at_their_first_completion(tokenizer):
    engine = _engine(tiny_llama(), tokenizer, max_num_seqs=3)
    prompts = _prompts([5, 8])
    params = SamplingParams(n=2, temperature=1.0, max_response_tokens=20)
    torch.manual_seed(0)
    ref = engine.generate(prompts, params)
    torch.manual_seed(0)
    assert engine.generate(prompts, params) == ref  # the caller's seed makes a call reproducible
    ids = ref[1][1].response_ids
    text = tokenizer.decode(ids)
    k = next(t for t in range(3, len(ids)) if text[t - 1 : t + 1] not in tokenizer.decode(prompts[1][-1:]) + text[:t])
    stop = text[k - 1 : k + 1]

    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_response_tokens=20, stop=(stop, "never!")))
    hit = out[1][1]
    assert hit.finish_reason == "stop" and not hit.truncated
    assert hit.response_ids == ids[: k + 1] and tokenizer.decode(hit.response_ids).endswith(stop)
    for got, want in zip([r for g in out for r in g], [r for g in ref for r in g]):
        # the same draws: every response is its reference, cut where the stop string completes
        assert want.response_ids[: len(got.response_ids)] == got.response_ids
        assert got.finish_reason == ("stop" if stop in tokenizer.decode(got.response_ids) else want.finish_reason)


def test_groups_come_back_in_input_order_and_prompts_reach_the_model_unchanged(tokenizer):
    model = tiny_llama()
    model.train()
    prefills = _record_prefills(model)
    prompts = _prompts([5, 1, 9, 3, 12, 7, 2])
    greedy = dict(temperature=0.0, max_response_tokens=8)
    engine = _engine(model, tokenizer, max_num_seqs=4)
    engine._shared_prefill = lambda ids, mask, batch, cache: None  # every row prefills its whole prompt (the shared prefill: below)
    batched = engine.generate(prompts, SamplingParams(n=3, **greedy))
    assert len(prefills) == 6  # 21 requests in batches of <= 4
    received = []
    for ids, mask, training in prefills:
        assert not training and ids.shape[0] <= 4
        for row, row_mask in zip(ids, mask):
            real = row_mask.bool()
            assert torch.equal(real, real.sort().values), "padding must be on the left"
            assert (row[~real] == PAD).all()
            received.append(tuple(row[real].tolist()))
    assert Counter(received) == Counter(tuple(p) for p in prompts for _ in range(3))  # invariant 5
    assert model.training  # mode restored

    solo = _engine(model, tokenizer, max_num_seqs=1)
    alone = [solo.generate([p], SamplingParams(n=1, **greedy))[0][0] for p in prompts]
    for group, single in zip(batched, alone):
        assert len(group) == 3 and all(r == single for r in group)
    assert len({r.response_ids for r in alone}) > 1, "responses should depend on the prompt"


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 20, 0.9), (1.3, 0, 1.0), (0.0, 0, 1.0)])
def test_rollout_logprobs_match_a_teacher_forced_forward(tokenizer, temperature, top_k, top_p):
    model = tiny_llama()
    prompts = _prompts([4, 10, 7])
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_response_tokens=12, return_logprobs=True)
    torch.manual_seed(0)
    out = _engine(model, tokenizer, max_num_seqs=4).generate(prompts, params)
    scale = temperature if temperature > 0 else 1.0  # greedy reports temperature 1
    with torch.no_grad():
        for prompt, group in zip(prompts, out):
            for r in group:
                seq = torch.tensor([prompt + list(r.response_ids)])
                logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
                want = torch.log_softmax(logits / scale, dim=-1).gather(1, seq[0, len(prompt):, None]).squeeze(1)
                got = torch.tensor(r.rollout_logprobs)
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_model_generation_defaults_do_not_change_sampling(tokenizer):
    model = tiny_llama()
    model.generation_config.top_k = 1  # would make every sample the argmax
    model.generation_config.repetition_penalty = 5.0
    torch.manual_seed(0)
    out = _engine(model, tokenizer).generate(_prompts([6]), SamplingParams(n=8, max_response_tokens=6))
    assert len({r.response_ids for r in out[0]}) > 1

    forced = _force_token(tiny_llama(), EOS)
    forced.generation_config.min_new_tokens = 4  # would forbid EOS for 4 tokens
    assert _engine(forced, tokenizer).generate(_prompts([3]), SamplingParams(max_response_tokens=6))[0][0].response_ids == (EOS,)


def test_autocast_generation_keeps_the_caps(tokenizer):
    engine = _engine(_force_token(tiny_llama(), 7), tokenizer, context=12, autocast_dtype=torch.bfloat16)
    out = engine.generate(_prompts([2, 9]), SamplingParams(n=2, max_response_tokens=5, return_logprobs=True))
    assert [[(r.finish_reason, len(r.response_ids)) for r in g] for g in out] == [[("length", 5)] * 2, [("context", 3)] * 2]
    assert all(len(r.rollout_logprobs) == len(r.response_ids) for g in out for r in g)


@pytest.mark.parametrize("length", [10, 13])
def test_a_prompt_filling_the_context_is_an_error_naming_it(tokenizer, length):
    engine = _engine(tiny_llama(), tokenizer, context=10)
    with pytest.raises(ValueError, match=rf"prompt 1 has {length} tokens >= max_context_tokens=10.*data.max_prompt_tokens"):
        engine.generate(_prompts([3, length]), SamplingParams(max_response_tokens=4))


def test_an_empty_prompt_is_an_error_naming_it(tokenizer):
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        _engine(tiny_llama(), tokenizer).generate([[5], [6], []], SamplingParams())


def test_sampling_params_from_config():
    cfg = RolloutConfig(n=4, temperature=0.9, top_p=0.95, top_k=40, max_response_tokens=64, stop=["</a>"],
                        return_logprobs=True, val_temperature=0.0)
    train = SamplingParams.from_config(cfg)
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_response_tokens, train.stop, train.return_logprobs) == (
        4, 0.9, 0.95, 40, 64, ("</a>",), True)
    assert not train.greedy and train.logprob_temperature == 0.9
    val = SamplingParams.from_config(cfg, validation=True)
    got = (val.n, val.temperature, val.greedy, val.logprob_temperature, val.stop, val.return_logprobs)
    assert got == (1, 0.0, True, 1.0, ("</a>",), False)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"n": 0}, "rollout.n"), ({"temperature": -1.0}, "rollout.temperature"), ({"top_p": 0.0}, "rollout.top_p"),
     ({"top_k": -2}, "rollout.top_k"), ({"max_response_tokens": 0}, "rollout.max_response_tokens"),
     ({"stop": ("",)}, "rollout.stop")],
)
def test_sampling_params_reject_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)


def test_gumbel_max_sampler_draws_from_the_softmax():
    """The token the sampler singles out is a draw from softmax(scores): frequencies over 40,000
    draws match the probabilities (filtered -inf scores are never drawn)."""
    from packrl.rollout.sampling import GumbelMaxSampler

    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    generators = [torch.Generator().manual_seed(i) for i in range(40_000)]
    out = GumbelMaxSampler(generators)(None, scores.expand(40_000, -1).clone())
    assert torch.isneginf(out).sum(-1).eq(4).all(), "one token per row is left to the argmax"
    draws = out.argmax(-1)
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(scores[0], -1), atol=0.01, rtol=0)
    assert freq[4] == 0


@pytest.mark.parametrize("vocab", [257, 1000])
def test_two_level_gumbel_max_draws_across_blocks_from_the_softmax(vocab):
    """Block, then entry: the two levels together draw from softmax(scores) over a vocabulary of
    several blocks (one partial), with filtered tokens and a whole filtered block never drawn."""
    from packrl.rollout.sampling import two_level_gumbel_max

    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(vocab, generator=gen)
    scores[::2] = float("-inf")
    scores[256:512] = float("-inf")  # a whole block filtered
    scores[3], scores[vocab - 2] = 4.0, 3.0  # large mass in the first and the last block
    generators = [torch.Generator().manual_seed(i) for i in range(20_000)]
    draws = two_level_gumbel_max(scores.expand(20_000, -1).clone(), generators)
    freq = torch.bincount(draws, minlength=vocab).float() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(scores, -1), atol=0.01, rtol=0)
    assert not torch.isneginf(scores[draws]).any(), "a filtered token was drawn"


def test_a_response_depends_on_its_seed_not_on_its_batch(model, tokenizer):
    """Per-request seeds: prompts sampled together, alone or split into two calls (as two
    data-parallel workers would) give the same responses."""
    prompts = _prompts([4, 9, 6, 11])
    seeds = [11, 22, 33, 44]
    params = SamplingParams(n=2, temperature=1.0, max_response_tokens=8)
    together = _engine(model, tokenizer, max_num_seqs=8).generate(prompts, params, seeds)
    split = [*_engine(model, tokenizer).generate(prompts[:2], params, seeds[:2]),
             *_engine(model, tokenizer).generate(prompts[2:], params, seeds[2:])]
    alone = [_engine(model, tokenizer).generate([p], params, [s])[0] for p, s in zip(prompts, seeds)]
    ids = lambda groups: [[r.response_ids for r in g] for g in groups]  # noqa: E731
    assert ids(together) == ids(split) == ids(alone)
    assert ids(together)[0][0] != ids(together)[0][1], "the samples of one prompt differ"
    with pytest.raises(ValueError, match="got 1 seeds for 4 prompts"):
        _engine(model, tokenizer).generate(prompts, params, [1])


def _record_decode_rows(model) -> list[int]:
    """Rows of every decode forward (one new token per row, something cached)."""
    rows = []

    def hook(module, args, kwargs):
        cache = _cache(kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            rows.append(kwargs["input_ids"].shape[0])

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


def test_finished_rows_leave_the_batch_and_rounds_change_nothing(tokenizer):
    model = tiny_llama()
    prompts = _prompts([3, 8, 5, 12, 6, 9, 4, 7])
    params = SamplingParams(temperature=0.0, max_response_tokens=30, return_logprobs=True)
    ref = _engine(model, tokenizer).generate(prompts, params)
    # Three of the tokens the greedy rows produce become EOS ids, so rows end at different steps.
    firsts = Counter(r.response_ids[t] for g in ref for r in g for t in (2, 5, 9))
    model.generation_config.eos_token_id = [EOS, *[t for t, _ in firsts.most_common(3)]]
    one_round = _engine(model, tokenizer)
    one_round.options = replace(one_round.options, round_tokens=10_000)
    want = one_round.generate(prompts, params)
    rows = _record_decode_rows(model)
    rounds = _engine(model, tokenizer)
    rounds.options = replace(rounds.options, round_tokens=2)
    got = rounds.generate(prompts, params)
    lengths = sorted(len(g[0].response_ids) for g in want)
    assert lengths[0] < lengths[-1], "the rows should end at different steps"
    for g_want, g_got in zip(want, got):
        assert g_got[0].response_ids == g_want[0].response_ids and g_got[0].finish_reason == g_want[0].finish_reason
        torch.testing.assert_close(torch.tensor(g_got[0].rollout_logprobs), torch.tensor(g_want[0].rollout_logprobs), atol=1e-5, rtol=0)
    assert rows[0] == len(prompts) and min(rows) == sum(len(g[0].response_ids) == lengths[-1] for g in want)
    assert rows == sorted(rows, reverse=True)  # rows only ever leave


def test_stop_strings_across_round_boundaries(tokenizer):
    engine = _engine(tiny_llama(), tokenizer)
    engine.options = replace(engine.options, round_tokens=1)
    prompts = _prompts([5, 8, 3])
    params = SamplingParams(temperature=0.0, max_response_tokens=24, return_logprobs=True)
    ref = engine.generate(prompts, params)
    text = tokenizer.decode(ref[0][0].response_ids)
    k = next(t for t in range(3, len(text)) if text[t - 1 : t + 1] not in text[:t])
    stop = text[k - 1 : k + 1]  # two characters, generated in two different rounds
    out = engine.generate(prompts, dataclasses.replace(params, stop=(stop,)))
    assert out[0][0].finish_reason == "stop" and out[0][0].response_ids == ref[0][0].response_ids[: k + 1]
    for r, r_ref in zip((r for g in out for r in g), (r for g in ref for r in g)):
        decoded = tokenizer.decode(r.response_ids)
        assert r_ref.response_ids[: len(r.response_ids)] == r.response_ids
        if r.finish_reason == "stop":
            assert decoded.endswith(stop) and stop not in decoded[:-1]
        else:  # a row that stopped left the batch: the others' log-probs may move in the last float bits
            assert stop not in decoded and (r.response_ids, r.finish_reason) == (r_ref.response_ids, r_ref.finish_reason)
            torch.testing.assert_close(torch.tensor(r.rollout_logprobs), torch.tensor(r_ref.rollout_logprobs), atol=1e-5, rtol=0)
        assert len(r.rollout_logprobs) == len(r.response_ids)


def _same_as_every_row_prefilling(model, tokenizer, prompts, params, seeds, *, max_num_seqs: int):
    """Generate with the engine's own prefill and with every row prefilling its whole prompt;
    assert the same responses, finish reasons and log-probs (1e-5). Returns the recorded prefills
    of the engine's own run."""
    plain = _engine(model, tokenizer, max_num_seqs=max_num_seqs)
    plain._shared_prefill = lambda ids, mask, batch, cache: None
    want = plain.generate(prompts, params, seeds)
    prefills = _record_prefills(model)
    got = _engine(model, tokenizer, max_num_seqs=max_num_seqs).generate(prompts, params, seeds)
    for g_want, g_got in zip(want, got):
        for a, b in zip(g_want, g_got):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(b.rollout_logprobs), torch.tensor(a.rollout_logprobs), atol=1e-5, rtol=0)
    return prefills


def test_a_groups_prompt_is_prefilled_once_and_changes_nothing(tokenizer):
    """With G samples per prompt the prompt (all but its last token) is prefilled once per
    distinct prompt of a batch and copied to its rows: the responses, finish reasons and log-probs
    are those of every row prefilling its own copy."""
    model = tiny_llama()
    prompts = _prompts([5, 1, 9, 3, 12, 7])
    params = SamplingParams(n=4, temperature=1.0, max_response_tokens=10, return_logprobs=True)
    seeds = [5, 6, 7, 8, 9, 10]
    prefills = _same_as_every_row_prefilling(model, tokenizer, prompts, params, seeds, max_num_seqs=8)
    # 24 requests in batches of 8 = 2 prompts each: one prefill row per distinct prompt, without its last token
    assert [ids.shape[0] for ids, _, _ in prefills] == [2, 2, 2]
    received = sorted(tuple(row[mask.bool()].tolist()) for ids, mask, _ in prefills for row, mask in zip(ids, mask))
    assert received == sorted(tuple(p[:-1]) for p in prompts)  # invariant 5: the rest of each prompt is the first decode step


def test_prefill_buckets_split_only_where_padding_costs_more_than_a_forward():
    assert prefill_buckets([40, 41, 39, 42]) == [[2, 0, 1, 3]]  # alike: one batch
    assert prefill_buckets([40, 900, 41, 950]) == [[0, 2], [1, 3]]  # short and long prompts apart
    assert prefill_buckets([5, 900], call_tokens=10_000) == [[0, 1]]  # a forward dearer than the padding
    assert prefill_buckets([]) == []
    lengths = [3, 700, 20, 60, 400, 21, 5]
    buckets = prefill_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    cost = sum(len(b) * max(lengths[i] for i in b) + PREFILL_CALL_TOKENS for b in buckets)
    assert cost <= len(lengths) * max(lengths) + PREFILL_CALL_TOKENS  # never dearer than one padded batch


@pytest.mark.parametrize("n", [1, 3])
def test_prompts_of_very_different_lengths_prefill_in_buckets_and_change_nothing(tokenizer, n):
    """A batch mixing short prompts with long ones (a resumed partial rollout's prompt + prefix)
    prefills them in length buckets at their own widths: the responses, finish reasons and
    log-probs are those of every row prefilling its own left-padded copy."""
    model = tiny_llama()
    prompts = _prompts([4, 300, 6, 2, 280, 1])
    params = SamplingParams(n=n, temperature=1.0, max_response_tokens=10, return_logprobs=True)
    seeds = [5, 6, 7, 8, 9, 10]
    prefills = _same_as_every_row_prefilling(model, tokenizer, prompts, params, seeds, max_num_seqs=64)
    widths = sorted(ids.shape[1] for ids, _, _ in prefills)
    assert widths == [5, 299], "two buckets: the short prompts at their own width, the long ones at theirs"
    received = sorted(tuple(row[mask.bool()].tolist()) for ids, mask, _ in prefills for row, mask in zip(ids, mask))
    assert received == sorted(tuple(p[:-1]) for p in prompts)  # the one-token prompt: an all-padding row


def test_a_model_with_a_cache_of_its_own_kind_generates_as_before(tokenizer, monkeypatch):
    """An architecture transformers does not give a `DynamicCache` (RWKV, xLSTM, ...) gets no
    engine-made cache: ``generate`` builds its own, with the same responses."""
    model = tiny_llama()
    prompts = _prompts([3, 7, 5])
    params = SamplingParams(n=3, temperature=1.0, max_response_tokens=12, return_logprobs=True)
    want = _engine(model, tokenizer).generate(prompts, params, [1, 2, 3])
    monkeypatch.setattr(type(model), "_supports_default_dynamic_cache", classmethod(lambda cls: False))
    engine = _engine(model, tokenizer)
    engine.options = replace(engine.options, kv_cache=lambda config: pytest.fail("this model gets no engine-made cache"))
    got = engine.generate(prompts, params, [1, 2, 3])
    assert [[r.response_ids for r in g] for g in got] == [[r.response_ids for r in g] for g in want]
