"""The colocated partial-rollout stage on a scripted engine with heavy-tailed lengths: every member
gets exactly its budget, every drawn prompt is trained once or dropped with a reason, no trained
token is older than ``rollout.max_staleness``, a resumed stage continues as the uninterrupted one,
and with nothing carried the stage's batch is the synchronous one."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from packrl.config.schema import DataConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig
from packrl.rollout.engine import EngineCapabilities, SamplingParams, request_seed
from packrl.trainer.batch import build_train_batch
from packrl.trainer.stages import sampling_stage
from packrl.trainer.stages.base import StageContext
from packrl.trainer.stages.partial import PartialRolloutStage
from packrl.types import PromptBatch, Response
from tests.diagnostics.tiny_run import tiny_run  # noqa: F401  (registers reward test_letter_e)

EOS, CONTEXT = 2, 48


class _Sampler:
    """Prompts of varied length, one near the context (its cap is the context, not the budget)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size, self.row = batch_size, 0

    def next_batch(self) -> PromptBatch:
        rows = list(range(self.row, self.row + self.batch_size))
        self.row += self.batch_size
        lengths = [4 + (r * 7) % 9 if r % 5 else 40 for r in rows]  # row 0, 5, 10, ...: 40 of 48 tokens
        prompts = tuple((n, *[50 + (r + k) % 40 for k in range(n - 1)]) for r, n in zip(rows, lengths))  # ids[0] = length
        return PromptBatch(prompts, ("0",) * len(rows), ("test",) * len(rows), tuple(rows), (False,) * len(rows))


class _Workers:
    """A scripted engine: request (seed, g) wants a heavy-tailed length (some never end); a
    continuation (prompt + prefix) resumes where it stopped. Records every call."""

    max_context_tokens = CONTEXT
    capabilities = EngineCapabilities()  # no generate_until: every step in chunks

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    @staticmethod
    def wanted(seed: int) -> int:
        rng = random.Random(seed)
        return 10_000 if rng.random() < 0.2 else int(rng.paretovariate(1.2) * 3)  # 20% never emit EOS

    def generate_ids(self, prompt_ids, params: SamplingParams, seeds, rows=(), extra_inputs=None) -> list[list[Response]]:
        self.calls.append((len(prompt_ids), params.n, params.max_response_tokens))
        out = []
        for prompt, seed in zip(prompt_ids, seeds):
            group = []
            for g in range(params.n):
                held = len(prompt) - prompt[0]
                want = self.wanted(request_seed(seed, g))
                cap = min(params.max_response_tokens, CONTEXT - len(prompt))
                n = min(cap, want - held)
                ids = tuple(60 + (held + k) % 30 for k in range(n))
                if held + n == want:
                    ids = ids[:-1] + (EOS,)
                reason = "eos" if held + n == want else ("length" if cap == params.max_response_tokens else "context")
                group.append(Response(ids, reason, rollout_logprobs=tuple(-0.5 for _ in ids)))
            out.append(group)
        return out


def _stage(tokenizer, **rollout) -> tuple[PartialRolloutStage, _Workers]:
    knobs = {"over_provision": 3, "max_staleness": 2, "partial_chunk_tokens": 4} | rollout
    cfg = RunConfig(data=DataConfig(batch_size=4), reward=RewardConfig(name="test_letter_e"),
                    trainer=TrainerConfig(rollout_mode="colocate_async"), rollout=RolloutConfig(n=3, max_response_tokens=24, **knobs))
    workers = _Workers(tokenizer)
    return _partial(cfg, _Sampler(4), workers), workers


def _partial(cfg, sampler, workers) -> PartialRolloutStage:
    return PartialRolloutStage(StageContext(cfg, sampler, workers, Path(".")))


def _run(stage: PartialRolloutStage, steps: range) -> list[tuple]:
    out = []
    for step in steps:
        torch.manual_seed(1000 + step)  # the loop seeds the global RNG every step
        rollout, _, metrics = stage(SamplingParams(n=3, max_response_tokens=24), {}, [], step)
        out.append((rollout, metrics))
    return out


def test_budgets_ledger_and_staleness_hold_over_many_steps(smollm_tokenizer):
    stage, workers = _stage(smollm_tokenizer)
    trained: list[int] = []
    for step, (rollout, metrics) in enumerate(_run(stage, range(1, 16)), start=1):
        assert len(rollout.prompts) == 4 and rollout.policy_version == step
        assert metrics["async/staleness_token_max"] <= 2  # wait: a group at the bound finishes in that step
        for b, (prompt, row) in enumerate(zip(rollout.prompts.prompt_ids, rollout.prompts.rows)):
            trained.append(row)
            cap = min(24, CONTEXT - len(prompt))
            for r in rollout.responses[b * 3:(b + 1) * 3]:
                assert len(r.response_ids) <= cap
                assert all(v <= step for v in r.token_versions) and list(r.token_versions) == sorted(r.token_versions)
                if r.finish_reason != "eos":  # never ended: exactly its cap, with the reason an uncut run gives
                    assert len(r.response_ids) == cap and r.finish_reason == ("length" if cap == 24 else "context")
    assert len(trained) == len(set(trained)) == 60  # rows are uids here: each trained once
    ledger = stage.pool.ledger.counts()
    assert ledger["trained"] == 60 and ledger["dropped"] == 0
    assert ledger["trained"] + ledger["in_flight"] + ledger["queued"] == len(stage.pool.ledger.states)
    assert ledger["in_flight"] == len(stage.pool.groups)
    assert any(m["async/partial_ratio"] > 0 for _, m in _run(stage, range(16, 18)))
    assert any(n == 1 for _, n, _ in workers.calls)  # members were resumed alone


