"""`packrl sft`: supervised fine-tuning on chat traces, a recipe beside RL's on the shared parts.

The recipe owns its choices and shares the machinery. It checks its own rules
(`packrl.config.sft_rules`, never the RL ones), builds its update (`update_spec`: the registered
``sft`` loss, ``-log p`` per token (`packrl.algos.policy_losses.sft_nll`), aggregated
``token-mean`` over the assistant's tokens of the whole step, ``sft.lr``, one mini-batch of
``sft.batch_size`` traces) and a plan with no engine, reference or critic
(`packrl.config.plan.BatchPlan.supervised`). The rest is RL's: the worker group's update
(token-budget micro-batches under ``train.max_tokens_per_microbatch``, packing, chunked
log-probs, rank balancing, FSDP2 ranks; the loss and gradient do not depend on the split), the
epoch sampler with its data fingerprint (`packrl.data.sampler.EpochSampler`: epochs of a
permutation seeded by ``train.seed``, a step may span two), resume (`packrl.trainer.resume`), the
row accounting and RUN_DIR (`packrl.trainer.run.Run`: metrics.jsonl, checkpoints/step_N, which
loads as ``model.path`` of an RL run), and recovery from a lost Ray actor (``trainer.max_restarts``,
`packrl.trainer.recovery`).

Another supervised objective (rejection-sampling fine-tuning, distillation) is one file like this
one: its rows, its `UpdateSpec` (its registered loss), and the same loop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from packrl.chat.tool_schemas import template_kwargs
from packrl.config.plan import BatchPlan
from packrl.config.schema import AlgorithmConfig, RunConfig, TrainConfig
from packrl.config.sft import SftConfig
from packrl.config.sft_rules import sft_context_problems, sft_problems, trace_budgets
from packrl.config.update_spec import OptimizerSpec, UpdateSpec
from packrl.data.sampler import EpochSampler
from packrl.data.traces import TraceOptions, Traces, load_traces
from packrl.distributed.group import WorkerGroup
from packrl.errors import ConfigError
from packrl.models.loading import resolve_policy
from packrl.trainer.recovery import run_attempts
from packrl.trainer.resume import resume, trainer_state
from packrl.trainer.run import Run, due, seed_everything
from packrl.worker.checkpoint import resume_candidates

logger = logging.getLogger(__name__)

LOSS_METRIC = "sft/loss"
"""The step's mean negative log-likelihood per assistant token (docs/metrics.md)."""


def update_spec(sft: SftConfig, train: TrainConfig) -> UpdateSpec:
    """SFT's update: the registered ``sft`` loss under ``token-mean`` (no KL, entropy bonus or
    clip), AdamW at ``sft.lr`` with ``train``'s weight decay, warm-up, clip and skip rule, one
    mini-batch of ``sft.batch_size`` traces per step and one epoch, log-probs at temperature 1 (the
    model's own likelihood), the loss logged as ``sft/loss`` without RL's diagnostics."""
    return UpdateSpec(algorithm=AlgorithmConfig(policy_loss="sft", loss_agg_mode="token-mean"),
                      optimizer=OptimizerSpec.of(train, lr=sft.lr, lr_key="sft.lr"), mini_batch_size=sft.batch_size, num_epochs=1,
                      temperature=1.0, loss_metric=LOSS_METRIC, rl_metrics=False)


def trace_options(cfg: RunConfig) -> TraceOptions:
    """How `packrl sft` renders its traces: the trace budgets (``sft.max_prompt_tokens`` /
    ``sft.max_response_tokens``, `packrl.config.sft_rules.trace_budgets`), and the tool role and
    tool schemas of ``rollout.multi_turn``, so a trace renders as the RL run's rollouts do."""
    prompt, response = trace_budgets(cfg.data, cfg.rollout, cfg.sft)
    mt = cfg.rollout.multi_turn
    return TraceOptions(max_prompt_tokens=prompt, max_response_tokens=response, tool_role=mt.tool_role,
                        chat_template_kwargs=template_kwargs(mt))


def sft_traces(cfg: RunConfig, tokenizer: Any) -> Traces:
    """Every row of ``sft.train_files`` rendered as `packrl sft` trains it (`load_traces` under
    `trace_options`). Raises as `load_traces`."""
    return load_traces(cfg.sft, cfg.data, tokenizer, trace_options(cfg), seed=cfg.train.seed)


