"""Packing: cu_seqlens, restarting position ids, block mask, labels, and bad input."""

from __future__ import annotations

import pytest
import torch

from packrl.seqlen.packing import pack_sequences


def test_pack_layout():
    pack = pack_sequences([[5, 6, 7], [8], [9, 10]], indices=[4, 0, 2])
    assert pack.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert pack.cu_seqlens.tolist() == [0, 3, 4, 6] and pack.cu_seqlens.dtype == torch.int32
    assert pack.seq_lens == [3, 1, 2] and pack.max_seqlen == 3 and pack.num_tokens == 6
    assert pack.sequence_ids().tolist() == [0, 0, 0, 1, 2, 2]
    assert pack.indices == (4, 0, 2)


def test_block_causal_mask():
    pack = pack_sequences([[1, 2], [3, 4, 5]])
    mask = pack.block_causal_mask()[0, 0]
    want = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, want)
    float_mask = pack.block_causal_mask(torch.float32)[0, 0]
    assert torch.equal(float_mask == 0, want)


def test_unpack_shapes():
    pack = pack_sequences([[1, 2, 3], [4, 5]])
    parts = pack.unpack(torch.arange(10.0).reshape(1, 5, 2))
    assert [tuple(p.shape) for p in parts] == [(3, 2), (2, 2)]
    with pytest.raises(ValueError, match="4 tokens"):
        pack.unpack(torch.zeros(4))


@pytest.mark.parametrize(
    ("seqs", "kwargs", "match"),
    [([], {}, "empty list"), ([[1], []], {}, "sequence 1 has length 0"), ([[[1, 2]]], {}, "1-D"), ([[1.5, 2.0]], {}, "integer token ids"),
     ([[1], [2]], {"indices": [0, 0]}, "repeat"),
     ([[1], [2]], {"indices": [0]}, "1 indices for 2 sequences")],
)
def test_bad_input(seqs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(seqs, **kwargs)


def test_package_exports_are_functions_even_after_submodule_imports():
    import packrl.models.logprobs  # noqa: F401  (imports packrl.seqlen.chunked)
    from packrl.seqlen import chunked_logprobs, plan_microbatches

    assert callable(chunked_logprobs) and callable(plan_microbatches)
