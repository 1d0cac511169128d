"""Chunked log-probs and entropy equal the full computation, values and gradients (1e-5)."""

from __future__ import annotations

import pytest
import torch

from packrl.seqlen.chunked import chunked_logprobs, compiled_math, full_logprobs

ATOL = 1e-5


def _inputs(num_tokens=37, hidden=16, vocab=101, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(num_tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (num_tokens,), generator=g)
    return h, w, b, labels


def _grads(tensors):
    return [t.grad.clone() for t in tensors if t is not None]


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_grads_match_full(chunk, temperature, bias):
    h, w, b, labels = _inputs(bias=bias)
    g = torch.Generator().manual_seed(9)
    weights_lp = torch.randn(h.shape[0], generator=g)
    lp, ent = chunked_logprobs(h, w, labels, bias=b, chunk_tokens=chunk, temperature=temperature)
    (lp * weights_lp).sum().backward()
    got = _grads([h, w, b])
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    lp_ref, ent_ref = full_logprobs(h, w, labels, bias=b, temperature=temperature)
    (lp_ref * weights_lp).sum().backward()
    want = _grads([h, w, b])
    torch.testing.assert_close(lp, lp_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ent_ref.detach(), atol=ATOL, rtol=0)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_compiled_math_matches_full():
    """The compiled softmax math (`compiled_math`, part of ``model.compile``) against the full
    computation: a bias, a temperature, the entropy's gradient and a short last chunk in one pass,
    then the plain log-prob gradient (the other backward graph)."""
    h, w, b, labels = _inputs(bias=True, seed=5)
    with compiled_math():
        lp, ent = chunked_logprobs(h, w, labels, bias=b, chunk_tokens=8, temperature=0.7, entropy_grad=True)
        (lp.sum() - 0.3 * ent.sum()).backward()
        got = _grads([h, w, b])
        for t in (h, w, b):
            t.grad = None
        lp2, _ = chunked_logprobs(h, w, labels, bias=b, chunk_tokens=8, temperature=0.7)
        lp2.sum().backward()
        got2 = _grads([h, w, b])
    for t in (h, w, b):
        t.grad = None
    lp_ref, ent_ref = full_logprobs(h, w, labels, bias=b, temperature=0.7)
    (lp_ref.sum() - 0.3 * ent_ref.sum()).backward(retain_graph=True)
    want = _grads([h, w, b])
    for t in (h, w, b):
        t.grad = None
    lp_ref.sum().backward()
    want2 = _grads([h, w, b])
    torch.testing.assert_close(lp, lp_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lp2, lp_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=ATOL, rtol=0)
    for a, e in zip(got + got2, want + want2):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_a_chunk_larger_than_the_pass_allocates_only_the_pass():
    """A huge ``train.logits_chunk_tokens`` (1e7 x V logits would be 4 TB) holds only the pass's tokens."""
    h, w, _, labels = _inputs()
    lp, _ = chunked_logprobs(h, w, labels, chunk_tokens=10**7)
    lp.sum().backward()
    torch.testing.assert_close(lp, full_logprobs(h, w, labels)[0], atol=ATOL, rtol=0)


def test_entropy_has_no_grad_by_default():
    h, w, _, labels = _inputs()
    _, ent = chunked_logprobs(h, w, labels, chunk_tokens=8)
    assert not ent.requires_grad


def test_entropy_grad_matches_full_when_asked():
    h, w, _, labels = _inputs(seed=2)
    lp, ent = chunked_logprobs(h, w, labels, chunk_tokens=6, entropy_grad=True, temperature=1.3)
    (lp.sum() - 0.3 * ent.sum()).backward()
    got = _grads([h, w])
    h.grad = w.grad = None
    lp_ref, ent_ref = full_logprobs(h, w, labels, temperature=1.3)
    (lp_ref.sum() - 0.3 * ent_ref.sum()).backward()
    for a, e in zip(got, _grads([h, w])):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_entropy_only_backward():
    h, w, _, labels = _inputs(seed=4)
    _, ent = chunked_logprobs(h, w, labels, chunk_tokens=10, entropy_grad=True)
    ent.sum().backward()
    got = h.grad.clone()
    h.grad = w.grad = None
    full_logprobs(h, w, labels)[1].sum().backward()
    torch.testing.assert_close(got, h.grad, atol=ATOL, rtol=0)


def test_bf16_inputs_give_float32_outputs_close_to_full():
    h, w, _, labels = _inputs()
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    lp, _ = chunked_logprobs(hb, wb, labels, chunk_tokens=8)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    lp_ref, _ = full_logprobs(hb, wb, labels)
    torch.testing.assert_close(lp, lp_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"labels": torch.zeros(3, dtype=torch.long)}, "labels must be"), ({"chunk_tokens": 0}, "logits_chunk_tokens=0"),
     ({"temperature": 0.0}, "temperature"), ({"weight": torch.zeros(5, 3)}, "hidden must be"),
     ({"labels": torch.full((37,), 101)}, r"\[0, V=101\)"), ({"labels": torch.full((37,), -100)}, "min -100"),
     ({"labels": torch.zeros(37)}, "integer token ids"), ({"weight": torch.zeros(101, 16, dtype=torch.float64)}, "share a dtype")],
)
def test_bad_input(kwargs, match):
    h, w, _, labels = _inputs()
    args = {"hidden": h, "weight": w, "labels": labels} | kwargs
    with pytest.raises(ValueError, match=match):
        chunked_logprobs(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_backward_under_autocast_runs_the_forwards_matmul_dtype():
    """Under bf16 autocast, the backward's matmuls run in bf16, as a built-in matmul's backward
    does, and the gradients equal the full computation's under autocast (bf16 rounding)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default):
                self.dtypes.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    h, w, _, labels = _inputs(num_tokens=64, hidden=32, vocab=211)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_logprobs(h, w, labels, chunk_tokens=16)
        lp_ref, _ = full_logprobs(h, w, labels)
    with MatmulDtypes() as seen:
        lp.sum().backward()
    assert seen.dtypes == {torch.bfloat16}
    got = [h.grad.clone(), w.grad.clone()]
    h.grad = w.grad = None
    lp_ref.sum().backward()
    for a, b in zip(got, [h.grad, w.grad]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)