def trace_sampler(traces: Traces, batch_size: int, seed: int) -> EpochSampler:
    """The traces each step draws: ``batch_size`` (``sft.batch_size``) at a time, epochs of a
    permutation seeded by ``seed`` (``train.seed``), a step taking the rest of an epoch and the start
    of the next (`EpochSampler` with ``drop_last=False``: every trace once per epoch)."""
    return EpochSampler(traces, batch_size, shuffle=True, seed=seed, drop_last=False, noun="traces")


def repeat_warning(batch_size: int, num_traces: int) -> str | None:
    """Why a step would train some traces twice (``sft.batch_size`` over the traces there are), or None."""
    if batch_size <= num_traces:
        return None
    return (f"sft.batch_size={batch_size} > {num_traces} trace(s) to train: every step repeats traces (a step spans "
            f"{batch_size / num_traces:.1f} epochs); lower sft.batch_size or add traces to sft.train_files")


def sft(cfg: RunConfig) -> Path:
    """Run ``sft.total_steps`` supervised steps on ``sft.train_files`` and return RUN_DIR.

    Raises:
        ConfigError: a problem of `packrl.config.sft_rules.sft_problems` (before anything is
            written), or trace budgets over the model context (once the model is read).
        ValueError: no trace to train (`load_traces`), a trace over the micro-batch budget, a
            resume on other traces (`packrl.data.sampler.EpochSampler.load_state_dict`), or any
            error of the worker set-up.
        WorkerLost: a Ray actor or node was lost and ``trainer.max_restarts`` allowed no (more)
            restarts (`packrl.trainer.recovery.run_attempts`, as for RL).
    """
    problems = sft_problems(cfg)
    if problems:
        raise ConfigError(problems)
    seed_everything(cfg.train.seed)
    if cfg.train.resume not in (None, "auto"):
        resume_candidates(Path("."), cfg.train.resume)  # a wrong path fails before anything is written or loaded
    budgets = trace_budgets(cfg.data, cfg.rollout, cfg.sft)
    plan = BatchPlan.supervised(cfg, update_spec(cfg.sft, cfg.train), max_response_tokens=budgets[1])
    with Run(cfg, total_steps=cfg.sft.total_steps) as run:
        policy = resolve_policy(cfg.model)  # model.path resolved once
        traces = sft_traces(cfg, policy.tokenizer)
        run.write_accounting("sft_accounting.txt", {"sft": traces}, f"{traces.num_loss_tokens:,} assistant tokens")
        if (repeats := repeat_warning(cfg.sft.batch_size, len(traces))) is not None:
            logger.warning(repeats)

        def steps(current: RunConfig, workers: WorkerGroup) -> None:  # one attempt's (packrl.trainer.recovery.run_attempts)
            if problems := sft_context_problems(budgets, workers.max_context_tokens):
                raise ConfigError(problems)
            run.note("budgets.txt", workers.plan.summary())
            _steps(current.sft, current.train, run, workers, traces)

        run_attempts(cfg, run, steps, plan=plan, policy=policy)
    return run.dir


def _steps(sft_cfg: SftConfig, train: TrainConfig, run: Run, workers: WorkerGroup, traces: Traces) -> None:
    """Steps after the last completed one up to ``sft.total_steps``, each logged (and checkpointed
    when due); ``sft_cfg`` and ``train``: the ``sft`` and ``train`` sections."""
    total = sft_cfg.total_steps
    sampler = trace_sampler(traces, sft_cfg.batch_size, train.seed)
    parts = {"sampler": sampler}
    done = resume(run, workers, train, parts, total_steps=total, total_key="sft.total_steps")
    run.start_steps(done)
    for step in range(done + 1, total + 1):
        seed_everything(train.seed * 1_000_003 + step)
        batch = traces.train_batch(sampler.next_indices())
        start = time.perf_counter()
        metrics = workers.update(batch, step=step)
        seconds = time.perf_counter() - start
        num_tokens = sum(batch.rollout.sequence_lengths())
        metrics |= {"sft/epoch": sampler.epochs_drawn, "sft/num_tokens": float(num_tokens),
                    "sft/num_loss_tokens": float(sum(int(m.sum()) for m in batch.loss_masks)),
                    "perf/update_s": seconds, "perf/sft_tokens_per_s": num_tokens / max(seconds, 1e-9)}
        run.log_step(step, metrics)
        if due(step, train.save_every, total):
            workers.save_checkpoint(run.dir, step, trainer_state(parts))
