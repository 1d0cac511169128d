"""Builders the test modules share: small batches with known lengths, the config sections the
log-prob and update passes read, tiny hybrid models, a scripted multi-turn engine, the audit's
character tokenizer and readers of a run folder.

Fixtures live in the conftest.py files; `tests.conftest` keeps the tiny Llama and the pass
helpers (`score_of`, `minibatch_grads`) these builders feed.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch

from packrl.config.schema import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig
from packrl.rollout.engine import SamplingParams
from packrl.rollout.multi_turn import MultiTurnEngine, ToolRenderer, TurnLimits
from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch, Trajectory
from tests.diagnostics.tiny_run import BASE

# --- the sections the log-prob and update passes read -------------------------------------------


def pass_config(*, batch_size: int, n: int, max_prompt_tokens: int, max_response_tokens: int, update_tokens: int,
                logprob_tokens: int = 4096, attention: str = "varlen", dtype: str = "fp32", **algorithm) -> RunConfig:
    """The sections `tests.conftest.score_of` and `minibatch_grads` read, built directly (``algorithm``: `AlgorithmConfig` fields)."""
    return RunConfig(
        model=ModelConfig(dtype=dtype, packed_attention=attention),
        data=DataConfig(batch_size=batch_size, max_prompt_tokens=max_prompt_tokens),
        rollout=RolloutConfig(n=n, max_response_tokens=max_response_tokens),
        train=TrainConfig(max_tokens_per_microbatch=update_tokens, max_tokens_per_logprob_microbatch=logprob_tokens),
        algorithm=AlgorithmConfig(**algorithm),
    )


# --- batches --------------------------------------------------------------------------------------


def scored_batch() -> ScoredBatch:
    """Two prompts x two random responses (4, 7, 2 and 5 tokens, vocabulary 97) with rewards 1, 0, 0.5, 0."""
    g = torch.Generator().manual_seed(0)
    prompts = PromptBatch(((5, 6, 7), (8, 9)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(tuple(torch.randint(3, 97, (n,), generator=g).tolist()), "eos") for n in (4, 7, 2, 5))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    return ScoredBatch(RolloutBatch(prompts, 2, responses), rewards, rewards)


RTOL = 1e-6
"""Relative tolerance of the float64 loss-invariance checks."""

LOSS_PROMPT_LENS = [5, 9, 3, 12]
"""Prompt lengths of `loss_batch`."""

LOSS_RESPONSE_LENS = [14, 3, 22, 6, 17, 9, 1, 11]
"""Response lengths of `loss_batch`, two responses per prompt."""

WHOLE = 4096
"""A micro-batch budget that holds the whole of `loss_batch`: one micro-batch."""

BUDGETS = (40, 64)
"""Micro-batch budgets that split `loss_batch` in different ways."""


def loss_batch() -> TrainBatch:
    """Eight sequences in four groups, old and reference log-probs off the model's, per-token advantages; response 5 cut and masked."""
    g = torch.Generator().manual_seed(3)
    prompts = PromptBatch(tuple(tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in LOSS_PROMPT_LENS),
                          ("0",) * 4, ("t",) * 4, (0, 1, 2, 3), (False,) * 4)
    responses = tuple(Response(tuple(torch.randint(0, 97, (n,), generator=g).tolist()), "length" if i == 5 else "eos")
                      for i, n in enumerate(LOSS_RESPONSE_LENS))
    rollout = RolloutBatch(prompts, 2, responses)
    rewards = torch.zeros(len(responses))
    masks = tuple(torch.full((n,), i != 5) for i, n in enumerate(LOSS_RESPONSE_LENS))
    advantages = tuple(torch.randn(n, generator=g) for n in LOSS_RESPONSE_LENS)
    old = tuple(-4.6 + 0.3 * torch.randn(n, generator=g) for n in LOSS_RESPONSE_LENS)
    ref = tuple(-4.6 + 0.3 * torch.randn(n, generator=g) for n in LOSS_RESPONSE_LENS)
    return TrainBatch(ScoredBatch(rollout, rewards, rewards), advantages, masks, old, ref)


SHARED_PROMPT_LENS = [9, 14, 5]
"""Prompt lengths of `shared_prompt_batch`."""

