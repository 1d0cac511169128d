"""The rolling context window (``rollout.multi_turn.context_policy=rolling``), driven by a scripted
engine whose k-th turn calls the calculator on ``k + 0`` (so the latest tool answer in a request
says which turn it asks for): the oldest complete turns leave the request until it gets its
budget, the prompt and the latest turn with its answer stay, nothing is cut inside a message; the
step-wise samples reproduce every request exactly and cover every policy token once."""

from __future__ import annotations

import json
import re

import pytest

from packrl.diagnostics.metrics import multi_turn_metrics
from packrl.rollout.engine import SamplingParams
from packrl.rollout.multi_turn import MultiTurnEngine, ToolRenderer, TurnLimits
from packrl.seqlen.stepwise import step_samples
from packrl.types import PromptBatch, RolloutBatch
from tests.builders import CALL, ScriptedEngine

FILLER = "Let me work this out carefully, one step after the other. "


class CountingEngine(ScriptedEngine):
    """Turn k (0-based) is ``FILLER x repeats`` + a call on ``k+1 + 0`` (its answer is ``k+1``),
    and turn ``answer_at`` the final answer."""

    def __init__(self, tokenizer, repeats: int = 2, answer_at: int = 4):
        turns = [FILLER * repeats + CALL % f"{k + 1} + 0" for k in range(answer_at)] + ["#### 5"]
        super().__init__(tokenizer, turns)

    def turn_of(self, ids) -> int:
        answers = re.findall(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", self.tokenizer.decode(list(ids)))
        return int(answers[-1]) if answers else 0


def _prompt_ids(tok) -> tuple[int, ...]:
    messages = [{"role": "system", "content": "You use a calculator."}, {"role": "user", "content": "What is 1 + 4?"}]
    return tuple(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _rolling(tok, *, context: int, rolling: bool = True, per_turn: int = 64, max_turns: int = 6, **engine_kwargs):
    scripted = CountingEngine(tok, **engine_kwargs)
    limits = TurnLimits(max_tokens_per_turn=per_turn, max_response_tokens=2000, max_trajectory_tokens=10_000,
                        max_context_tokens=context)
    engine = MultiTurnEngine(scripted, tok, tools=("calculator",), max_turns=max_turns, limits=limits,
                             max_tool_response_tokens=16, truncation_side="right", renderer=ToolRenderer(tok, "tool"),
                             rolling=rolling)
    return engine, scripted


PARAMS = SamplingParams(n=1, max_response_tokens=2000, stop=("</tool_call>",), return_logprobs=True)


def _turn_tokens(tok) -> int:
    return len(tok(FILLER * 2 + CALL % "1 + 0", add_special_tokens=False)["input_ids"])


def test_the_oldest_whole_turns_leave_the_request_until_it_fits(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt = _prompt_ids(tok)
    context = len(prompt) + 3 * _turn_tokens(tok)  # room for about two rounds with their tool answers
    engine, scripted = _rolling(tok, context=context)
    [[response]] = engine.generate([prompt], PARAMS, [3])
    t = response.trajectory
    assert response.finish_reason == "eos" and t.ended_by == "answer" and t.num_turns == 5
    assert len(response.response_ids) + len(prompt) > context  # the trajectory outgrew the context ...
    spans = t.turn_spans()
    assert len(t.context_starts) == 5 and t.context_starts[0] == 0 and t.num_dropped_turns >= 2
    for (ids, budget, _), start, (turn_start, _) in zip(scripted.requests, t.context_starts, spans):
        # ... but every request is the prompt and whole turns from a turn start on, and it got its full budget
        assert ids == prompt + response.response_ids[start:turn_start]
        assert start == 0 or start in [s for s, _ in spans]
        assert len(ids) + budget <= context and budget == 64
        window = tok.decode(list(ids[len(prompt):]))
        assert window.count("<tool_call>") == window.count("<|im_start|>tool")  # every kept call keeps its answer
    assert scripted.requests[-1][0][len(prompt):][:3] == response.response_ids[spans[-2][0]:][:3]  # the latest turn stays
    assert multi_turn_metrics(RolloutBatch(PromptBatch((prompt,), ("5",), ("t",), (0,), (False,)), 1, (response,)))[
        "multi_turn/dropped_turns"] == t.num_dropped_turns


def test_without_the_window_the_same_trajectory_ends_at_the_context(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt = _prompt_ids(tok)
    engine, _ = _rolling(tok, context=len(prompt) + 3 * _turn_tokens(tok), rolling=False)
    [[response]] = engine.generate([prompt], PARAMS, [3])
    assert response.finish_reason == "context" and response.trajectory.context_starts == ()
    assert response.trajectory.num_turns < 5 and response.trajectory.num_dropped_turns == 0


def test_a_latest_turn_that_does_not_fit_alone_ends_with_context(smollm_tokenizer):
    """The latest turn and its answer are never dropped: when they alone leave no room, the
    trajectory ends with ``context`` without another request."""
    tok = smollm_tokenizer
    prompt = _prompt_ids(tok)
    engine, scripted = _rolling(tok, context=len(prompt) + _turn_tokens(tok) + 8, repeats=2)
    [[response]] = engine.generate([prompt], PARAMS, [3])
    assert response.finish_reason == "context" and response.trajectory.ended_by == "context"
    assert all(len(ids) + budget <= len(prompt) + _turn_tokens(tok) + 8 for ids, budget, _ in scripted.requests)


def test_a_turn_is_dropped_only_when_the_request_would_not_get_its_budget(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt = _prompt_ids(tok)
    engine, _ = _rolling(tok, context=10_000)
    [[response]] = engine.generate([prompt], PARAMS, [3])
    assert response.trajectory.context_starts == () and step_samples(
        RolloutBatch(PromptBatch((prompt,), ("5",), ("t",), (0,), (False,)), 1, (response,))) is None


def test_step_samples_are_the_requests_and_cover_every_policy_token_once(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt = _prompt_ids(tok)
    engine, scripted = _rolling(tok, context=len(prompt) + 3 * _turn_tokens(tok))
    params = SamplingParams(n=2, max_response_tokens=2000, stop=("</tool_call>",), return_logprobs=True)
    groups = engine.generate([prompt, prompt[:-3] + prompt[-3:]], params, [3, 4])
    rollout = RolloutBatch(PromptBatch((prompt, prompt), ("5", "5"), ("t", "t"), (0, 1), (False, False)), 2,
                           tuple(r for g in groups for r in g))
    steps = step_samples(rollout)
    assert steps is not None and len(steps.rollout) > len(rollout)
    assert steps.prompt_of == tuple(t // 2 for t in steps.trajectory_of)
    contexts = {ids for ids, _, _ in scripted.requests}
    for sample, response, t, offset in zip(steps.rollout.prompts.prompt_ids, steps.rollout.responses, steps.trajectory_of,
                                           steps.offsets):
        assert sample in contexts  # each sample's context is the request its first turn was generated from
        assert response.response_ids == rollout.responses[t].response_ids[offset:offset + len(response.response_ids)]
        assert len(sample) + len(response.response_ids) <= len(prompt) + 3 * _turn_tokens(tok)  # within the model context
    covered = [[0] * len(r.response_ids) for r in rollout.responses]
    for response, t, offset in zip(steps.rollout.responses, steps.trajectory_of, steps.offsets):
        for k, in_loss in enumerate(response.response_mask):
            covered[t][offset + k] += in_loss
    for r, cover in zip(rollout.responses, covered):
        assert cover == [int(m) for m in r.response_mask]  # every policy token in exactly one sample, nothing else


@pytest.mark.parametrize("policy", ["error", "end", "rolling"])
def test_the_context_policy_sets_the_longest_sequence(policy):
    from packrl.config.budgets import budget_problems, budgets_of
    from packrl.config.schema import DataConfig, MultiTurnConfig, RolloutConfig, RunConfig, TrainConfig

    # the arithmetic_tool preset's budgets, with the context policy and a response budget beyond the context
    multi_turn = MultiTurnConfig(tools=["calculator"], max_turns=3, max_tokens_per_turn=96, max_tool_response_tokens=32,
                                 context_policy=policy)
    cfg = RunConfig(data=DataConfig(max_prompt_tokens=192), rollout=RolloutConfig(max_response_tokens=4000, multi_turn=multi_turn),
                    train=TrainConfig(max_tokens_per_microbatch=8192, max_tokens_per_logprob_microbatch=8192))
    budgets = budgets_of(cfg, 2048)
    problems = budget_problems(budgets)
    if policy == "error":
        assert any("model context" in str(p) for p in problems)
    else:
        assert budgets.max_sequence_tokens == 2048 and not problems


class _ScoringCountingEngine(CountingEngine):
    """`CountingEngine` whose log-probs are the policy's own forward over exactly each request +
    its turn (float32), as a real engine's would be."""

    def __init__(self, tokenizer, policy):
        super().__init__(tokenizer, repeats=6, answer_at=7)
        self.policy = policy

    def generate(self, prompt_ids, params, seeds):
        import torch

        from packrl.types import Response

        out = []
        for ids, [r] in zip(prompt_ids, super().generate(prompt_ids, params, seeds)):
            full = torch.tensor([list(ids) + list(r.response_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(self.policy(input_ids=full).logits[0].float(), -1)
            lps = tuple(float(logp[p, full[0, p + 1]]) for p in range(len(ids) - 1, full.shape[1] - 1))
            out.append([Response(r.response_ids, r.finish_reason, lps)])
        return out


def test_the_worker_group_scores_and_trains_each_turn_in_its_context(smollm_tokenizer):
    """Through the worker group: trajectories that outgrow the tiny model's 512-token context are
    scored as step-wise samples whose log-probs equal the engine's own forward on every policy
    token (1e-5, float32), and the update trains the samples within the context and the budgets."""
    from dataclasses import replace

    import torch

    from packrl.config import load_config
    from packrl.diagnostics.rollout_dump import rollout_rows
    from packrl.diagnostics.viewer import describe_sample, parse_sample
    from packrl.distributed.local import local_group
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.reward.score import score_rollout
    from packrl.trainer.batch import build_train_batch
    from tests.diagnostics.tiny_run import tiny_policy

    if "test_rolling_script" not in ROLLOUT_ENGINES:
        ROLLOUT_ENGINES.register("test_rolling_script")(lambda context: _ScoringCountingEngine(context.tokenizer, context.policy))
    tok = smollm_tokenizer
    cfg = load_config("demo", ["model.dtype=fp32", "data.batch_size=2", "rollout.n=2", "rollout.engine=test_rolling_script",
                               "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.context_policy=rolling",
                               "rollout.multi_turn.max_turns=8", "rollout.multi_turn.max_tokens_per_turn=128",
                               "rollout.multi_turn.max_tool_response_tokens=16", "rollout.max_response_tokens=900",
                               "rollout.stop=[</tool_call>]", "train.ppo_epochs=2", "train.max_tokens_per_microbatch=512",
                               "train.max_tokens_per_logprob_microbatch=1024", "data.val_files=[]", "train.loggers=[]"])
    workers = local_group(cfg, tiny_policy(tok).float(), tok)
    prompt = _prompt_ids(tok)
    prompts = PromptBatch((prompt, prompt), ("5", "5"), ("openai/gsm8k",) * 2, (0, 1), (False, False))
    rollout = workers.generate(prompts, replace(SamplingParams.from_config(cfg.rollout), return_logprobs=True))
    assert all(r.trajectory.num_dropped_turns >= 1 for r in rollout.responses)
    assert max(rollout.sequence_lengths()) > workers.max_context_tokens == 512
    old = workers.compute_logprobs(rollout, "actor")
    for r, lp in zip(rollout.responses, old.logprobs):
        mask = r.generated_mask()
        torch.testing.assert_close(lp[mask], torch.tensor(r.rollout_logprobs)[mask], atol=1e-5, rtol=0)
    scored = score_rollout(rollout, tok, cfg.reward, cfg.rollout.max_response_tokens)
    scored = replace(scored, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))  # the script writes the same turns: give the groups a spread
    batch, _ = build_train_batch(scored, old.logprobs, None, cfg.algorithm)
    metrics = workers.update(batch)
    assert metrics["seqlen/num_step_samples"] > len(rollout) and metrics["seqlen/microbatch_tokens_max"] <= 512
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])) and metrics["actor/grad_norm"] > 0
    rows = rollout_rows(1, batch, tok)
    assert [row["dropped_turns"] for row in rows] == [r.trajectory.num_dropped_turns for r in rollout.responses]
    sample = parse_sample(json.loads(json.dumps(rows[0])))
    assert sample.dropped_turns >= 1 and "dropped by the rolling window" in describe_sample(1, sample).plain
    workers.close()


def test_the_critic_scores_and_trains_the_same_step_wise_samples(tmp_path, smollm_tokenizer):
    """PPO with a critic under the rolling window: values come back per trajectory token (each
    turn valued in its own context, equal to a plain forward of that context), and the critic
    trains on the samples."""
    from dataclasses import replace

    import torch

    from packrl.config import load_config
    from packrl.distributed.local import local_group
    from packrl.registry import ROLLOUT_ENGINES
    from packrl.reward.score import score_rollout
    from packrl.seqlen.stepwise import step_samples
    from packrl.trainer.batch import build_train_batch
    from tests.diagnostics.tiny_run import tiny_policy

    if "test_rolling_script" not in ROLLOUT_ENGINES:
        ROLLOUT_ENGINES.register("test_rolling_script")(lambda context: _ScoringCountingEngine(context.tokenizer, context.policy))
    tok = smollm_tokenizer
    tiny_policy(tok).save_pretrained(tmp_path / "critic")
    tok.save_pretrained(tmp_path / "critic")
    cfg = load_config("demo", ["model.dtype=fp32", "data.batch_size=1", "rollout.n=2", "rollout.engine=test_rolling_script",
                               "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.context_policy=rolling",
                               "rollout.multi_turn.max_turns=8", "rollout.multi_turn.max_tokens_per_turn=128",
                               "rollout.multi_turn.max_tool_response_tokens=16", "rollout.max_response_tokens=900",
                               "rollout.stop=[</tool_call>]", "train.max_tokens_per_microbatch=512", "algorithm.adv_estimator=gae",
                               f"critic.model.path={tmp_path / 'critic'}", "data.val_files=[]", "train.loggers=[]"])
    workers = local_group(cfg, tiny_policy(tok).float(), tok)
    prompt = _prompt_ids(tok)
    rollout = workers.generate(PromptBatch((prompt,), ("5",), ("openai/gsm8k",), (0,), (False,)),
                               SamplingParams.from_config(cfg.rollout))
    steps = step_samples(rollout)
    assert steps is not None
    values = workers.compute_values(rollout)
    critic = workers.transport.worker.critic
    last = max(s for s, t in enumerate(steps.trajectory_of) if t == 0)  # trajectory 0's last sample, valued in its own context
    context, stretch = steps.rollout.prompts.prompt_ids[last], steps.rollout.responses[last].response_ids
    with torch.no_grad():
        alone = critic.value_head(critic.model(input_ids=torch.tensor([context + stretch])).last_hidden_state[0]).squeeze(-1)
    offset = steps.offsets[last]
    torch.testing.assert_close(values.values[0][offset:], alone[len(context) - 1:-1], atol=1e-5, rtol=0)
    assert float(values.bootstrap[0]) == pytest.approx(float(alone[-1]), abs=1e-5)
    scored = score_rollout(rollout, tok, cfg.reward, cfg.rollout.max_response_tokens)
    scored = replace(scored, rewards=torch.tensor([1.0, 0.0]))
    batch, metrics = build_train_batch(scored, None, None, cfg.algorithm, values)
    assert "critic/vf_explained_var" in metrics
    out = workers.update_critic(batch)
    assert out["critic/grad_norm"] > 0 and out["critic/vf_loss"] > 0
    workers.close()
