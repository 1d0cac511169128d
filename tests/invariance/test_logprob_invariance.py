"""Invariant 1: a sequence's log-probs are the same alone, padded (left or right, any width) and
packed with any neighbours, to 1e-5 in float32, on every packed-attention path."""

from __future__ import annotations

import pytest
import torch

from packrl.models.attention import packed_forward
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.packing import pack_sequences
from tests.conftest import tiny_llama

ATOL = 1e-5


def _padded_logprobs(model, seqs, side: str, extra: int) -> list[torch.Tensor]:
    """Reference: a padded batch through the plain HF forward with a 2D mask."""
    width = max(len(s) for s in seqs) + extra
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl] = s
        mask[i, sl] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits.float()
    logp = torch.log_softmax(logits, -1)
    out = []
    for i, s in enumerate(seqs):
        start = width - len(s) if side == "left" else 0
        pred = logp[i, start : start + len(s) - 1].gather(1, s[1:, None]).squeeze(1)
        out.append(torch.cat([pred.new_zeros(1), pred]))
    return out


def _packed_logprobs(model, seqs, attention: str) -> list[torch.Tensor]:
    pack = pack_sequences(seqs)
    with torch.no_grad():
        result = pack_logprobs(model, pack, attention=attention, chunk_tokens=7)
    return pack.unpack(result.token_logprobs)


@pytest.fixture
def sequences():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g) for n in (11, 4, 17, 1, 9, 23)]


@pytest.mark.parametrize("attention", ["varlen", "block_mask", "position_ids"])
def test_alone_padded_packed_agree(model, sequences, attention):
    target = sequences[0]
    alone = _packed_logprobs(model, [target], attention)[0]
    variants = {
        "left pad 3": _padded_logprobs(model, [target, sequences[2]], "left", 3)[0],
        "left pad 8": _padded_logprobs(model, [target, sequences[5]], "left", 8)[0],
        "right pad 3": _padded_logprobs(model, [target, sequences[2]], "right", 3)[0],
        "right pad 8": _padded_logprobs(model, [target, sequences[5]], "right", 8)[0],
        "packed first": _packed_logprobs(model, [target, sequences[1], sequences[2]], attention)[0],
        "packed middle": _packed_logprobs(model, [sequences[5], target, sequences[3]], attention)[1],
        "packed last": _packed_logprobs(model, [sequences[4], sequences[3], target], attention)[2],
    }
    for name, got in variants.items():
        torch.testing.assert_close(got, alone, atol=ATOL, rtol=0, msg=f"{attention}: {name} differs from alone")


def test_every_sequence_of_a_pack_matches_alone(model, sequences):
    packed = _packed_logprobs(model, sequences, "varlen")
    for seq, got in zip(sequences, packed):
        torch.testing.assert_close(got, _packed_logprobs(model, [seq], "varlen")[0], atol=ATOL, rtol=0)


def test_eager_attention_with_float_block_mask(sequences):
    eager = tiny_llama(attn="eager")
    alone = [_packed_logprobs(eager, [s], "block_mask")[0] for s in sequences[:3]]
    for got, want in zip(_packed_logprobs(eager, sequences[:3], "block_mask"), alone):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_trap_use_cache_true_and_all_ones_mask_leak_naively_but_not_in_packs(model, sequences):
    """The saved config says use_cache=True; a naive packed call with a 2D all-ones mask leaks.
    packrl's paths take neither from the caller and must stay isolated on the same model."""
    assert model.config.use_cache is True
    pack = pack_sequences(sequences[:3])
    decoder = model.get_decoder()
    with torch.no_grad():
        naive = decoder(
            input_ids=pack.input_ids, position_ids=pack.position_ids,
            attention_mask=torch.ones_like(pack.input_ids), use_cache=True,
        ).last_hidden_state[0]
        alone = [decoder(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in sequences[:3]]
        leak = max((a - b).abs().max().item() for a, b in zip(pack.unpack(naive), alone))
        assert leak > 1e-2, "the naive call no longer leaks: the trap test lost its teeth"
        for attention in ("varlen", "block_mask", "position_ids"):
            hidden = packed_forward(model, pack, attention)
            for got, want in zip(pack.unpack(hidden), alone):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"{attention} leaked")


def test_varlen_needs_a_varlen_capable_attention(sequences):
    eager = tiny_llama(attn="eager")
    with pytest.raises(ValueError, match="packed_attention=varlen"):
        packed_forward(eager, pack_sequences(sequences[:2]), "varlen")


def test_gradients_flow_through_the_packed_path(model, sequences):
    pack = pack_sequences(sequences[:3])
    result = pack_logprobs(model, pack, chunk_tokens=5)
    result.token_logprobs.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert result.has_logprob.tolist().count(False) == 3  # one sequence start each


def test_needed_tokens_only_change_nothing_there(sequences):
    # Log-probs, entropy and gradients at the needed tokens equal the all-token computation.
    pack = pack_sequences(sequences[:4])
    g = torch.Generator().manual_seed(3)
    needed = torch.rand(pack.num_tokens, generator=g) < 0.4
    results, grads = [], []
    for flags in (None, needed):
        model = tiny_llama()
        out = pack_logprobs(model, pack, chunk_tokens=5, entropy_grad=True, needed=flags)
        (torch.where(needed, out.token_logprobs + 0.3 * out.entropy, 0.0)).sum().backward()
        results.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    full, part = results
    want = needed & full.has_logprob
    assert torch.equal(part.has_logprob, want)
    torch.testing.assert_close(part.token_logprobs, torch.where(want, full.token_logprobs, 0.0), atol=ATOL, rtol=0)
    torch.testing.assert_close(part.entropy, torch.where(want, full.entropy, 0.0), atol=ATOL, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="one flag per packed token"):
        pack_logprobs(tiny_llama(), pack, needed=needed[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
def test_flash_varlen_matches_alone_on_cuda(sequences):
    pytest.importorskip("flash_attn")
    model = tiny_llama(attn="flash_attention_2", dtype=torch.bfloat16).cuda()
    seqs = [s.cuda() for s in sequences[:3]]
    pack = pack_sequences(seqs).to("cuda")
    with torch.no_grad():
        packed = pack.unpack(packed_forward(model, pack, "varlen"))
        for seq, got in zip(seqs, packed):
            alone = packed_forward(model, pack_sequences([seq]).to("cuda"), "varlen")
            torch.testing.assert_close(got.float(), alone.float(), atol=2e-2, rtol=0)