def test_drop_counts_what_it_drops_and_never_trains_it(smollm_tokenizer):
    stage, _ = _stage(smollm_tokenizer, stale_groups="drop", max_staleness=1, over_provision=4)
    results = _run(stage, range(1, 13))
    dropped = sum(m["async/dropped_groups"] for _, m in results)
    assert dropped > 0 and stage.pool.ledger.counts()["dropped"] == dropped
    assert all(m["async/staleness_token_max"] <= 1 for _, m in results)
    dropped_uids = {uid for uid, s in stage.pool.ledger.states.items() if s.startswith("dropped")}
    trained_rows = {row for r, _ in results for row in r.prompts.rows}
    assert not dropped_uids & trained_rows


def test_a_stage_restored_from_its_state_continues_as_the_uninterrupted_one(smollm_tokenizer):
    whole, _ = _stage(smollm_tokenizer)
    reference = _run(whole, range(1, 9))
    first, _ = _stage(smollm_tokenizer)
    _run(first, range(1, 5))
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint's trainer_state.json holds it
    resumed, _ = _stage(smollm_tokenizer)
    resumed.pool.sampler.row = first.pool.sampler.row  # the sampler's own state is checkpointed beside it
    resumed.load_state_dict(state)
    for (a, ma), (b, mb) in zip(reference[4:], _run(resumed, range(5, 9))):
        assert a == b and ma == mb
    with pytest.raises(ValueError, match="groups of 3 responses, not rollout.n=2; resume with rollout.n=3"):
        _partial(replace(RunConfig(), rollout=RolloutConfig(n=2), trainer=TrainerConfig(rollout_mode="colocate_async")),
                 _Sampler(4), _Workers(smollm_tokenizer)).load_state_dict(state)


def test_with_nothing_carried_the_batch_is_the_synchronous_one(smollm_tokenizer, model_and_tokenizer_for_sync):
    """Chunks as long as the budget and no over-provision: the stage generates each step's
    batch whole, as `one_round` does, with the same seeds; nothing is stale, so no weights."""
    cfg, workers = model_and_tokenizer_for_sync
    async_cfg = replace(cfg, trainer=TrainerConfig(rollout_mode="colocate_async"),
                        rollout=replace(cfg.rollout, over_provision=0, partial_chunk_tokens=cfg.rollout.max_response_tokens))
    sampling = SamplingParams(n=cfg.rollout.n, max_response_tokens=cfg.rollout.max_response_tokens, return_logprobs=True)
    outs = []
    for c in (cfg, async_cfg):
        sampler = _Sampler(cfg.data.batch_size)
        torch.manual_seed(7)
        outs.append(sampling_stage(StageContext(c, sampler, workers, Path(".")))(sampling, {}, [], 1))
    (sync_rollout, sync_scored, _), (async_rollout, async_scored, metrics) = outs
    assert sync_rollout.prompts == replace(async_rollout.prompts, response_budgets=None)
    assert async_rollout.prompts.response_budgets == (10, 10, 10)  # each group's dispatch budget
    assert [r.response_ids for r in sync_rollout.responses] == [r.response_ids for r in async_rollout.responses]
    assert [r.finish_reason for r in sync_rollout.responses] == [r.finish_reason for r in async_rollout.responses]
    assert torch.equal(sync_scored.rewards, async_scored.rewards) and metrics["async/carried_groups"] == 0
    old = tuple(torch.tensor(r.rollout_logprobs) for r in async_rollout.responses)
    batch, batch_metrics = build_train_batch(async_scored, old, None, cfg.algorithm)
    assert batch.extras == {} and batch_metrics["async/stale_token_fraction"] == 0.0


@pytest.fixture
def model_and_tokenizer_for_sync(smollm_tokenizer):
    from packrl.distributed.local import local_group
    from tests.diagnostics.tiny_run import tiny_policy

    smollm_tokenizer.padding_side = "left"
    cfg = RunConfig(data=DataConfig(batch_size=3), reward=RewardConfig(name="test_letter_e"),
                    rollout=RolloutConfig(n=2, max_response_tokens=10))
    cfg = replace(cfg, model=replace(cfg.model, dtype="fp32"))
    return cfg, local_group(cfg, tiny_policy(smollm_tokenizer), smollm_tokenizer)


