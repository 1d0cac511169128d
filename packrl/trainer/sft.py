"""`packrl sft`: supervised fine-tuning on chat traces, with the RL update's machinery.

Each step draws ``sft.batch_size`` traces (`packrl.data.traces`; epochs of a permutation seeded
by ``train.seed``) and runs one update of the registered ``sft`` policy loss (``-log p`` per token,
`packrl.algos.policy_losses.sft_nll`) aggregated ``token-mean`` over the assistant's tokens of the
whole step: the same token-budget micro-batching (``train.max_tokens_per_microbatch``), packing,
chunked log-probs, rank balancing and FSDP2 ranks as an RL update, so the loss and the gradient
do not depend on how the step is split. The run directory is RUN_DIR as for ``packrl train``
(metrics.jsonl, checkpoints/step_N: a checkpoint loads as ``model.path`` of an RL run).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from packrl.config.relations import config_problems
from packrl.config.schema import AlgorithmConfig, RunConfig
from packrl.data.traces import Traces, load_traces
from packrl.distributed import open_worker_group
from packrl.distributed.group import WorkerGroup
from packrl.errors import ConfigError
from packrl.models.loading import load_policy_tokenizer
from packrl.trainer.run import Run, due, seed_everything
from packrl.worker.checkpoint import resume_candidates

logger = logging.getLogger(__name__)

_SET_HERE = ("algorithm.policy_loss", "rollout.n")  # this command's own choices: the sft loss, one trace per group
_RL_ONLY = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/kl_loss")  # an update's RL metrics, meaningless here


def sft_run_config(cfg: RunConfig) -> RunConfig:
    """The config the workers train with: the ``sft`` loss under ``token-mean`` (no KL, entropy,
    critic or rollout correction), ``sft.lr``, one mini-batch of ``sft.batch_size`` traces per step
    (``train.ppo_epochs=1``), ``sft.total_steps`` steps; the rest (model, budgets, ranks) as given."""
    train = replace(cfg.train, lr=cfg.sft.lr, total_steps=cfg.sft.total_steps, mini_batch_size=cfg.sft.batch_size, ppo_epochs=1,
                    val_every=0, dump_rollouts=False)
    return replace(cfg, algorithm=AlgorithmConfig(policy_loss="sft", loss_agg_mode="token-mean"), train=train,
                   data=replace(cfg.data, batch_size=cfg.sft.batch_size), rollout=replace(cfg.rollout, n=1, engine="hf"),
                   critic=replace(cfg.critic, enable=False), trainer=replace(cfg.trainer, rollout_mode="sync"))


def repeat_warning(batch_size: int, num_traces: int) -> str | None:
    """Why a step would train some traces twice (``sft.batch_size`` over the traces there are), or None."""
    if batch_size <= num_traces:
        return None
    return (f"sft.batch_size={batch_size} > {num_traces} trace(s) to train: every step repeats traces (a step spans "
            f"{batch_size / num_traces:.1f} epochs); lower sft.batch_size or add traces to sft.train_files")


def step_indices(num_traces: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The traces of ``step`` (1-based): positions ``(step - 1) * batch_size ...`` of the epochs,
    each a permutation of the traces drawn from ``seed`` and the epoch (a step may span two)."""
    out = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, k = divmod(position, num_traces)
        order = torch.randperm(num_traces, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(order[k]))
    return out


def sft(cfg: RunConfig) -> Path:
    """Run ``sft.total_steps`` supervised steps on ``sft.train_files`` and return RUN_DIR.

    Raises:
        ConfigError: the config the workers would run has a problem (e.g. ``sft.batch_size``
            against ``trainer.num_workers``).
        ValueError: ``sft.total_steps=0``, no trace to train (`load_traces`), a trace over the
            micro-batch budget, or any error of the worker set-up.
    """
    if cfg.sft.total_steps < 1:
        raise ValueError("sft.total_steps=0: nothing to train; set sft.total_steps (e.g. sft.total_steps=50)")
    seed_everything(cfg.train.seed)
    run_cfg = sft_run_config(cfg)
    problems = [p for p in config_problems(run_cfg) if p.key not in _SET_HERE]
    if problems:
        raise ConfigError(problems)
    with Run(run_cfg) as run:
        tokenizer = load_policy_tokenizer(cfg.model)
        traces = load_traces(cfg, tokenizer)
        run.note("sft_accounting.txt", f"sft: {traces.accounting.summary()}; {traces.num_loss_tokens:,} assistant tokens")
        run.write_json("data_accounting.json", {"sft": traces.accounting_dict()})
        if (repeats := repeat_warning(cfg.sft.batch_size, len(traces))) is not None:
            logger.warning(repeats)
        with open_worker_group(run_cfg, run.dir) as workers:
            run.note("model.txt", workers.model_summary)
            run.note("budgets.txt", workers.plan.summary())
            _steps(run_cfg, run, workers, traces)
    return run.dir


def _resume(cfg: RunConfig, run: Run, workers: WorkerGroup) -> int:
    """The last completed step (0 for a fresh run); the weights and optimizer restored from the
    checkpoint ``train.resume`` names (the traces of each step follow from the step)."""
    candidates = resume_candidates(run.dir, cfg.train.resume)
    if not candidates:
        run.truncate_metrics(0)
        return 0
    step = int(workers.load_checkpoint(candidates[0])["step"])
    run.truncate_metrics(step)
    run.note("resumed.txt", f"resumed from {candidates[0]} after step {step}")
    return step


def _steps(cfg: RunConfig, run: Run, workers: WorkerGroup, traces: Traces) -> None:
    total, size = cfg.train.total_steps, cfg.sft.batch_size
    done = _resume(cfg, run, workers)
    run.start_steps(done)
    for step in range(done + 1, total + 1):
        seed_everything(cfg.train.seed * 1_000_003 + step)
        batch = traces.train_batch(step_indices(len(traces), size, step, cfg.train.seed))
        start = time.perf_counter()
        metrics = workers.update(batch, step=step)
        seconds = time.perf_counter() - start
        num_tokens = sum(batch.rollout.sequence_lengths())
        metrics = {k: v for k, v in metrics.items() if k not in _RL_ONLY and not k.startswith("bucket/")}
        metrics["sft/loss"] = metrics.pop("actor/pg_loss")
        metrics |= {"sft/epoch": (step * size) / len(traces), "sft/num_tokens": float(num_tokens),
                    "sft/num_loss_tokens": float(sum(int(m.sum()) for m in batch.loss_masks)),
                    "perf/update_s": seconds, "perf/sft_tokens_per_s": num_tokens / max(seconds, 1e-9)}
        run.log_step(step, metrics)
        if due(step, cfg.train.save_every, total):
            workers.save_checkpoint(run.dir, step, {"sampler": {}, "rollout": {}})
