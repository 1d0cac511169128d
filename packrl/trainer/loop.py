"""The single-controller training loop. It reads top to bottom as one RL step:

    prompts -> gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor -> metrics

and leaves its record in RUN_DIR: metrics.jsonl, rollouts/step_N.jsonl (``train.dump_rollouts``)
and trace.json (``train.trace``; stage spans from the stage timers, micro-batch spans from the update).

Every stage is a function or a worker-group call chosen by config; the loop holds no feature
switches. The worker group (`packrl.distributed.group.WorkerGroup`) reaches one policy worker in
this process or data-parallel ranks over Ray without this file knowing which.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

from packrl.chat.tool_schemas import template_kwargs
from packrl.config.budgets import PromptRoom, budgets_of, budgets_table, response_schedule, validate_budgets
from packrl.config.grouped_caps import grouped_cap_limits
from packrl.config.schema import RunConfig
from packrl.data.dataset import PromptDataset, PromptSampler
from packrl.diagnostics.length_metrics import length_metrics
from packrl.diagnostics.metrics import bucket_metrics, perf_metrics, rollout_metrics, rollout_mismatch_metrics, score_metrics
from packrl.diagnostics.rollout_dump import build_rollout_dump
from packrl.diagnostics.timers import Span, stage_timer
from packrl.diagnostics.trace import build_tracer
from packrl.distributed.group import WorkerGroup
from packrl.models.loading import ResolvedPolicy, resolve_policy
from packrl.reward.score import check_ground_truths, check_reward
from packrl.rollout.engine import SamplingParams
from packrl.trainer.batch import build_train_batch
from packrl.trainer.recovery import run_attempts
from packrl.trainer.resume import Resumable, resume, trainer_state
from packrl.trainer.run import Run, due, seed_everything
from packrl.trainer.stages import sampling_stage
from packrl.trainer.stages.base import SamplingStage, StageContext
from packrl.trainer.validate import validate
from packrl.worker.checkpoint import resume_candidates


def _datasets(cfg: RunConfig, policy: ResolvedPolicy) -> tuple[PromptDataset, PromptDataset | None]:
    caps, kwargs = grouped_cap_limits(cfg.train), template_kwargs(cfg.rollout.multi_turn)
    room = PromptRoom.of(cfg.rollout, policy.max_context_tokens)  # the context bounds the prompt budgets data errors propose
    tokenizer = policy.prompt_encoder()
    most = min(budget for _, budget in response_schedule(cfg.rollout).stages)  # a length target each stage can reach
    train = PromptDataset.build(cfg.data.train_files, tokenizer, cfg.data, seed=cfg.train.seed, split="train", key="data.train_files",
                                caps=caps, chat_template_kwargs=kwargs, room=room, max_target_tokens=most)
    val = None
    if cfg.data.val_files and cfg.train.val_every:
        val = PromptDataset.build(cfg.data.val_files, tokenizer, cfg.data, seed=cfg.train.seed, split="val", key="data.val_files",
                                  caps=caps, chat_template_kwargs=kwargs, room=room, max_target_tokens=most)
    for key, dataset in (("data.train_files", train), ("data.val_files", val)):
        if dataset is not None:
            check_ground_truths(cfg.reward, dataset, key)
    return train, val


def _train_steps(cfg: RunConfig, run: Run, workers: WorkerGroup, train_set: PromptDataset, val_set: PromptDataset | None) -> None:
    """Steps after the last completed one up to ``train.total_steps``, each logged (and checkpointed when due)."""
    sampler = PromptSampler(train_set, cfg.data.batch_size, shuffle=cfg.data.shuffle, seed=cfg.train.seed)
    with closing(sampling_stage(StageContext(cfg, sampler, workers, run.dir))) as sample:  # the stage of trainer.rollout_mode
        _steps(cfg, run, workers, sampler, sample, train_set, val_set)


def _steps(cfg: RunConfig, run: Run, workers: WorkerGroup, sampler: PromptSampler, sample: SamplingStage,
           train_set: PromptDataset, val_set: PromptDataset | None) -> None:
    """The steps themselves (see `_train_steps`)."""
    schedule = response_schedule(cfg.rollout)  # the response budget of each step (length curriculum)
    tracer = build_tracer(cfg.train.trace, run.dir)
    dump_rollouts = build_rollout_dump(cfg.train.dump_rollouts, run.dir, workers.tokenizer)
    total, max_response = cfg.train.total_steps, cfg.rollout.max_response_tokens
    parts: dict[str, Resumable] = {"sampler": sampler, "rollout": sample}  # the data position, partial rollouts carried
    done = resume(run, workers, cfg.train, parts, total_steps=total, total_key="train.total_steps")
    run.start_steps(done)  # the progress bar appears now, below the run's notes
    for step in range(done + 1, total + 1):
        seed_everything(cfg.train.seed * 1_000_003 + step)
        sampling = SamplingParams.from_config(cfg.rollout, max_response_tokens=schedule.at(step),
                                              return_logprobs=workers.plan.return_logprobs)
        timing: dict[str, float] = {}
        spans: list[Span] = []
        with stage_timer(timing, "step", spans):
            rollout, scored, sample_metrics = sample(sampling, timing, spans, step)  # prompts -> gen -> reward
            with stage_timer(timing, "old_log_prob", spans):
                old = workers.compute_logprobs(rollout, "actor")
            with stage_timer(timing, "ref", spans):
                ref = workers.compute_logprobs(rollout, "ref")
            with stage_timer(timing, "values", spans):
                values = workers.compute_values(rollout)  # None without a critic
            with stage_timer(timing, "adv", spans):
                old_logprobs = None if old is None else old.logprobs
                ref_logprobs = None if ref is None else ref.logprobs
                batch, adv_metrics = build_train_batch(scored, old_logprobs, ref_logprobs, cfg.algorithm, values,
                                                       old_entropy=None if old is None else old.entropy)
            with stage_timer(timing, "update_critic", spans):
                critic_metrics = workers.update_critic(batch)  # {} without a critic
            with stage_timer(timing, "update_actor", spans):
                update_metrics = workers.update(batch, tracer, step)
        metrics = schedule.metrics(step) | rollout_metrics(rollout) | score_metrics(batch) | adv_metrics | critic_metrics | update_metrics
        metrics |= bucket_metrics(batch, max_response) | rollout_mismatch_metrics(rollout, old_logprobs, max_response)
        metrics |= perf_metrics(rollout, timing) | train_set.accounting.metrics() | sample_metrics | length_metrics(batch.scored)
        if val_set is not None and due(step, cfg.train.val_every, total):
            metrics |= validate(workers, val_set, cfg.rollout, cfg.reward)
        dump_rollouts(step, batch)
        tracer.end_step(step, spans, num_sequences=len(rollout), num_tokens=sum(rollout.sequence_lengths()))
        run.log_step(step, metrics)
        if due(step, cfg.train.save_every, total):
            workers.save_checkpoint(run.dir, step, trainer_state(parts))


def train(cfg: RunConfig, workers: WorkerGroup | None = None) -> Path:
    """Run ``train.total_steps`` RL steps and return RUN_DIR.

    Raises:
        ConfigError: a budget relation that the model context breaks (checked before any step).
        ValueError: data problems (bad rows without ``data.skip_bad_rows``, too few prompts, ...).
        WorkerLost: a Ray actor or node was lost and ``trainer.max_restarts`` allowed no (more)
            restarts (`packrl.trainer.recovery.run_attempts`).
    """
    seed_everything(cfg.train.seed)
    check_reward(cfg.reward)
    if cfg.train.resume not in (None, "auto"):
        resume_candidates(Path("."), cfg.train.resume)  # a wrong path fails before anything is written or loaded
    with Run(cfg) as run:
        policy = resolve_policy(cfg.model, workers.tokenizer if workers else None)  # model.path resolved once
        train_set, val_set = _datasets(cfg, policy)
        run.write_accounting("prompt_accounting.txt", {"train": train_set} | ({"val": val_set} if val_set is not None else {}))

        def steps(current: RunConfig, group: WorkerGroup) -> None:  # one attempt's (packrl.trainer.recovery.run_attempts)
            budgets = validate_budgets(budgets_of(current, group.max_context_tokens, group.rope_factor))
            extra = train_set.extra_summary()
            run.note("budgets.txt", f"{budgets_table(budgets)}\n{group.plan.summary()}\n  {group.packing.describe()}"
                     + (f"\n{extra}" if extra else ""))
            _train_steps(current, run, group, train_set, val_set)

        run_attempts(cfg, run, steps, workers=workers, policy=policy)
    return run.dir
