"""Every filter of the seam keeps invariant 4 (the loss and the gradient of a mini-batch do not
depend on its micro-batches or ranks): the loss filters (rollout correction's rejection, the entropy
filter) alone and composed with GFPO's advantage filter, in their declared order.

The oracle is independent of the filters: the batch built with no filter, its advantages kept, and
the responses a filter should take out (chosen by hand from the entropy means and the geometric
ratios) masked by hand, gives the same loss and gradient on every aggregation mode, micro-batch
budget and rank count. GFPO's own oracle (a batch of the kept responses alone) is
`tests.invariance.test_length_control_invariance`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES
from packrl.config.algorithm_variants import RolloutCorrectionConfig
from packrl.trainer.batch import build_train_batch
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch
from tests.builders import BUDGETS, RTOL, WHOLE, pass_config
from tests.conftest import minibatch_grads, tiny_llama

PROMPT_LENS = [5, 9, 3]
RESPONSE_LENS = [14, 3, 22, 6, 17, 9, 1, 11, 8, 4, 12, 7]
"""Three prompts x four responses."""
SHIFTS = [0.0, 0.3, 0.0, -0.4, 0.0, 0.0, 0.25, 0.0, -0.3, 0.0, 0.0, 0.0]
"""Engine log-prob = old log-prob - shift: a response's geometric ratio rho = exp(mean shift)."""
ENTROPY = [1.0, 0.2, 1.5, 0.9, 0.1, 1.2, 0.8, 0.3, 1.1, 0.4, 1.3, 0.7]
"""Each response's entropy per token, nats (constant along the response)."""
RS = {"rollout_rs": "geometric", "rollout_rs_threshold": 1.2}
"""Keep 1/1.2 <= rho <= 1.2: rejects responses 1 (rho e^0.3), 3 (e^-0.4), 6 (e^0.25) and 8 (e^-0.3)."""


def _old() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    return tuple(-4.6 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64) for n in RESPONSE_LENS)


def _scored() -> ScoredBatch:
    g = torch.Generator().manual_seed(11)
    prompts = PromptBatch(tuple(tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in PROMPT_LENS),
                          ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3)
    responses = tuple(Response(tuple(torch.randint(0, 97, (n,), generator=g).tolist()), "eos",
                               rollout_logprobs=tuple((old - s).tolist()))
                      for n, old, s in zip(RESPONSE_LENS, _old(), SHIFTS))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 1.0], dtype=torch.float64)
    return ScoredBatch(RolloutBatch(prompts, 4, responses), rewards, rewards)


def _entropy() -> tuple[torch.Tensor, ...]:
    return tuple(torch.full((n,), e, dtype=torch.float32) for n, e in zip(RESPONSE_LENS, ENTROPY))


def _cfg(mode: str, budget: int, **algorithm):
    return pass_config(batch_size=3, n=4, max_prompt_tokens=12, max_response_tokens=24, update_tokens=budget, loss_agg_mode=mode,
                       clip_ratio_low=0.1, clip_ratio_high=0.1, **algorithm)


def _loss_and_grads(batch, cfg, num_ranks: int, keep_masked: bool = False) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float64)
    loss = minibatch_grads(model, batch, cfg, num_ranks=num_ranks, keep_masked=keep_masked)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _by_hand(out: set[int]):
    """The batch with no filter, the responses ``out`` masked by hand."""
    batch, _ = build_train_batch(_scored(), _old(), None, _cfg("token-mean", WHOLE).algorithm)
    return replace(batch, loss_masks=tuple(torch.zeros_like(m) if i in out else m for i, m in enumerate(batch.loss_masks)))


def _rejected() -> set[int]:
    return {i for i, s in enumerate(SHIFTS) if not 1 / 1.2 <= math.exp(s) <= 1.2}


def _low_entropy(live: set[int], quantile: float) -> set[int]:
    ranked = sorted(live, key=lambda i: (-ENTROPY[i], i))
    return live - set(ranked[:math.ceil(quantile * len(live))])


CASES = {
    "rejection": (dict(rollout_correction=RS), _rejected()),
    "entropy": (dict(filters={"entropy": {"quantile": 0.5}}), _low_entropy(set(range(12)), 0.5)),
    "rejection_then_entropy": (dict(rollout_correction=RS, filters={"entropy": {"threshold": 0.5}}),
                               _rejected() | {i for i in range(12) if ENTROPY[i] < 0.5}),
}


def _algorithm(mode: str, budget: int, case: str):
    settings = dict(CASES[case][0])
    if "rollout_correction" in settings:
        settings["rollout_correction"] = RolloutCorrectionConfig(**settings["rollout_correction"])
    return _cfg(mode, budget, **settings)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_filters_give_the_loss_of_the_responses_masked_by_hand_on_every_split(mode, case):
    cfg = _algorithm(mode, WHOLE, case)
    batch, metrics = build_train_batch(_scored(), _old(), None, cfg.algorithm, old_entropy=_entropy())
    out = CASES[case][1]
    assert {i for i, f in enumerate(batch.filtered or ()) if f} == out and 0 < len(out) < 12
    hand = _by_hand(out)
    for a, b in zip(batch.advantages, hand.advantages):  # the loss filters act after the advantages
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    loss_ref, grad_ref = _loss_and_grads(hand, _cfg(mode, WHOLE), 1)
    assert grad_ref.abs().max() > 0
    for budget in (WHOLE, *BUDGETS):
        for num_ranks in (1, 2):
            loss, grads = _loss_and_grads(batch, _algorithm(mode, budget, case), num_ranks)
            where = f"{case}, {mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=RTOL), where
            torch.testing.assert_close(grads, grad_ref, rtol=RTOL, atol=1e-12, msg=where)


def test_the_filters_compose_in_their_declared_order_and_each_response_is_counted_once():
    cfg = _cfg("token-mean", WHOLE, filters={"gfpo": {"keep": 3}, "entropy": {"threshold": 0.5}},
               rollout_correction=RolloutCorrectionConfig(**RS))
    batch, metrics = build_train_batch(_scored(), _old(), None, cfg.algorithm, old_entropy=_entropy())
    by = batch.filtered
    assert by is not None
    lengths = torch.tensor(RESPONSE_LENS).view(3, 4)
    gfpo = set(range(12)) - set((torch.argsort(lengths, dim=1, stable=True)[:, :3] + torch.arange(3).unsqueeze(1) * 4).view(-1).tolist())
    rejected = _rejected() - gfpo  # the advantage filter first, then rollout correction (order 10), then entropy (order 20)
    entropy = {i for i in range(12) if ENTROPY[i] < 0.5} - gfpo - rejected
    assert {i for i, f in enumerate(by) if f == "gfpo"} == gfpo
    assert {i for i, f in enumerate(by) if f == "rollout_correction"} == rejected
    assert {i for i, f in enumerate(by) if f == "entropy"} == entropy
    assert metrics["filter/gfpo/dropped"] == len(gfpo) and metrics["filter/rollout_correction/dropped"] == len(rejected)
    assert metrics["filter/entropy/dropped"] == len(entropy)
    assert all(not bool(m.any()) for i, m in enumerate(batch.loss_masks) if by[i] is not None)
    assert all(float(batch.advantages[i].abs().sum()) == 0 for i in gfpo)
