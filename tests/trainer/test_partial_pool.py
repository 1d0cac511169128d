"""Partial rollouts' pieces: a member's budget and finish reason across resumptions, the ledger's
exactly-once record, the JSON round trip, and resume equality on the HF engine (a response cut
anywhere and continued from prompt + prefix under the same weights is the uninterrupted one)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from packrl.rollout.engine import SamplingParams, single_sample_seed
from packrl.rollout.hf_engine import HFEngine
from packrl.trainer.stages.pool import Ledger, Member, RolloutGroup, Segment
from packrl.types import Response
from tests.conftest import tiny_llama


class _Tok:
    eos_token_id = 96
    pad_token_id = 0


def _resp(ids, reason="length", logprobs=None) -> Response:
    return Response(tuple(ids), reason, rollout_logprobs=logprobs)


def test_a_member_finishes_as_an_uninterrupted_response_would():
    m = Member().extended(_resp([1, 2, 3]), 1, cap=8, cap_reason="length")
    assert not m.finished and m.tokens_left(8) == 5  # cut by a chunk: carried
    m = m.extended(_resp([4, 5, 6, 7, 8]), 2, cap=8, cap_reason="length")
    assert m.finish_reason == "length" and m.num_tokens == 8
    assert m.response().token_versions == (1, 1, 1, 2, 2, 2, 2, 2)
    ctx = Member().extended(_resp([1, 2]), 1, cap=5, cap_reason="context").extended(_resp([3, 4, 5], "context"), 3, 5, "context")
    assert ctx.finish_reason == "context"  # the model context was the smaller cap at dispatch
    eos = Member().extended(_resp([1]), 1, 8, "length").extended(_resp([2, 96], "eos"), 2, 8, "length")
    assert eos.finish_reason == "eos" and eos.token_ids == (1, 2, 96)
    aborted = Member().extended(_resp([1, 2], "abort"), 1, 8, "length")
    assert not aborted.finished  # an engine abort is carried, never trained as a finish reason
    with pytest.raises(ValueError, match="must stop at SamplingParams.max_response_tokens"):
        Member().extended(_resp([1] * 6), 1, cap=4, cap_reason="length")  # verl #7207: a resumed member past its budget


def test_logprobs_follow_the_segments_and_missing_ones_are_none():
    m = Member().extended(_resp([1, 2], logprobs=(-0.5, -1.0)), 1, 4, "length")
    m = m.extended(_resp([3, 4], logprobs=(-0.25, -2.0)), 2, 4, "length")
    assert m.response().rollout_logprobs == (-0.5, -1.0, -0.25, -2.0)
    partial = Member().extended(_resp([1, 2]), 1, 4, "length").extended(_resp([3, 4], logprobs=(-1.0, -1.0)), 2, 4, "length")
    assert partial.response().rollout_logprobs is None


def test_group_state_round_trips_through_json():
    member = Member((Segment((5, 6), (-0.1, -0.2), 3), Segment((7,), (-1 / 3,), 4)), None)
    group = RolloutGroup(uid=7, prompt_ids=(1, 2, 3), ground_truth="42", data_source="task:arithmetic", row=11, prompt_truncated=False,
                         seed=123456789012345, dispatch_step=3, dispatch_budget=16, dispatch_cap=16, cap_reason="length",
                         members=(member, Member()))
    again = RolloutGroup.from_dict(json.loads(json.dumps(group.to_dict())))
    assert again == group
    asking = replace(group, length_target=30, length_mode="max")  # data.length_target with a mode column
    assert RolloutGroup.from_dict(json.loads(json.dumps(asking.to_dict()))) == asking
    older = {k: v for k, v in asking.to_dict().items() if k != "length_mode"}  # a checkpoint from before modes
    assert RolloutGroup.from_dict(older).length_mode is None
    ledger = Ledger()
    uids = [ledger.draw() for _ in range(4)]
    ledger.mark(uids[0], "in_flight")
    ledger.mark(uids[0], "trained", step=2)
    ledger.mark(uids[1], "dropped", step=2, reason="stale")
    assert Ledger.from_dict(json.loads(json.dumps(ledger.to_dict()))) == ledger
    assert ledger.counts() == {"queued": 2, "in_flight": 0, "trained": 1, "dropped": 1}
    with pytest.raises(RuntimeError, match="uid 0 is trained@2"):
        ledger.mark(uids[0], "trained", step=3)  # never trained twice
    with pytest.raises(RuntimeError, match="not drawn"):
        ledger.mark(99, "in_flight")


@pytest.mark.parametrize("cuts", [(1,), (3, 7), (5, 6, 11)])
def test_a_response_resumed_anywhere_equals_the_uninterrupted_one(cuts):
    engine = HFEngine(tiny_llama(), _Tok(), max_context_tokens=64, max_num_seqs=8)
    prompt, seed, total = (3, 14, 15, 92, 65), 2024, 16
    params = SamplingParams(n=3, temperature=1.0, max_response_tokens=total, return_logprobs=True)
    whole = engine.generate([prompt], params, [seed])[0]
    for g, reference in enumerate(whole):
        member, start = Member(), 0
        for cut in (*cuts, total):
            if member.finished:
                break
            grant = min(cut, total) - start
            one = SamplingParams(n=1, temperature=1.0, max_response_tokens=grant, return_logprobs=True)
            response = engine.generate([prompt + member.token_ids], one, [single_sample_seed(seed, g)])[0][0]
            member = member.extended(response, len(member.segments), total, "length")
            start = member.num_tokens
        resumed = member.response()
        assert resumed.response_ids == reference.response_ids and resumed.finish_reason == reference.finish_reason
        torch.testing.assert_close(torch.tensor(resumed.rollout_logprobs), torch.tensor(reference.rollout_logprobs), atol=1e-5, rtol=0)


def test_a_call_stopped_between_rounds_resumes_to_the_uninterrupted_responses():
    """HFEngine.generate_until: stopped once one response ended, the others come back cut
    (``abort``) with the tokens they have; continued later, each is the uninterrupted response."""
    engine = HFEngine(tiny_llama(), _Tok(), max_context_tokens=64, max_num_seqs=3)  # two batches: the second never starts
    prompts, seed, total = [(3, 14, 15), (92, 65, 35, 89), (7, 9), (79, 3)], 99, 40
    params = SamplingParams(n=1, temperature=1.0, max_response_tokens=total, return_logprobs=True)
    seeds = [single_sample_seed(seed, g) for g in range(len(prompts))]
    whole = [engine.generate([p], params, [s])[0][0] for p, s in zip(prompts, seeds)]
    caps = [total, 33, total, 5]  # one prompt with a smaller cap ends first
    cut = engine.generate_until(prompts, params, seeds, caps, lambda finished: sum(finished) >= 1)
    assert sum(r.finish_reason != "abort" for r in cut) >= 1 and any(r.finish_reason == "abort" for r in cut)
    assert any(r.finish_reason == "abort" and not r.response_ids for r in cut)  # a batch that never started
    for g, (prompt, first) in enumerate(zip(prompts, cut)):
        member = Member().extended(first, 1, caps[g], "length")
        while not member.finished:
            rest = engine.generate_until([prompt + member.token_ids], params, [seeds[g]], [member.tokens_left(caps[g])], lambda f: all(f))
            member = member.extended(rest[0], 2, caps[g], "length")
        reference = whole[g].response_ids[: caps[g]]
        assert member.token_ids == reference, g
        n = len(reference)
        torch.testing.assert_close(torch.tensor(member.response().rollout_logprobs),
                                   torch.tensor(whole[g].rollout_logprobs[:n]), atol=1e-5, rtol=0)
