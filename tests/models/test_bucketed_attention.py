"""``packrl_sdpa`` runs the responses sharing a prompt in right-padded buckets; outputs and
gradients equal one SDPA call per segment (each shared-prompt segment over its prompt, then
itself causally)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packrl.models.attention import _bucket_plan, _buckets, _packrl_sdpa


def _reference(q, k, v, bounds, prefix):
    outs = []
    for seg, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if prefix[seg] < 0:
            outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True))
            continue
        ps, pe = bounds[prefix[seg]], bounds[prefix[seg] + 1]
        kk, vv = torch.cat([k[:, :, ps:pe], k[:, :, s:e]], 2), torch.cat([v[:, :, ps:pe], v[:, :, s:e]], 2)
        scores = (q[:, :, s:e] @ kk.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
        allowed = torch.ones(e - s, pe - ps + e - s, dtype=torch.bool).tril(diagonal=pe - ps)
        outs.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vv.repeat_interleave(q.shape[1] // k.shape[1], 1))
    return torch.cat(outs, dim=2).transpose(1, 2)


CASES = {
    "unshared, mixed lengths": ([9, 3, 8, 1, 7, 2, 9], None),
    "one segment": ([11], None),
    "shared prompts": ([6, 4, 1, 5, 3, 7, 2], (-1, 0, 0, 0, -1, 4, 4)),
    "shared and plain": ([5, 2, 6, 9, 4], (-1, 0, 0, -1, -1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_equal_one_call_per_segment(case):
    lengths, prefix = CASES[case]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, bounds[-1], 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, bounds[-1], 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, bounds[-1], 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, bounds[-1], 4, 8, generator=g, dtype=torch.float64)
    prefix_of = None if prefix is None else torch.tensor(prefix)
    out, _ = _packrl_sdpa(None, q, k, v, None, cu_seq_lens_q=torch.tensor(bounds), packrl_prefix_of=prefix_of)
    (out * weight).sum().backward()
    got = [out.detach(), q.grad, k.grad, v.grad]
    for t in (q, k, v):
        t.grad = None
    ref = _reference(q, k, v, bounds, prefix or (-1,) * len(lengths))
    (ref * weight).sum().backward()
    for a, b in zip(got, [ref.detach(), q.grad, k.grad, v.grad]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    plan = _bucket_plan(tuple(bounds), tuple(prefix or (-1,) * len(lengths)), q.device)
    if case == "shared prompts":
        assert any(not bool(b.valid.all()) for b in plan.buckets if b.index is not None)  # padding was exercised
    if prefix is None:
        assert all(b.span is not None for b in plan.buckets)


def test_buckets_keep_padded_cost_within_the_limit():
    lengths = [400, 390, 380, 300, 200, 120, 110, 5]
    groups = _buckets(lengths, 0)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    for grp in groups:
        longest = max(lengths[i] for i in grp)
        assert len(grp) * longest ** 2 <= 1.5 * sum(lengths[i] ** 2 for i in grp)
    assert groups == [[0, 1, 2, 3, 4], [5, 6], [7]]  # longest first; a 5-token segment alone


def test_a_padded_generation_batch_keeps_kv_heads_grouped_and_matches_transformers_sdpa(monkeypatch):
    """A left-padded batch generating with a KV cache on the CPU (a padding mask, 4 query heads over
    2 KV heads) runs SDPA on the grouped heads; its logits are those of transformers' SDPA forward,
    which repeats the KV heads first."""
    import copy

    from packrl.models import attention
    from tests.conftest import tiny_llama

    grouped = []
    real = attention._grouped_on_cpu
    monkeypatch.setattr(attention, "_grouped_on_cpu", lambda *a: grouped.append(real(*a)) or grouped[-1])
    model = tiny_llama()  # packrl_sdpa
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()  # 1 = real token, left padding
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        got, want = model.generate(**kwargs), plain.generate(**kwargs)
    assert any(grouped), "the masked decode steps should keep the KV heads grouped"
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