SHARED_RESPONSE_LENS = [6, 11, 1, 8, 3, 12, 7, 2, 9]
"""Response lengths of `shared_prompt_batch`, three responses per prompt."""


def shared_prompt_batch(dtype: torch.dtype = torch.float32) -> TrainBatch:
    """Nine sequences in three groups of three, every token in the loss, with old and reference log-probs and advantages in ``dtype``."""
    g = torch.Generator().manual_seed(7)
    prompts = PromptBatch(tuple(tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in SHARED_PROMPT_LENS),
                          ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3)
    responses = tuple(Response(tuple(torch.randint(0, 97, (n,), generator=g).tolist()), "eos") for n in SHARED_RESPONSE_LENS)
    return whole_loss_batch(RolloutBatch(prompts, 3, responses), g, dtype, logprob_mean=-4.6)


def whole_loss_batch(rollout: RolloutBatch, g: torch.Generator, dtype: torch.dtype, *, logprob_mean: float) -> TrainBatch:
    """``rollout`` with every response token in the loss, random advantages, and old and reference
    log-probs around ``logprob_mean`` (0.3 spread), drawn from ``g`` in ``dtype``; zero rewards."""
    lens = [len(r.response_ids) for r in rollout.responses]
    masks = tuple(torch.ones(n, dtype=torch.bool) for n in lens)
    advantages = tuple(torch.randn(n, generator=g, dtype=dtype) for n in lens)
    old = tuple(logprob_mean + 0.3 * torch.randn(n, generator=g, dtype=dtype) for n in lens)
    ref = tuple(logprob_mean + 0.3 * torch.randn(n, generator=g, dtype=dtype) for n in lens)
    rewards = torch.zeros(len(lens))
    return TrainBatch(ScoredBatch(rollout, rewards, rewards), advantages, masks, old, ref)


def shared_prompt_config(mode: str, budget: int, attention: str = "varlen") -> RunConfig:
    """The pass sections of `shared_prompt_batch`: ``budget`` tokens per micro-batch of either pass, KL and entropy terms on."""
    return pass_config(batch_size=3, n=3, max_prompt_tokens=14, max_response_tokens=12, update_tokens=budget, logprob_tokens=budget,
                       attention=attention, loss_agg_mode=mode, kl_coef=0.1, entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1)


STEPWISE_PROMPT_LENS = [6, 9]
"""Prompt lengths of `stepwise_batch`."""


def trajectory_response(g: torch.Generator, turns: list[int], tools: list[int], starts: tuple[int, ...]) -> Response:
    """Assistant turns of ``turns`` tokens, each but the last closed and answered by ``tools[k]`` tool tokens.

    ``starts`` gives each turn's context start as a turn number (0 = no turn dropped)."""
    segments, mask = [], []
    for k, n in enumerate(turns):
        segments.append(("assistant", n))
        if k < len(turns) - 1:
            segments += [("template", 1), ("tool", tools[k])]
    for role, n in segments:
        mask += [role == "assistant"] * n
    trajectory = Trajectory(tuple(segments), num_tool_calls=len(turns) - 1)
    spans = trajectory.turn_spans()
    context_starts = tuple(0 if k == 0 else spans[k][0] for k in starts) if any(starts) else ()
    ids = tuple(torch.randint(0, 97, (len(mask),), generator=g).tolist())
    return Response(ids, "eos", None, tuple(mask), trajectory=Trajectory(tuple(segments), len(turns) - 1, context_starts=context_starts))


def stepwise_batch() -> TrainBatch:
    """Two prompts x two trajectories: 0 and 3 dropped turns (two and one runs), 1 is multi-turn without drops, 2 a single turn."""
    g = torch.Generator().manual_seed(5)
    prompts = PromptBatch(tuple(tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in STEPWISE_PROMPT_LENS),
                          ("0",) * 2, ("t",) * 2, (0, 1), (False,) * 2)
    responses = (
        trajectory_response(g, [5, 7, 4], [3, 6], (0, 0, 1)),  # turn 3 saw turn 2 only: runs (turns 1-2) and (turn 3)
        trajectory_response(g, [6, 3], [4], (0, 0)),
        Response(tuple(torch.randint(0, 97, (9,), generator=g).tolist()), "eos"),
        trajectory_response(g, [4, 5, 3, 6], [2, 5, 3], (0, 1, 2, 2)),  # runs (1), (2), (3-4)
    )
    rollout = RolloutBatch(prompts, 2, responses)
    advantages = tuple(torch.randn(len(r.response_ids), generator=g, dtype=torch.float64) for r in responses)
    masks = tuple(r.generated_mask() for r in responses)
    rewards = torch.zeros(len(responses))
    return TrainBatch(ScoredBatch(rollout, rewards, rewards), advantages, masks, None, None)