def test_resumes_that_would_lose_or_overrun_carried_groups_are_refused(smollm_tokenizer):
    from packrl.trainer.stages.rounds import Rounds

    stage, _ = _stage(smollm_tokenizer)
    _run(stage, range(1, 3))
    state = json.loads(json.dumps(stage.state_dict()))
    assert state["pool"]
    with pytest.raises(ValueError, match="partial prompt groups .* trainer.rollout_mode=sync would never train"):
        Rounds(lambda *a: None).load_state_dict(state)
    Rounds(lambda *a: None).load_state_dict({})  # a sync checkpoint
    with pytest.raises(ValueError, match=r"24-token response cap, above rollout.max_response_tokens=16.*>=24"):
        lowered = RunConfig(data=DataConfig(batch_size=4), trainer=TrainerConfig(rollout_mode="colocate_async"),
                            rollout=RolloutConfig(n=3, max_response_tokens=16))
        _partial(lowered, _Sampler(4), _Workers(smollm_tokenizer)).load_state_dict(state)
    default = _partial(RunConfig(data=DataConfig(batch_size=8), trainer=TrainerConfig(rollout_mode="colocate_async")),
                       _Sampler(8), _Workers(smollm_tokenizer))
    assert default.pool.over_provision == 2  # null: a quarter of the batch


def test_without_an_old_log_prob_pass_the_update_weighs_stale_tokens_as_the_pass_does(tmp_path, smollm_tokenizer):
    """One on-policy optimizer step: the update's own log-probs, detached, are the proximal policy,
    so partial rollouts skip the old-log-prob pass; the stale tokens' behaviour weights and the
    training equal those of the same run with the pass (forced here by rollout.return_logprobs)."""
    tok = smollm_tokenizer
    tok.padding_side = "left"
    common = ["train.total_steps=4", "trainer.rollout_mode=colocate_async", "rollout.over_provision=2", "reward.name=test_letter_e",
              "rollout.max_response_tokens=16"]
    no_pass, workers_a = tiny_run(tmp_path / "a", tok, common)
    with_pass, workers_b = tiny_run(tmp_path / "b", tok, [*common, "rollout.return_logprobs=true"])
    assert not workers_a.plan.needs_old_logprobs and workers_b.plan.needs_old_logprobs
    lines = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (no_pass, with_pass)]
    stale_steps = [i for i, line in enumerate(lines[1]) if line["async/stale_token_fraction"] > 0]
    assert stale_steps, "the runs should train carried tokens"
    for i, (a, b) in enumerate(zip(*lines)):
        assert a["async/stale_token_fraction"] == b["async/stale_token_fraction"]
        assert a["response_length/mean"] == b["response_length/mean"]
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) <= 1e-5
        if i in stale_steps:
            assert abs(a["async/behaviour_weight_mean"] - b["async/behaviour_weight_mean"]) <= 1e-5
            assert b["async/behaviour_weight_mean"] != 1.0  # the weights are not trivially one


def test_a_carried_group_is_scored_against_its_dispatch_budget_under_a_length_curriculum(smollm_tokenizer):
    """Groups dispatched while the curriculum's budget was 8 and trained when it is 24 keep 8: the
    budget that cut them is the one their overlong ramp ends at, not the training step's."""
    knobs = {"over_provision": 4, "max_staleness": 3, "partial_chunk_tokens": 4}
    cfg = RunConfig(data=DataConfig(batch_size=4), trainer=TrainerConfig(rollout_mode="colocate_async"),
                    reward=RewardConfig(name="test_letter_e", shaping={"overlong": {"buffer_tokens": 4}}),
                    rollout=RolloutConfig(n=3, max_response_tokens=24, **knobs))
    stage = _partial(cfg, _Sampler(4), _Workers(smollm_tokenizer))
    seen: dict[int, int] = {}
    for step in range(1, 7):
        torch.manual_seed(1000 + step)
        budget = 8 if step <= 2 else 24  # rollout.max_response_tokens_schedule=[[1, 8], [3, 24]]
        rollout, scored, _ = stage(SamplingParams(n=3, max_response_tokens=budget), {}, [], step)
        budgets = rollout.response_budgets(budget)
        for i, r in enumerate(rollout.responses):
            assert len(r.response_ids) <= budgets[i]
            if r.finish_reason == "length":  # cut at its own budget: the full penalty, whatever the step's budget
                assert len(r.response_ids) == budgets[i] and float(scored.parts["overlong"][i]) == -1.0
            seen[budgets[i]] = seen.get(budgets[i], 0) + 1
            if step > 2 and budgets[i] == 8:
                assert float(scored.parts["overlong"][i]) <= 0  # scored at 8 though the step's budget is 24
    assert seen.get(8, 0) > 0 and seen.get(24, 0) > 0
