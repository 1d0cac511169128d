"""Thinking budgets: a scripted engine whose thinking runs out shows the end-of-thinking tokens
appended, out of the loss (the loss and gradient equal a hand-computed reference over the policy's
tokens alone), counted, and the answer budget respected; a natural end forces nothing; the
end-of-thinking text and the budgets are refused with their keys when they cannot work."""

from __future__ import annotations

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.config.schema import RolloutConfig
from packrl.diagnostics.length_metrics import length_metrics
from packrl.rollout.engine import SamplingParams
from packrl.rollout.thinking import ThinkingEngine, end_of_thinking_ids, thinking_engine
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

THINK, ANSWER, EOS, END = 5, 7, 2, (90, 91)


class _Tok:
    """``</think>`` is two tokens, 90 91; every other id decodes to a letter."""

    chat_template = "{{ messages }}<think></think>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(END) if text == "</think>" else [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        out, k = [], 0
        while k < len(ids):
            if tuple(ids[k:k + 2]) == END:
                out.append("</think>")
                k += 2
            else:
                out.append("x" if ids[k] < 128 else "?")
                k += 1
        return "".join(out)


class _Scripted:
    """Prompt b's thinking: ``runs_out`` fills the call's cap; otherwise 3 tokens then ``</think>``.
    An answer (a prompt holding a thinking segment) is 4 tokens and EOS, or fills its grant."""

    def __init__(self, runs_out: set[int], answer_tokens: int = 4) -> None:
        self.runs_out, self.answer_tokens, self.calls = runs_out, answer_tokens, []

    def generate(self, prompt_ids, params: SamplingParams, seeds):
        self.calls.append((len(prompt_ids), params.n, params.max_response_tokens, params.stop))
        out = []
        for b, prompt in enumerate(prompt_ids):
            if THINK in prompt:  # an answer
                n = min(params.max_response_tokens, self.answer_tokens + 1)
                ids = (ANSWER,) * (n - 1) + (EOS,) if n == self.answer_tokens + 1 else (ANSWER,) * n
                out.append([Response(ids, "eos" if ids[-1] == EOS else "length", rollout_logprobs=(-1.0,) * n)])
            elif prompt[0] in self.runs_out:
                cap = params.max_response_tokens
                out.append([Response((THINK,) * cap, "length", rollout_logprobs=(-1.0,) * cap)] * params.n)
            else:
                ids = (THINK,) * 3 + END
                out.append([Response(ids, "stop", rollout_logprobs=(-1.0,) * len(ids))] * params.n)
        return out

    def load_weights(self, weights): ...
    def sleep(self): ...
    def wake_up(self): ...
    def close(self): ...


def _engine(runs_out: set[int], answer_tokens: int = 4) -> tuple[ThinkingEngine, _Scripted]:
    inner = _Scripted(runs_out, answer_tokens)
    rollout = RolloutConfig(max_response_tokens=32, think_budget_tokens=10, answer_budget_tokens=6)
    return thinking_engine(inner, _Tok(), rollout), inner


def test_thinking_that_runs_out_gets_the_end_forced_and_its_answer_within_budget():
    engine, inner = _engine(runs_out={0})
    (forced,), (natural,) = engine.generate([(0, 1), (1, 1)], SamplingParams(n=1, max_response_tokens=32), [11, 12])
    assert forced.response_ids == (THINK,) * 10 + END + (ANSWER,) * 4 + (EOS,)
    assert forced.forced_span == (10, 12) and forced.forced_tokens() == 2
    assert forced.response_mask == (True,) * 10 + (False, False) + (True,) * 5  # the forced tokens are not the policy's
    assert forced.finish_reason == "eos" and not forced.truncated  # a forced end is not truncation
    assert natural.response_ids == (THINK,) * 3 + END + (ANSWER,) * 4 + (EOS,) and natural.forced_span is None
    assert natural.response_mask is None or all(natural.response_mask)
    thinking_call, answer_call = inner.calls
    assert thinking_call[2] == 10 and "</think>" in thinking_call[3]  # thinking: its budget, stopping at the end text
    assert answer_call[1] == 1 and answer_call[2] == 6  # one call per grant: the answer budget


def test_an_answer_that_fills_its_budget_is_truncated_and_counted():
    engine, _ = _engine(runs_out={0, 1}, answer_tokens=50)
    responses = engine.generate([(0, 1), (1, 1)], SamplingParams(n=2, max_response_tokens=32), [1, 2])
    flat = [r for group in responses for r in group]
    assert all(r.finish_reason == "length" and r.truncated for r in flat)
    assert all(len(r.response_ids) == 10 + 2 + 6 for r in flat)  # think + forced + answer budget
    prompts = PromptBatch(((0, 1), (1, 1)), ("1", "1"), ("t", "t"), (0, 1), (False, False))
    scored = ScoredBatch(RolloutBatch(prompts, 2, tuple(flat)), torch.zeros(4), torch.zeros(4))
    metrics = length_metrics(scored)
    assert metrics["seqlen/forced_tokens"] == 8 and metrics["length/forced_responses"] == 1.0