# --- tiny hybrid models ---------------------------------------------------------------------------

FAMILY_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512,
                     pad_token_id=0, eos_token_id=2, bos_token_id=1)
"""Config values every tiny model of `HYBRIDS` shares (where its config class has them)."""

FAMILIES = {
    "lfm2": ("Lfm2Config", dict(num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
                                block_auto_adjust_ff_dim=False)),
    "jamba": ("JambaConfig", dict(num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                  num_experts=1, expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False,
                                  mamba_d_state=8, mamba_dt_rank=4)),
    "mamba": ("MambaConfig", dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4, use_mambapy=False)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                           linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                           num_experts=0, mlp_only_layers=[0, 1])),
}
"""Hybrid families with conv, SSM or linear-attention layers: family -> (transformers config class, its own values)."""

HYBRIDS = {**FAMILIES, "qwen3_5": ("Qwen3_5TextConfig", dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8))}
"""`FAMILIES` and Qwen3.5's text model, the families the engine and generation tests run."""

LLAMA_SPEC = ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2))
"""The Llama control of the hybrid families, in the form of `HYBRIDS`' values."""


def hybrid_config(family: str, **overrides):
    """The config of a tiny ``family`` model (`HYBRIDS` or ``llama``) with ``overrides``; skips where transformers lacks it."""
    import transformers

    name, extra = LLAMA_SPEC if family == "llama" else HYBRIDS[family]
    if not hasattr(transformers, name):
        pytest.skip(f"this transformers has no {name}")
    config_cls = getattr(transformers, name)
    kwargs = {k: v for k, v in (FAMILY_COMMON | extra | overrides).items()
              if k in config_cls.__dataclass_fields__ or hasattr(config_cls(), k)}
    config = config_cls(**kwargs)
    if getattr(config, "max_position_embeddings", None) is None:  # Mamba has no positional limit; packrl's budgets need one
        config.max_position_embeddings = 512
    return config


def hybrid_model(family: str) -> torch.nn.Module:
    """A tiny random float32 ``family`` model (`HYBRIDS`) in eval mode, on SDPA where the architecture has it, with packed attention."""
    import transformers

    from packrl.models.attention import use_packed_attention

    config = hybrid_config(family)
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no SDPA for this architecture
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    use_packed_attention(model)
    return model.float().eval()


# --- multi-turn rollouts with a scripted engine ---------------------------------------------------

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
"""A calculator call; ``CALL % expression`` is the text of one."""


class ScriptedEngine:
    """Writes ``turns[k]`` as the k-th turn of every trajectory, cut to the request's budget, and records every request."""

    def __init__(self, tokenizer, turns: list[str], stop: str = "</tool_call>"):
        self.tokenizer, self.turns, self.stop = tokenizer, turns, stop
        self.requests: list[tuple[tuple[int, ...], int, int]] = []  # (prompt ids, budget, seed)

    def generate(self, prompt_ids, params: SamplingParams, seeds):
        """One response per request: finish ``length`` when cut, else ``stop`` on the stop string or ``eos``."""
        out = []
        for ids, seed in zip(prompt_ids, seeds):
            ids = tuple(ids)
            self.requests.append((ids, params.max_response_tokens, seed))
            text = self.turns[min(self.turn_of(ids), len(self.turns) - 1)]
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            reason = "stop" if text.endswith(self.stop) else "eos"
            if reason == "eos":
                tokens = tokens + [self.tokenizer.eos_token_id]
            if len(tokens) > params.max_response_tokens:
                tokens, reason = tokens[: params.max_response_tokens], "length"
            out.append([Response(tuple(tokens), reason, tuple(-0.5 for _ in tokens) if params.return_logprobs else None)])
        return out

    def turn_of(self, ids) -> int:
        """The turn a request asks for: the assistant turns so far, one header each."""
        return self.tokenizer.decode(list(ids)).count("<|im_start|>assistant") - 1

    def load_weights(self, weights):
        """Nothing to load: the script is the policy."""

    def sleep(self):
        """Holds no memory to release."""

    def wake_up(self):
        """Holds no memory to take back."""

    def close(self):
        """Holds nothing to release."""


