"""Shared-prompt packs (``train.share_prompts``, `packrl.seqlen.packing.pack_shared`) join the
invariance suite: a group's prompt written once per pack gives the same log-probs (1e-5, float32)
and the same loss and gradients (float64, within 1e-6 of the largest gradient) as every sequence packed whole, on both
attention paths that can run them, for every loss aggregation mode, with groups split across
micro-batches and across 2 ranks; and the planner keeps every pack within its budget counting the
prompt once.

Why not 1e-6 per element in float64 as the other loss tests: Llama's RMSNorm computes in float32
whatever the model dtype, so a shared prompt row, whose backward receives the sum of its
responses' gradients, is rounded once where the unshared copies are rounded one by one: the
gradients differ by about 3e-8 relative (float32's epsilon), the same with a pure-math attention.
"""

from __future__ import annotations

import pytest
import torch

from packrl.algos.loss_agg import LOSS_AGG_MODES
from packrl.config import load_config
from packrl.config.schema import AlgorithmConfig, RolloutConfig, RunConfig, TrainConfig
from packrl.seqlen.packing import pack_sequences, pack_shared
from packrl.seqlen.update_plan import PromptSharing, plan_ranks
from tests.builders import SHARED_PROMPT_LENS, SHARED_RESPONSE_LENS, shared_prompt_batch, shared_prompt_config
from tests.conftest import minibatch_grads, score_of, tiny_llama


def test_a_shared_pack_writes_each_prompt_once():
    pack = pack_shared([[1, 2, 3], [1, 2, 3], [4, 5], [6]], [[7, 8], [9], [10], []])
    assert pack.input_ids[0].tolist() == [1, 2, 3, 7, 8, 9, 4, 5, 10, 6]
    assert pack.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0]
    assert pack.prefix_of == (-1, 0, 0, -1, -1) and pack.owners == (-1, 0, 1, 2, 3)
    sources, targets = pack.predictions()
    pairs = dict(zip(targets.tolist(), sources.tolist()))
    assert pairs[3] == 2 and pairs[5] == 2 and pairs[4] == 3  # the prompt's last token scores each response's first
    assert 0 not in pairs and 6 not in pairs and 9 not in pairs  # sequence starts have no prediction
    assert [p.tolist() for p in pack.unpack(torch.arange(10))] == [[3, 4], [5], [6, 7, 8], [9]]
    plain = pack_shared([[1, 2], [3]], [[4], [5]])
    assert plain.prefix_of is None and plain.input_ids.equal(pack_sequences([[1, 2, 4], [3, 5]]).input_ids)


@pytest.mark.parametrize("attention", ["varlen", "block_mask"])
@pytest.mark.parametrize("budget", [4096, 40, 26])
def test_shared_log_probs_equal_unshared(attention, budget):
    model = tiny_llama(attn="sdpa")
    rollout = shared_prompt_batch().rollout
    cfg = shared_prompt_config("token-mean", budget, attention)
    plain_lp, plain_ent = score_of(model, rollout, cfg)
    shared_lp, shared_ent = score_of(model, rollout, cfg, share_prompts=True)
    for a, b, c, d in zip(plain_lp, shared_lp, plain_ent, shared_ent):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        torch.testing.assert_close(d, c, atol=1e-5, rtol=0)


def _grads(mode: str, budget: int, num_ranks: int, share: bool, attention: str = "varlen") -> tuple[float, torch.Tensor]:
    model = tiny_llama(dtype=torch.float64)
    cfg = shared_prompt_config(mode, budget, attention)
    loss = minibatch_grads(model, shared_prompt_batch(torch.float64), cfg, num_ranks=num_ranks, share_prompts=share)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_shared_losses_and_grads_equal_unshared_however_split(mode):
    loss_ref, grad_ref = _grads(mode, 4096, 1, share=False)
    for budget in (4096, 40, 26):  # whole; groups split over micro-batches
        for num_ranks in (1, 2):
            loss, grads = _grads(mode, budget, num_ranks, share=True)
            where = f"{mode}: budget {budget}, {num_ranks} rank(s)"
            assert loss == pytest.approx(loss_ref, rel=1e-9), where
            torch.testing.assert_close(grads, grad_ref, rtol=0, atol=1e-6 * float(grad_ref.abs().max()), msg=where)
    loss, grads = _grads(mode, 40, 2, share=True, attention="block_mask")
    torch.testing.assert_close(grads, grad_ref, rtol=0, atol=1e-6 * float(grad_ref.abs().max()))