def test_the_forced_tokens_are_out_of_the_loss_and_its_gradient():
    """Loss and gradient through the update's micro-batch path equal -A x the log-probs of the policy's
    own tokens alone (the token-mean of an on-policy step), computed here from the model directly."""
    from tests.builders import pass_config
    from tests.conftest import minibatch_grads, tiny_llama

    engine, _ = _engine(runs_out={0})
    groups = engine.generate([(0, 1), (1, 1)], SamplingParams(n=1, max_response_tokens=32), [1, 2])
    prompts = PromptBatch(((3, 4), (6, 8)), ("1", "1"), ("t", "t"), (0, 1), (False, False))
    rollout = RolloutBatch(prompts, 1, tuple(g[0] for g in groups))
    advantages = (torch.full((17,), 0.5), torch.full((10,), -1.0))
    masks = tuple(r.generated_mask() for r in rollout.responses)
    batch = TrainBatch(ScoredBatch(rollout, torch.zeros(2), torch.zeros(2)), advantages, masks, None, None)
    cfg = pass_config(batch_size=2, n=1, max_prompt_tokens=4, max_response_tokens=32, update_tokens=64, dtype="fp64")
    model = tiny_llama(dtype=torch.float64, vocab_size=97)
    loss = minibatch_grads(model, batch, cfg)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference = tiny_llama(dtype=torch.float64, vocab_size=97)
    total, count = 0.0, 0
    for prompt, response, adv, mask in zip(prompts.prompt_ids, rollout.responses, advantages, masks):
        ids = torch.tensor([list(prompt) + list(response.response_ids)])
        logp = torch.log_softmax(reference(ids, use_cache=False).logits[0, :-1].double(), dim=-1)
        token_logp = logp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)[len(prompt) - 1:]  # [R]
        keep = [t for t in range(len(response.response_ids)) if t not in range(*(response.forced_span or (0, 0)))]
        assert keep == mask.nonzero().squeeze(1).tolist()
        total = total + (-adv[keep] * torch.exp(token_logp[keep] - token_logp[keep].detach())).sum()
        count += len(keep)
    (total / count).backward()
    assert loss == pytest.approx(float(total / count), rel=1e-9)
    torch.testing.assert_close(grads, torch.cat([p.grad.reshape(-1) for p in reference.parameters()]), rtol=1e-9, atol=1e-12)


def test_the_end_of_thinking_text_must_be_found_and_encodable():
    tok = _Tok()
    assert end_of_thinking_ids(tok, None) == ("</think>", END)  # from the chat template
    tok.chat_template = "{{ messages }}"
    with pytest.raises(ValueError, match=r"rollout.end_of_thinking=null and the chat template writes no </think>"):
        end_of_thinking_ids(tok, None)
    with pytest.raises(ValueError, match=r"rollout.end_of_thinking='é': the tokenizer encodes it as \[233\], which decodes to '\?'"):
        end_of_thinking_ids(tok, "\u00e9")


def test_the_budgets_must_hold_the_forced_text_and_an_answer():
    with pytest.raises(ConfigError, match=r"rollout.answer_budget_tokens=None: must be >= 1 with a thinking budget"):
        load_config("demo", ["rollout.think_budget_tokens=16"])
    with pytest.raises(ConfigError, match=r"rollout.answer_budget_tokens=8: has no effect: rollout.think_budget_tokens is null"):
        load_config("demo", ["rollout.answer_budget_tokens=8"])
    with pytest.raises(ConfigError, match=r"= 65 > rollout.max_response_tokens=64"):
        load_config("demo", ["rollout.think_budget_tokens=40", "rollout.answer_budget_tokens=24"])
    with pytest.raises(ConfigError, match=r"rollout.think_budget_tokens=16: does not apply per turn of multi-turn"):
        load_config("arithmetic_tool", ["rollout.think_budget_tokens=16", "rollout.answer_budget_tokens=16"])
    with pytest.raises(ConfigError, match=r"does not apply to responses carried across steps"):
        load_config("demo", ["rollout.think_budget_tokens=16", "rollout.answer_budget_tokens=16", "trainer.rollout_mode=colocate_async"])
    exact = RolloutConfig(max_response_tokens=17, think_budget_tokens=10, answer_budget_tokens=6)  # 10 + 2 forced + 6 = 18
    with pytest.raises(ValueError, match=r"\(2 tokens\) \+ rollout.answer_budget_tokens=6 = 18 > rollout.max_response_tokens=17"):
        thinking_engine(_Scripted(set()), _Tok(), exact)


def test_preflight_checks_the_end_of_thinking_with_the_policys_tokenizer(model_dir):
    """What set-up would refuse with the tokenizer in hand, preflight says before the run: SmolLM2's
    chat template writes no </think>, and a long end-of-thinking text's exact token count breaks
    think + forced + answer <= the response budget where load's one-token count did not."""
    from packrl.inspect.preflight import preflight

    budgets = [f"model.path={model_dir}", "rollout.max_response_tokens=64", "rollout.think_budget_tokens=40",
               "rollout.answer_budget_tokens=20"]
    problems = {p.key: str(p) for p in preflight("demo", budgets).problems}
    assert "chat template writes no </think>" in problems["rollout.end_of_thinking"]
    text = "rollout.end_of_thinking=Okay, I have thought about it enough; the answer follows."
    problems = {p.key: str(p) for p in preflight("demo", [*budgets, text]).problems}
    assert "rollout.end_of_thinking" not in problems
    assert "+ rollout.answer_budget_tokens=20 = " in problems["rollout.think_budget_tokens"]
    assert "fix: lower a budget or raise rollout.max_response_tokens" in problems["rollout.think_budget_tokens"]
    fits = [*budgets[:2], "rollout.think_budget_tokens=30", "rollout.answer_budget_tokens=20", text]
    assert not {"rollout.end_of_thinking", "rollout.think_budget_tokens"} & {p.key for p in preflight("demo", fits).problems}
