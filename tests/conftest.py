"""Shared fixtures: a tiny random Llama (float32) and the SmolLM2 tokenizer from ../shared.

Tests that read ../shared (the SmolLM2 files, GSM8K) skip without it through `needs_shared` /
`skip_without_shared`, whose reasons start with `NO_SHARED`: the run's summary says once how many
tests that skipped, and with ``PACKRL_REQUIRE_SHARED=1`` (set by .ci/run) the session fails instead
of passing with them skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.models.attention import use_packed_attention

SHARED = Path(os.environ.get("PACKRL_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
SMOLLM_DIR = SHARED / "models" / "smollm2-135m-instruct"
GGUF = SMOLLM_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
GSM8K_DIR = SHARED / "data" / "gsm8k"
NO_SHARED = "needs ../shared"
"""The start of every skip reason for a missing ../shared file (counted by `pytest_terminal_summary`)."""
_shared_skips: list[str] = []


def _missing_reason(paths: tuple[Path, ...]) -> str | None:
    missing = [str(p) for p in paths if not p.exists()]
    return f"{NO_SHARED}: {', '.join(missing)} not found (set PACKRL_SHARED to the shared/ folder)" if missing else None


def needs_shared(*paths: Path) -> pytest.MarkDecorator:
    """A skip mark for tests that read ``paths`` under ../shared."""
    reason = _missing_reason(paths)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_without_shared(*paths: Path) -> None:
    """Skip the running test (or fixture) when one of ``paths`` under ../shared is missing."""
    reason = _missing_reason(paths)
    if reason is not None:
        pytest.skip(reason)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and NO_SHARED in str(report.longrepr[2]):
        _shared_skips.append(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _shared_skips:
        required = os.environ.get("PACKRL_REQUIRE_SHARED") == "1"
        fails = "; PACKRL_REQUIRE_SHARED=1 fails the run" if required else ""
        terminalreporter.write_line(f"{len(_shared_skips)} tests skipped because ../shared was not found at {SHARED} "
                                    f"(set PACKRL_SHARED to the shared/ folder){fails}", red=required, yellow=not required, bold=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _shared_skips and os.environ.get("PACKRL_REQUIRE_SHARED") == "1":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def tiny_llama(*, attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 97) -> LlamaForCausalLM:
    """A 2-layer random Llama with GQA. Its config keeps transformers' default use_cache=True,
    the setting under which naive packing leaks across sequences."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(dtype)
    if attn == "sdpa":
        use_packed_attention(model)
    return model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm_tokenizer():
    skip_without_shared(SMOLLM_DIR / "tokenizer.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM_DIR)



def score_of(model, rollout, cfg, context=None, share_prompts: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs and entropy of every response of ``rollout`` under ``model``, planned and restored
    to rollout order as the worker group does for one rank (`packrl.seqlen.update_plan.PassPlanner.scoring`)."""
    import contextlib
    from dataclasses import replace

    from packrl.config.plan import BatchPlan
    from packrl.worker.actor import compute_logprobs
    from packrl.worker.packs import PackForward

    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=share_prompts), num_ranks=1)
    plan = planner.scoring(rollout.sequence_lengths(), [rollout.prompt_ids_of(i) for i in range(len(rollout))],
                           planner.grouped_caps(*rollout.grouped_loads()))
    forward = PackForward.from_config(cfg, share_prompts)
    values = plan.restore([compute_logprobs(model, rollout, plan.ranks[0].microbatches, forward=forward,
                                           context=context or contextlib.nullcontext)])
    return [lp for lp, _ in values], [ent for _, ent in values]


def logprobs_of(model, rollout, cfg, context=None) -> list[torch.Tensor]:
    """The log-probs of `score_of`."""
    return score_of(model, rollout, cfg, context)[0]


def minibatch_grads(model, batch, cfg, context=None, num_ranks: int = 1, groups=None, units=None, share_prompts: bool = False,
                    keep_masked: bool = False, draw: int = 0) -> float:
    """Forward and backward the first mini-batch of ``batch`` through the update's micro-batch path
    (`packrl.worker.actor.actor_microbatches`) as the controller's planner plans it
    (`packrl.seqlen.update_plan.PassPlanner.update`; with ``keep_masked`` sequences without a loss
    token stay in the micro-batches) for ``num_ranks`` simulated ranks (each
    rank's micro-batches in turn, gradients summed as an all-reduce SUM does; LoRA dropout masks of
    ``draw``, the optimizer steps before it); no optimizer step.
    Returns the mini-batch loss (policy loss + KL - entropy bonus, summed over micro-batches and ranks)."""
    import contextlib
    from dataclasses import replace

    from packrl.config.plan import BatchPlan
    from packrl.seqlen.update_plan import groups_of
    from packrl.worker.actor import MicrobatchLoss, ResponseSums, actor_microbatches

    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=share_prompts), num_ranks=num_ranks, num_epochs=1)
    rollout = batch.rollout
    groups = groups_of(len(rollout), rollout.group_size) if groups is None else groups
    update = planner.update(rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                            [rollout.prompt_ids_of(i) for i in range(len(rollout))], groups=groups, units=units,
                            caps=planner.grouped_caps(*rollout.grouped_loads()), keep_masked=keep_masked)
    loss = MicrobatchLoss.from_config(cfg, share_prompts)
    minibatch = update.minibatches[0]
    sums = ResponseSums.zeros(len(batch.rollout))
    total = 0.0
    for rank in range(num_ranks):
        totals = actor_microbatches(model, batch, minibatch.microbatches(rank), den=minibatch.denominators, loss=loss,
                                  context=context or contextlib.nullcontext, sums=sums, draw=draw)
        metrics = totals.metrics
        algo = cfg.algorithm
        total += metrics["actor/pg_loss"] + algo.kl_coef * metrics["actor/kl_loss"] - algo.entropy_coeff * metrics["actor/entropy"]
    return total


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer):
    """The tiny random policy (tests/diagnostics/tiny_run.py) saved as an HF model folder, as the workers load it."""
    from tests.diagnostics.tiny_run import tiny_policy  # it imports this module

    path = tmp_path_factory.mktemp("tiny-model")
    tiny_policy(smollm_tokenizer).save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return path