@pytest.mark.parametrize("budget", [26, 40, 64, 4096])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_planned_shared_packs_stay_within_the_budget_and_keep_groups_whole_where_they_fit(budget, num_ranks):
    rollout = shared_prompt_batch().rollout
    lengths = rollout.sequence_lengths()
    sharing = PromptSharing.of([rollout.prompt_ids_of(i) for i in range(len(rollout))])
    plan = plan_ranks(lengths, num_ranks, budget, balance=True, budget_key="k", sharing=sharing)
    seen = []
    for rank in plan.ranks:
        for mb in rank.microbatches:
            if not mb:
                continue
            pack = pack_shared([rollout.prompt_ids_of(i) for i in mb], [rollout.responses[i].response_ids for i in mb], mb)
            assert pack.num_tokens <= budget
            seen += mb
    assert sorted(seen) == list(range(len(rollout)))
    if budget == 4096 and num_ranks == 1:
        assert len(plan.ranks[0].microbatches) == 1  # every group whole, each prompt once
        assert sum(lengths) - sum(SHARED_PROMPT_LENS) * 2 == sum(SHARED_PROMPT_LENS) + sum(SHARED_RESPONSE_LENS)


def test_share_prompts_defaults_to_on_wherever_it_can_run(caplog):
    """null (the default) turns sharing on where the attention path can run it and off, with a
    log line and no config error, where it cannot; true there is a warning."""
    import logging

    from packrl.models.attention import use_packed_attention
    from packrl.models.isolation import PackingCheck
    from packrl.worker.parts import shares_prompts as shares

    def shares_prompts(cfg, model, packing, *, group_size):  # as PolicyWorker.setup reads the config
        return shares(cfg.train.share_prompts, model, packing, group_size=group_size, attention=cfg.model.packed_attention,
                      sequence_parallel_size=cfg.trainer.sequence_parallel_size)

    model = tiny_llama(attn="sdpa")
    use_packed_attention(model)
    packs = PackingCheck(packs=True, stateful_types=(), max_diff=None, detail="")
    assert load_config("demo").train.share_prompts is None
    assert shares_prompts(RunConfig(), model, packs, group_size=4) == (True, "on (a group's prompt once per pack)")
    off = shares_prompts(RunConfig(train=TrainConfig(share_prompts=False)), model, packs, group_size=4)
    assert off == (False, "off (train.share_prompts=false)")
    position_ids = load_config("demo", ["model.packed_attention=position_ids"])  # no error under null
    with caplog.at_level(logging.INFO, logger="packrl.worker.parts"):
        on, phrase = shares_prompts(position_ids, model, packs, group_size=4)
    assert not on and phrase.startswith("off (model.packed_attention=position_ids")
    assert [r.levelno for r in caplog.records if "share_prompts" in r.getMessage()] == [logging.INFO]
    caplog.clear()
    unpacked = PackingCheck(packs=False, stateful_types=("mamba",), max_diff=None, detail="")
    assert not shares_prompts(RunConfig(train=TrainConfig(share_prompts=True)), model, unpacked, group_size=4)[0]
    assert [r.levelno for r in caplog.records if "share_prompts" in r.getMessage()] == [logging.WARNING]
    caplog.clear()
    single = RunConfig(train=TrainConfig(share_prompts=True), rollout=RolloutConfig(n=1), algorithm=AlgorithmConfig(adv_estimator="gae"))
    with caplog.at_level(logging.INFO, logger="packrl.worker.parts"):
        on_single = (True, "on (one sequence per prompt: only a prompt that repeats in a micro-batch is written once)")
        assert shares_prompts(single, model, packs, group_size=1) == on_single
    assert [r.levelno for r in caplog.records if "one sequence per prompt" in r.getMessage()] == [logging.WARNING]
    split = shares(None, model, packs, group_size=4, attention="varlen", sequence_parallel_size=2)
    assert split == (False, "off (sequence parallelism splits packs across ranks)")