def scripted_engine(tok, turns, *, per_turn=64, response=400, trajectory=10_000, context=10_000, max_turns=4, tool_tokens=64,
                    tools=("calculator",), side="right") -> tuple[MultiTurnEngine, ScriptedEngine]:
    """A multi-turn engine over a `ScriptedEngine` writing ``turns``, with these limits; returns both."""
    scripted = ScriptedEngine(tok, turns)
    limits = TurnLimits(max_tokens_per_turn=per_turn, max_response_tokens=response, max_trajectory_tokens=trajectory,
                        max_context_tokens=context)
    engine = MultiTurnEngine(scripted, tok, tools=tools, max_turns=max_turns, limits=limits,
                             max_tool_response_tokens=tool_tokens, truncation_side=side, renderer=ToolRenderer(tok, "tool"))
    return engine, scripted


def calculator_prompt(tok) -> str:
    """The chat-template text of the user question ``What is 12 * 34?`` with the generation prompt."""
    return tok.apply_chat_template([{"role": "user", "content": "What is 12 * 34?"}], add_generation_prompt=True, tokenize=False)


def calculator_prompt_ids(tok) -> tuple[int, ...]:
    """The token ids of `calculator_prompt`."""
    return tuple(tok(calculator_prompt(tok), add_special_tokens=False)["input_ids"])


# --- the audit's character tokenizer and rows -----------------------------------------------------

CHARS = string.ascii_letters + string.digits + " " + string.punctuation[:30]
"""The characters `char_tokenizer` has a token for."""

CHAR_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
"""`char_tokenizer`'s chat template: ``<role>content`` per message, then ``<assistant>``."""

AUDIT_INSTRUCTION = "Solve."
"""The ``data.instruction`` the audit tests set."""

QUESTION_LENGTHS = [5, 10, 20, 30, 40, 50, 60, 70, 80, 200]
"""Question lengths in characters of the audit tests' ten GSM8K-style rows."""

AUDIT_KEYS = {
    "schema", "sources", "model", "tokenizer", "config", "num_rows", "num_bad_rows", "bad_rows", "prompt_tokens",
    "answer_tokens", "num_overlong", "policies", "multimodal", "suggested", "problems", "cached", "wall_s", "rows_per_s",
}
"""The top-level keys of the audit's JSON, as `packrl.inspect.audit` documents them."""


def char_tokenizer():
    """A character-level fast tokenizer with `CHAR_TEMPLATE`, so a prompt's token count is the length of its rendered string."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    fast.chat_template = CHAR_TEMPLATE
    return fast


def prompt_chars(question: str, instruction: str = AUDIT_INSTRUCTION) -> int:
    """Tokens of a GSM8K row's prompt under the character tokenizer: the rendered string's length."""
    return len(f"<user>{question} {instruction}<assistant>")


def write_jsonl(path: Path, rows) -> str:
    """Write ``rows`` (dicts, or strings written as they are) one a line to ``path``; returns the path as a string."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# --- runs and their folders -----------------------------------------------------------------------

RAY_COMMON = [*BASE, "reward.name=test_letter_e", "train.mini_batch_size=1", "train.lr=1e-2", "train.save_every=2",
              "train.dump_rollouts=true"]
"""Overrides of the data-parallel runs: a dense reward and two mini-batches per step.

Parameters, optimizer state and old log-probs all matter then."""

LAYOUT = ["model.dtype=fp64", "train.lr=1e-4"]
"""Overrides under which two layouts of one run train alike to rounding (tests/same_training.py says why)."""


def metric_lines(run_dir: Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``, one per step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rollout_responses(run_dir: Path, step: int) -> list[str]:
    """The response texts of step ``step``'s rollout dump."""
    return [json.loads(line)["response"] for line in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
