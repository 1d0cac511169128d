"""Invariant 4 with LoRA dropout on (``model.lora.dropout > 0``): the loss and the gradient of a
mini-batch do not depend on its micro-batches, its ranks, shared prompts or gradient
checkpointing, because each token's mask is keyed by what the token is
(`packrl.models.lora_dropout`), not drawn in the order the forwards run.

As in tests/invariance/test_loss_invariance.py: the update's own micro-batch path, ranks
simulated one after the other with their gradients summed, float64. The adapters' B matrices are
set non-zero, so the dropout masks reach the loss itself, not only B's gradient.
"""

from __future__ import annotations

import pytest
import torch

from packrl.config.schema import LoraConfig
from packrl.models import ulysses
from packrl.models.lora import apply_lora
from packrl.models.lora_dropout import KeyedDropout, active, dropout_draw, mix32, token_keys
from packrl.seqlen.packing import pack_sequences, pack_shared
from tests.builders import shared_prompt_batch, shared_prompt_config
from tests.conftest import minibatch_grads, tiny_llama

P = 0.3


def _lora_model(dropout: float = P, checkpointing: bool = False) -> torch.nn.Module:
    model = apply_lora(tiny_llama(dtype=torch.float64), LoraConfig(rank=4, alpha=8.0, dropout=dropout, target_modules=["all-linear"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    if checkpointing:
        from packrl.models.loading import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    return model.train()


def _grads(budget: int, num_ranks: int, *, share: bool = False, dropout: float = P, draw: int = 0,
           checkpointing: bool = False) -> tuple[float, torch.Tensor]:
    model = _lora_model(dropout, checkpointing)
    cfg = shared_prompt_config("token-mean", budget)
    loss = minibatch_grads(model, shared_prompt_batch(torch.float64), cfg, num_ranks=num_ranks, share_prompts=share, draw=draw)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


SHARED_ATOL = 1e-6
"""Shared prompts sum a prompt's gradient over its responses in another order: float64 grads then
differ by about 1e-7 of the largest, with or without dropout (tests/invariance/test_shared_prompts.py)."""


def test_with_lora_dropout_the_loss_and_grads_do_not_depend_on_micro_batches_ranks_or_shared_prompts():
    loss_ref, grad_ref = _grads(4096, 1)
    for share in (False, True):
        for budget in (4096, 40, 26):  # whole; groups split over micro-batches
            for num_ranks in (1, 2):
                loss, grads = _grads(budget, num_ranks, share=share)
                where = f"budget {budget}, {num_ranks} rank(s), shared prompts {share}"
                assert loss == pytest.approx(loss_ref, rel=1e-9), where
                atol = (SHARED_ATOL if share else 1e-9) * float(grad_ref.abs().max())
                torch.testing.assert_close(grads, grad_ref, rtol=0, atol=atol, msg=where)


def test_gradient_checkpointing_recomputes_the_same_masks():
    loss_ref, grad_ref = _grads(40, 2)
    loss, grads = _grads(40, 2, checkpointing=True)
    assert loss == pytest.approx(loss_ref, rel=1e-12)
    torch.testing.assert_close(grads, grad_ref, rtol=0, atol=1e-12 * float(grad_ref.abs().max()))


def test_the_dropout_is_on_and_each_draw_is_its_own():
    """The masks change the loss (against no dropout) and change with the draw (the optimizer step)."""
    loss, grads = _grads(40, 1)
    plain_loss, plain = _grads(40, 1, dropout=0.0)
    other_loss, other = _grads(40, 1, draw=1)
    assert abs(loss - plain_loss) > 1e-4 and abs(loss - other_loss) > 1e-4
    assert float((grads - plain).abs().max()) > 1e-3 and float((grads - other).abs().max()) > 1e-3


def test_the_masks_keep_one_minus_p_and_are_scaled_as_torch_dropout():
    layer = KeyedDropout(P, salt=12345).train()
    x = torch.ones(1, 4096, 64, dtype=torch.float64)
    pack = pack_sequences([list(range(4096))])
    with dropout_draw(pack, [list(range(10))], draw=3):
        y = layer(x)
    kept = y != 0
    assert set(torch.unique(y).tolist()) == {0.0, 1 / (1 - P)}
    assert abs(float(kept.double().mean()) - (1 - P)) < 0.005  # 262,144 bits: the standard error is 0.0009
    column_share = kept[0].double().mean(0)  # per feature, over tokens
    assert float((column_share - (1 - P)).abs().max()) < 0.05  # no feature always kept or always dropped
    assert not torch.equal(kept[0, :-1], kept[0, 1:]), "neighbouring tokens get other masks"
    assert torch.equal(layer.eval()(x), x), "eval mode: no dropout"


def test_a_training_forward_outside_a_draw_is_refused():
    with pytest.raises(RuntimeError, match="outside an update's draw"):
        KeyedDropout(P, salt=1).train()(torch.ones(1, 3, 4))


@pytest.mark.parametrize("x, expected", [(0, 0), (1, 4293290225), (12345, 3870921022), (2**32 - 1, 3846949589)])
def test_mix32_is_the_same_on_ints_and_tensors(x, expected):
    """The table of `mix32`'s docstring."""
    assert mix32(x) == expected and int(mix32(torch.tensor([x]))[0]) == expected


def test_a_shared_prompt_gets_the_keys_it_has_in_each_unshared_sequence():
    rollout = shared_prompt_batch().rollout
    indices = [0, 1, 2, 4]  # a whole group and one of the next
    prompts = [rollout.prompt_ids_of(i) for i in indices]
    responses = [rollout.responses[i].response_ids for i in indices]
    whole = pack_sequences([list(p) + list(r) for p, r in zip(prompts, responses)], indices=indices)
    shared = pack_shared(prompts, responses, indices)
    assert shared.num_tokens < whole.num_tokens
    per_sequence = dict(zip(indices, whole.unpack(token_keys(whole, prompts))))
    shared_keys = token_keys(shared, prompts)
    for i, own in zip(indices, shared.unpack(shared_keys)):  # a response's own segment: its response (or all of it)
        torch.testing.assert_close(own, per_sequence[i][len(per_sequence[i]) - len(own):], rtol=0, atol=0)
    prompt_segment = shared_keys[:len(prompts[0])]  # the group's prompt, written once
    for i in indices[:3]:
        torch.testing.assert_close(prompt_segment, per_sequence[i][:len(prompts[0])], rtol=0, atol=0)
    assert len(set(shared_keys.tolist())) > 0.9 * shared.num_tokens, "tokens get their own keys"


def test_sequence_parallel_ranks_hold_their_share_of_the_keys():
    """Under sequence parallelism a rank's forward holds its share of the padded pack; the
    shares, in rank order, are the pack's keys with the pad keyed 0."""
    pack = pack_sequences([[1, 2, 3, 4, 5], [6, 7]], indices=[3, 8])
    prompts = [[1, 2], [6]]
    full = token_keys(pack, prompts)
    shares = []
    for rank in range(3):
        sp = ulysses.SequenceParallel(group=None, size=3, rank=rank, inner="packrl_sdpa")
        with ulysses.sequence_parallel(sp), dropout_draw(pack, prompts, draw=0):
            shares.append(active().keys(3, torch.device("cpu")))
    torch.testing.assert_close(torch.cat(shares), torch.cat([full, full.new_zeros(2)]), rtol=0, atol=0)
