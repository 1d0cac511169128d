"""The policy worker: everything one process holds of the policy, the same code in one process
and on every data-parallel rank.

A worker holds the actor, the frozen reference policy (when `BatchPlan.has_reference`), the
critic (when `BatchPlan.has_critic`: `packrl.worker.critic`), the rollout engine
(``rollout.engine``; none when `BatchPlan.generates` is False, as in `packrl sft`), the optimizer,
LR schedule and skip counter of the recipe's update (`BatchPlan.update`), the contexts its
forwards run in, and the checkpoint I/O. Its parallelism strategy
(`packrl.worker.strategy`: `SingleProcess` for one worker, `FSDP2` for each of several) supplies
wrapping, gradient sync, loss scaling, the rollout-weights gather and the state-dict I/O, so
every memory feature works the same under both:

- ``model.gradient_checkpointing`` and ``model.lora.*`` and ``model.rope_scaling``: applied at
  load (`packrl.models.loading.load_policy`);
- ``model.activation_offload``: the update's forwards save their activations through
  `ActivationOffload` (`update_context`), on every rank;
- ``model.dtype`` (resolved for the machine: `BatchPlan.compute_dtype`): bf16 runs forwards under
  autocast and the engine generates on its own bf16 copy; fp64 loads float64 parameters.

The controller (`packrl.distributed.group.WorkerGroup`) plans every pass and sends each worker
its part; a worker executes and returns results in its plan's order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import RunConfig
from packrl.diagnostics.trace import NullTracer, RemoteSpan, SpanRecorder
from packrl.models.compile import active
from packrl.models.isolation import PackingCheck, check_packing
from packrl.models.loading import load_policy, load_reference, processor_files
from packrl.models.lora import base_policy, is_lora
from packrl.models.resolve import ResolvedModel, resolve_model
from packrl.registry import import_plugins
from packrl.rollout.engine import EngineCapabilities, EngineOptions, ExtraInputsEngine, InterruptibleEngine, SamplingParams, awake
from packrl.seqlen.budgets import model_context_tokens
from packrl.seqlen.update_plan import UpdatePlan
from packrl.types import ExtraInputs, Response, RolloutBatch, TrainBatch
from packrl.worker.actor import MicrobatchLoss, UpdateStats, actor_update, compute_logprobs
from packrl.worker.checkpoint import full_optimizer_state, load_optimizer_and_schedule, load_trainer_state, save_checkpoint
from packrl.worker.critic import CRITIC_FILE, CriticRole, CriticStats
from packrl.worker.optim import Optimization
from packrl.worker.packs import PackForward
from packrl.worker.parts import WorkerParts, build_engine, check_modality_run, compiled_layers, shares_prompts
from packrl.worker.strategy import FSDP2, SingleProcess, Strategy, write_on_writer

logger = logging.getLogger(__name__)

Role = Literal["actor", "ref"]


@dataclass(frozen=True)
class WorkerInfo:
    """What the controller learns from a worker at set-up.

    Attributes:
        max_context_tokens: the policy's context in tokens, RoPE scaling included.
        rope_factor: the RoPE scaling factor included in it (1.0 = none).
        model_summary: one line on the policy: parameters, memory features, strategy, packing.
        packing: whether a micro-batch may pack several sequences (`packrl.models.isolation`).
        share_prompts: whether packs write a group's prompt once (``train.share_prompts`` where
            the model's attention path and the strategy allow it, `shares_prompts`).
        capabilities: what the worker's rollouts can do (`packrl.rollout.engine.engine_capabilities`).
    """

    max_context_tokens: int
    rope_factor: float
    model_summary: str
    packing: PackingCheck = PackingCheck(packs=True)
    share_prompts: bool = False
    capabilities: EngineCapabilities = EngineCapabilities()


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """`torch.autograd.graph.save_on_cpu` that counts what it moves: every tensor a forward saves
    for the backward goes to host memory (pinned on CUDA) when saved and comes back when the
    backward reads it. ``num_bytes`` adds up the bytes moved (``perf/offloaded_activation_gib``).

    Measured on one H200 (SmolLM2-135M shape, one 32,768-token pack, bf16): peak memory above the
    weights 30.3 GiB -> 3.1 GiB at 2.0 s instead of 0.45 s per forward + backward alone; with
    gradient checkpointing 4.4 GiB -> 3.1 GiB at 0.69 s instead of 0.56 s.
    """

    def __init__(self, device_type: str) -> None:
        inner = torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda", device_type=device_type)
        self.num_bytes = 0

        def pack(tensor: torch.Tensor) -> Any:
            self.num_bytes += tensor.numel() * tensor.element_size()
            return inner.pack_hook(tensor)

        super().__init__(pack, inner.unpack_hook)


class PolicyWorker:
    """One process's share of the policy. Construct cheaply, then `setup` (on every rank at once:
    the rendezvous blocks until all ranks have joined).

    Args:
        cfg: the run's config.
        plan: the sizes derived from it (`BatchPlan`; whether a reference exists).
        rank / world_size: this rank and ``trainer.num_workers``; one worker runs `SingleProcess`,
            several run `FSDP2`.
        loopback: a local run: collectives on the loopback interface only.

    Raises:
        ValueError: a ``trainer.plugins`` entry cannot be imported in this process, or
            ``model.param_offload`` on a rank without CUDA (`FSDP2`).
    """

    def __init__(self, cfg: RunConfig, plan: BatchPlan, rank: int = 0, world_size: int = 1, loopback: bool = True):
        failures = import_plugins(cfg.trainer.plugins)  # registers the run's own parts in this process too
        if failures:
            raise ValueError(f"trainer.plugins: cannot import {failures[0][0]!r} ({failures[0][1]}); fix it or remove it")
        self.cfg, self.plan = cfg, plan
        self.strategy: Strategy = SingleProcess() if world_size == 1 else FSDP2(
            rank, world_size, loopback, plan.sequence_parallel_size, param_offload=cfg.model.param_offload,
            collective_timeout_s=cfg.trainer.collective_timeout_s)
        if world_size > 1:  # a process of its own (a Ray actor): its library bars off too, as in the controller's run
            from packrl.models.quiet import quiet_libraries

            torch.set_num_threads(cfg.trainer.num_cpus_per_worker)
            quiet_libraries()
        self._dtype = plan.compute_dtype.torch_dtype() if plan.compute_dtype.autocast else None
        self.offloaded_bytes = 0

    def listen(self) -> tuple[str, int] | None:
        """Open this rank's rendezvous socket (rank 0 of several) and return its address."""
        return self.strategy.listen()

    def setup(self, address: tuple[str, int] | None = None, model: torch.nn.Module | None = None, tokenizer: Any = None,
              resolved: ResolvedModel | None = None) -> WorkerInfo:
        """Join the process group, then build the worker's parts (`packrl.worker.parts`) in the
        order that matters: the policy (or ``model`` and ``tokenizer`` as `load_policy` returns
        them), its packing check, the reference, the engine (before wrapping: it copies whole
        weights), the strategy's wrapping, the optimizer, compiled twins, the loss, the critic.
        ``resolved``: where ``model.path`` was found (the controller's, for a worker in its
        process); None: resolved here, once for the weights and the processor files.

        Raises:
            ValueError: ``model.lora.rank > 0`` with a model that has no adapters; packs split over
                sequence-parallel ranks for a model whose packs are not exact; any error of
                `load_policy` or of the engine's factory.
        """
        cfg, strategy, plan = self.cfg, self.strategy, self.plan
        strategy.join(address)
        model, tokenizer, resolved = self._policy(model, tokenizer, resolved)
        max_context, rope_factor = model_context_tokens(model.config)
        packing = self._packing(model)
        if cfg.model.activation_offload and strategy.device.type != "cuda":
            logger.warning("model.activation_offload=true on %s: activations already live in host memory, so offloading only "
                           "copies them; set model.activation_offload=false", strategy.device.type)
        reference = load_reference(model) if plan.has_reference else None
        engine, engine_phrase, capabilities = None, "", EngineCapabilities()  # a recipe on given sequences generates nothing
        if plan.generates:
            options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
            engine, engine_phrase, capabilities = build_engine(cfg.rollout, options, model, tokenizer,
                                                               max_context_tokens=max_context, may_share_policy=strategy.may_share_policy,
                                                               compute_dtype=plan.compute_dtype)
            check_modality_run(cfg, model, capabilities, has_critic=plan.has_critic)
        self.processor_files = processor_files(cfg.model, model.config, resolved)  # copied into checkpoints
        strategy.wrap(model)
        if reference is not None and reference is not model:
            strategy.wrap(reference)
        update, optim = plan.update, plan.update.optimizer
        opt = Optimization.build([p for p in model.parameters() if p.requires_grad], lr=optim.lr, weight_decay=optim.weight_decay,
                                 warmup_steps=optim.warmup_steps, max_consecutive_skips=optim.max_consecutive_skips,
                                 grad_clip=optim.grad_clip, lr_key=optim.lr_key)
        compiled = compiled_layers(cfg.model, cfg.trainer.num_workers, model, reference)
        share, phrase = shares_prompts(cfg.train.share_prompts, model, packing, group_size=plan.group_size,
                                       attention=cfg.model.packed_attention, sequence_parallel_size=cfg.trainer.sequence_parallel_size)
        loss = MicrobatchLoss.of(update, PackForward(cfg.model.packed_attention, cfg.train.logits_chunk_tokens, update.temperature, share))
        critic = (CriticRole.build(cfg, strategy, plan.compute_dtype, compile_layers=compiled["actor"] is not None)
                  if plan.has_critic else None)
        self.parts = WorkerParts(model, tokenizer, reference, engine, opt, compiled, loss, critic, packing, share, phrase, max_context,
                                 rope_factor, capabilities, engine_phrase)
        summary = self.parts.summary(cfg.model, plan.compute_dtype, strategy.describe())
        logger.info("%s", summary)
        return WorkerInfo(max_context, rope_factor, summary, packing, share, capabilities)

    def _policy(self, model: torch.nn.Module | None, tokenizer: Any,
                resolved: ResolvedModel | None) -> tuple[torch.nn.Module, Any, ResolvedModel | None]:
        """``model`` and ``tokenizer``, or the policy loaded as ``model.*`` asks (`load_policy`)
        from ``resolved`` (`resolve_model` here when None), and where it was loaded from (None
        for a given ``model``).

        The load draws from torch's generator seeded with ``train.seed`` (the process's own
        generator is restored afterwards): LoRA's A matrices start random (peft's Kaiming
        init), and every FSDP2 rank keeps its shard of its own copy, so each rank, and one process,
        must draw the same A."""
        cfg = self.cfg
        if model is None:
            resolved = resolved or resolve_model(cfg.model.path)
            with torch.random.fork_rng():
                torch.manual_seed(cfg.train.seed)
                model, tokenizer = load_policy(cfg.model, device=self.strategy.device, compute_dtype=self.plan.compute_dtype,
                                               resolved=resolved)
        if cfg.model.lora.rank > 0 and not is_lora(model):
            raise ValueError(f"model.lora.rank={cfg.model.lora.rank} but the model given has no LoRA adapters; load it with "
                             "packrl.models.loading.load_policy (which applies model.lora), or set model.lora.rank=0")
        return model, tokenizer, resolved

    def _packing(self, model: torch.nn.Module) -> PackingCheck:
        """Whether packs are exact for ``model`` (`check_packing`); sequence parallelism needs them."""
        packing = check_packing(model, self.cfg.model.packed_attention)
        size = self.plan.sequence_parallel_size
        if size > 1 and not packing.packs:
            raise ValueError(f"trainer.sequence_parallel_size={size} splits packs across ranks, but "
                             f"{packing.describe()}; set trainer.sequence_parallel_size=1 for this model")
        return packing

    # The parts, by name (set up by `setup`).
    model = property(lambda self: self.parts.model)
    tokenizer = property(lambda self: self.parts.tokenizer)
    reference = property(lambda self: self.parts.reference)
    engine = property(lambda self: self.parts.engine)
    opt = property(lambda self: self.parts.opt)
    optimizer = property(lambda self: self.parts.opt.optimizer)
    loss = property(lambda self: self.parts.loss)
    compiled = property(lambda self: self.parts.compiled)
    critic = property(lambda self: None if self.parts.critic is None else self.parts.critic.model)
    """The critic's value model, or None (its role: ``parts.critic``)."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype (nothing for ``fp32`` and ``fp64``, which the parameters hold)."""
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.strategy.device.type, dtype=self._dtype)

    @contextlib.contextmanager
    def update_context(self) -> Iterator[None]:
        """The context of each update micro-batch's forward: autocast and, with
        ``model.activation_offload``, `ActivationOffload` (with gradient checkpointing that moves
        each checkpointed layer's input and the tensors outside the layers)."""
        if not self.cfg.model.activation_offload:
            with self.autocast():
                yield
            return
        offload = ActivationOffload(self.strategy.device.type)
        try:
            with self.autocast(), offload:
                yield
        finally:
            self.offloaded_bytes += offload.num_bytes

    @contextlib.contextmanager
    def reference_context(self) -> Iterator[None]:
        """The context of the reference forwards: autocast, and the base model of a LoRA reference."""
        with self.autocast(), base_policy(self.reference):
            yield

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                 extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
        """``[B][G]`` responses for this worker's prompts (the engine awake only meanwhile), with
        their extra inputs when the prompts have them (`check_modality_run` refused an engine that
        cannot take them at set-up)."""
        assert self.engine is not None, "the group generates only with a plan that generates"
        if extra_inputs is None:
            return awake(self.engine, self.engine.generate, prompt_ids, params, seeds)
        assert self.parts.capabilities.modalities, "check_modality_run refuses a multimodal policy whose engine takes no extra inputs"
        generate = functools.partial(cast(ExtraInputsEngine, self.engine).generate, extra_inputs=extra_inputs)
        return awake(self.engine, generate, prompt_ids, params, seeds)

    def generate_until(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                       caps: Sequence[int], enough: Any) -> list[Response]:
        """The engine's ``generate_until`` (`packrl.rollout.engine.InterruptibleEngine`: one response
        per prompt, stopped between decode rounds once ``enough(finished)``); called only where the
        run's rollouts declare it (`packrl.capabilities.EngineCapabilities.stop_on_condition`)."""
        assert self.parts.capabilities.stop_on_condition, "the group calls generate_until only where the rollouts can stop"
        return awake(self.engine, cast(InterruptibleEngine, self.engine).generate_until, prompt_ids, params, seeds, caps, enough)

    def compute_logprobs(self, rollout: RolloutBatch, role: Role,
                         microbatches: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Log-probs and entropy of this worker's micro-batches under the actor or the reference,
        in plan order (`packrl.worker.actor.compute_logprobs`)."""
        model, context = (self.model, self.autocast) if role == "actor" else (self.reference, self.reference_context)
        assert model is not None, "the controller asks for reference log-probs only when a reference exists"
        with self.strategy.sequence_parallel(), active(self.compiled[role]):
            result = compute_logprobs(model, rollout, microbatches, forward=self.loss.forward, context=context)
        self.strategy.after_no_grad(model)
        return result

    def update(self, batch: TrainBatch, plan: UpdatePlan, tracer: NullTracer | None = None) -> tuple[UpdateStats, list[RemoteSpan]]:
        """This rank's part of ``plan``, then the new weights into the engine.

        Args:
            tracer: records each micro-batch; None records them on the wall clock and returns
                them (a worker in another process).

        Returns:
            ``(stats, spans)``: spans are empty when ``tracer`` was given.

        Raises:
            ValueError: ``train.max_consecutive_skips`` non-finite gradient norms in a row; a
                policy loss that returns the wrong shape.
        """
        recorder = tracer if tracer is not None else SpanRecorder()
        self.offloaded_bytes = 0
        sp = self.strategy.sp
        if sp is not None:
            sp.all_to_all_s = 0.0
        with self.strategy.sequence_parallel(), active(self.compiled["actor"]):
            stats = actor_update(self.model, batch, plan, rank=self.strategy.dp_rank, loss=self.loss, opt=self.opt,
                               context=self.update_context, tracer=recorder, parallel=self.strategy.parallel(self.model))
        stats.offloaded_bytes = self.offloaded_bytes
        stats.all_to_all_s = 0.0 if sp is None else sp.all_to_all_s
        self._sync_engine()
        if tracer is not None:
            return stats, []
        assert isinstance(recorder, SpanRecorder), "made above when no tracer was given"
        return stats, recorder.spans

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's whole weights by name on the CPU, copied (for rollout workers in other
        processes); a collective under FSDP2. None on ranks that are not the writer."""
        weights = {name: value.detach().to("cpu", copy=True) for name, value in self.strategy.rollout_weights(self.model)}
        return weights if self.strategy.is_writer else None

    def compute_values(self, rollout: RolloutBatch, microbatches: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, float]]:
        """The critic's values of this worker's micro-batches, in plan order (`packrl.worker.critic.CriticRole.values`)."""
        critic = self.parts.critic
        assert critic is not None, "the controller asks for values only when the run has a critic"
        result = critic.values(rollout, microbatches, context=self.autocast, forward=self.loss.forward)
        self.strategy.after_no_grad(critic.model)
        return result

    def update_critic(self, batch: TrainBatch, plan: UpdatePlan) -> CriticStats:
        """This rank's part of ``plan`` for the critic (`packrl.worker.critic.CriticRole.update`)."""
        critic = self.parts.critic
        assert critic is not None, "the controller updates the critic only when the run has one"
        return critic.update(batch, plan, rank=self.strategy.dp_rank, context=self.autocast, forward=self.loss.forward,
                             parallel=self.strategy.parallel(critic.model))

    def save_checkpoint(self, run_dir: str | Path, step: int, trainer_state: dict) -> str | None:
        """Write ``run_dir/checkpoints/step_N`` (full weights and full optimizer state, gathered on
        every rank under FSDP2; written by rank 0). Returns its path on the writer, else None."""
        weights = self.strategy.full_weights(self.model)
        optimizer = full_optimizer_state(self.model, self.optimizer)
        critic = self.parts.critic
        critic_state = None if critic is None else critic.state(self.strategy.full_weights(critic.model))
        path = write_on_writer(self.strategy, f"checkpoint step_{step} under {run_dir}", lambda: save_checkpoint(
            Path(run_dir), step, self.model, tokenizer=self.tokenizer, copy_files=self.processor_files,
            optimizer_state={"optimizer": optimizer, "scheduler": self.opt.scheduler.state_dict()},
            trainer_state=trainer_state | {"skips": self.opt.skips.state_dict()}, keep_last=self.cfg.train.keep_last,
            state_dict=weights, extra_files={CRITIC_FILE: critic_state} if critic_state is not None else None))
        return None if path is None else str(path)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore weights, optimizer, schedule (with the update's learning rate applied:
        ``train.lr``, ``sft.lr``) and skip counter; the engine follows. Returns the checkpoint's trainer state.

        Raises:
            ValueError: a file of ``path`` is missing, unreadable or does not fit the model (named).
        """
        path = Path(path)
        state, optimizer_state = load_trainer_state(path)
        self.strategy.load_weights(self.model, path)
        load_optimizer_and_schedule(self.model, self.optimizer, self.opt.scheduler, optimizer_state, self.plan.update.optimizer.lr, path)
        self.opt.skips.load_state_dict(state.get("skips", {}))
        if self.parts.critic is not None:
            self.parts.critic.load(path)
        self._sync_engine()
        return state

    def _sync_engine(self) -> None:
        """The policy's new weights into the rollout engine (none when the plan generates nothing)."""
        if self.engine is not None:
            self.engine.load_weights(self.strategy.rollout_weights(self.model))

    def close(self) -> None:
        """Close the rollout engine and leave the process group (FSDP2)."""
        parts = getattr(self, "parts", None)  # None when setup never ran
        if parts is not None and parts.engine is not None:
            parts.engine.close()
        self.strategy.close()
