"""The policy worker: everything one process holds of the policy, the same code in one process
and on every data-parallel rank.

A worker holds the actor, the frozen reference policy (when `BatchPlan.has_reference`), the
critic (when `BatchPlan.has_critic`: `packrl.worker.critic`), the rollout engine (``rollout.engine``), the optimizer, LR schedule and skip counter, the contexts
its forwards run in, and the checkpoint I/O. Its parallelism strategy
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
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from packrl.config.plan import BatchPlan
from packrl.config.schema import RunConfig
from packrl.diagnostics.trace import NullTracer, RemoteSpan, SpanRecorder
from packrl.models.attention import supports_shared_prompts
from packrl.models.compile import CompiledLayers, active
from packrl.models.isolation import PackingCheck, check_packing
from packrl.models.loading import load_policy, load_reference
from packrl.models.lora import base_policy, is_lora, parameter_counts
from packrl.registry import ROLLOUT_ENGINES, import_plugins
from packrl.rollout.engine import EngineContext, RolloutEngine, SamplingParams
from packrl.rollout.multi_turn import multi_turn_engine
from packrl.seqlen.budgets import model_context_tokens
from packrl.seqlen.update_plan import UpdatePlan
from packrl.types import Response, RolloutBatch, TrainBatch
from packrl.worker.actor import MicrobatchLoss, UpdateStats, actor_update, compute_logprobs
from packrl.worker.optim import Optimization
from packrl.worker.checkpoint import full_optimizer_state, load_optimizer_and_schedule, load_trainer_state, save_checkpoint
from packrl.worker.critic import (CRITIC_FILE, CriticStats, compute_values, critic_optimization, critic_update, load_critic,
                                  load_critic_weights)
from packrl.worker.strategy import FSDP2, SingleProcess

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
    """

    max_context_tokens: int
    rope_factor: float
    model_summary: str
    packing: PackingCheck = PackingCheck(packs=True)
    share_prompts: bool = False


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
        self.strategy = SingleProcess() if world_size == 1 else FSDP2(
            rank, world_size, loopback, plan.sequence_parallel_size, param_offload=cfg.model.param_offload)
        if world_size > 1:  # a process of its own (a Ray actor): its library bars off too, as in the controller's run
            from packrl.models.quiet import quiet_libraries

            torch.set_num_threads(cfg.trainer.num_cpus_per_worker)
            quiet_libraries()
        self._dtype = plan.compute_dtype.torch_dtype() if plan.compute_dtype.autocast else None
        self.offloaded_bytes = 0

    def listen(self) -> tuple[str, int] | None:
        """Open this rank's rendezvous socket (rank 0 of several) and return its address."""
        return self.strategy.listen()

    def setup(self, address: tuple[str, int] | None = None, model: torch.nn.Module | None = None, tokenizer: Any = None) -> WorkerInfo:
        """Join the process group, load the policy (or take ``model`` and ``tokenizer``, as loaded
        by `load_policy`), build the reference, the engine and the optimizer.

        Raises:
            ValueError: ``model.lora.rank > 0`` with a model that has no adapters; any error of
                `load_policy`.
        """
        cfg, strategy = self.cfg, self.strategy
        strategy.join(address)
        if model is None:
            model, tokenizer = load_policy(cfg.model, device=strategy.device, compute_dtype=self.plan.compute_dtype)
        if cfg.model.lora.rank > 0 and not is_lora(model):
            raise ValueError(f"model.lora.rank={cfg.model.lora.rank} but the model given has no LoRA adapters; load it with "
                             "packrl.models.loading.load_policy (which applies model.lora), or set model.lora.rank=0")
        self.model, self.tokenizer = model, tokenizer
        max_context, rope_factor = model_context_tokens(model.config)
        packing = check_packing(model, cfg.model.packed_attention)
        size = self.plan.sequence_parallel_size
        if size > 1 and not packing.packs:
            raise ValueError(f"trainer.sequence_parallel_size={size} splits packs across ranks, but "
                             f"{packing.describe()}; set trainer.sequence_parallel_size=1 for this model")
        summary = (f"{describe_policy(model, cfg, max_context)}; {self.plan.compute_dtype.describe()}; {strategy.describe()}; "
                   f"{packing.describe()}")
        logger.info("%s", summary)
        if cfg.model.activation_offload and strategy.device.type != "cuda":
            logger.warning("model.activation_offload=true on %s: activations already live in host memory, so offloading only "
                           "copies them; set model.activation_offload=false", strategy.device.type)
        self.reference = load_reference(model) if self.plan.has_reference else None
        factory = ROLLOUT_ENGINES.lookup(cfg.rollout.engine)
        self.engine = factory(EngineContext(policy=model, tokenizer=tokenizer, cfg=cfg, max_context_tokens=max_context,
                                           may_share_policy=strategy.may_share_policy, compute_dtype=self.plan.compute_dtype))
        if not isinstance(self.engine, RolloutEngine):
            missing = [m for m in ("generate", "load_weights", "sleep", "wake_up", "close") if not callable(getattr(self.engine, m, None))]
            raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: its factory returned a {type(self.engine).__name__} without "
                             f"{', '.join(missing)}; return an object with the methods of packrl.rollout.engine.RolloutEngine")
        if callable(getattr(self.engine, "describe", None)):
            summary += f"; {self.engine.describe()}"
        if cfg.rollout.multi_turn.enabled:
            self.engine = multi_turn_engine(self.engine, tokenizer, cfg, max_context)
        strategy.wrap(model)
        if self.reference is not None and self.reference is not model:
            strategy.wrap(self.reference)
        self.opt = Optimization.build([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay, warmup_steps=cfg.train.warmup_steps,
                                      max_consecutive_skips=cfg.train.max_consecutive_skips, grad_clip=cfg.train.grad_clip)
        self.optimizer = self.opt.optimizer
        self.compiled = self._compile(model, self.reference)
        share, phrase = shares_prompts(cfg, model, packing)
        self.loss = MicrobatchLoss.from_config(cfg, share_prompts=share)
        self.critic = None
        if self.plan.has_critic:
            self.critic = load_critic(cfg, strategy.device, self.plan.compute_dtype)
            summary += (f"; critic: {sum(p.numel() for p in self.critic.parameters()):,} parameters from "
                        f"{cfg.critic.model.path or cfg.model.path} (value head starts at 0)")
            strategy.wrap(self.critic)
            self.critic_opt = critic_optimization(self.critic, cfg)
            self.compiled["critic"] = CompiledLayers(self.critic) if self.compiled["actor"] is not None else None
        summary += f"; compiled layers: {'off' if self.compiled['actor'] is None else 'on'}"
        summary += f"; shared prompts: {phrase}"  # last, as the run's model summary ends
        return WorkerInfo(max_context, rope_factor, summary, packing, share)

    def _compile(self, model: torch.nn.Module, reference: torch.nn.Module | None) -> dict[str, CompiledLayers | None]:
        """``model.compile``: compiled decoder layers per role (None: that role runs eagerly). Null
        compiles where it can run (`ModelConfig.compile_blocker`) and says so in train.log where
        it cannot; true is refused at config load there."""
        blocker = self.cfg.model.compile_blocker(self.cfg.trainer.num_workers)
        if self.cfg.model.compile is None and blocker:
            logger.info("model.compile: off, %s", blocker)
        if self.cfg.model.compile is False or blocker:
            return {"actor": None, "ref": None, "critic": None}
        actor = CompiledLayers(model)
        ref = None if reference is None else actor if reference is model else CompiledLayers(reference)
        return {"actor": actor, "ref": ref, "critic": None}

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

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[list[Response]]:
        """``[B][G]`` responses for this worker's prompts (the engine awake only meanwhile)."""
        self.engine.wake_up()
        try:
            return self.engine.generate(prompt_ids, params, seeds)
        finally:
            self.engine.sleep()

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
        self.engine.load_weights(self.strategy.rollout_weights(self.model))
        return stats, ([] if tracer is not None else recorder.spans)

    def compute_values(self, rollout: RolloutBatch, microbatches: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, float]]:
        """The critic's values of this worker's micro-batches, in plan order (`packrl.worker.critic.compute_values`)."""
        assert self.critic is not None, "the controller asks for values only when the run has a critic"
        with active(self.compiled["critic"]):
            result = compute_values(self.critic, rollout, microbatches, context=self.autocast, forward=self.loss.forward)
        self.strategy.after_no_grad(self.critic)
        return result

    def update_critic(self, batch: TrainBatch, plan: UpdatePlan) -> CriticStats:
        """This rank's part of ``plan`` for the critic (`packrl.worker.critic.critic_update`)."""
        assert self.critic is not None, "the controller updates the critic only when the run has one"
        with active(self.compiled["critic"]):
            return critic_update(self.critic, batch, plan, rank=self.strategy.dp_rank, opt=self.critic_opt,
                                     context=self.autocast, cliprange=self.cfg.critic.cliprange_value,
                                     mode=self.cfg.algorithm.loss_agg_mode, forward=self.loss.forward,
                                     parallel=self.strategy.parallel(self.critic))

    def _critic_state(self) -> dict | None:
        """The critic's full weights, optimizer, schedule and skip counter (a collective under FSDP2)."""
        if self.critic is None:
            return None
        weights = self.strategy.full_weights(self.critic)
        return {"weights": self.critic.state_dict() if weights is None else weights,
                "optimizer": full_optimizer_state(self.critic, self.critic_opt.optimizer),
                "scheduler": self.critic_opt.scheduler.state_dict(), "skips": self.critic_opt.skips.state_dict()}

    def _load_critic(self, path: Path) -> None:
        """Restore the critic from ``path``'s `CRITIC_FILE`.

        Raises:
            ValueError: the checkpoint has no critic (a run without one wrote it) or one that does not fit.
        """
        if self.critic is None:
            return
        file = path / CRITIC_FILE
        if not file.is_file():
            raise ValueError(f"{path} holds no critic ({CRITIC_FILE}): it was written by a run without one; resume it "
                             "with its own algorithm.adv_estimator / critic.enable, or start a new run")
        state = torch.load(file, map_location="cpu", weights_only=False)
        load_critic_weights(self.critic, state["weights"])
        load_optimizer_and_schedule(self.critic, self.critic_opt.optimizer, self.critic_opt.scheduler,
                                    {"optimizer": state["optimizer"], "scheduler": state["scheduler"]}, self.cfg.critic.lr, file)
        self.critic_opt.skips.load_state_dict(state.get("skips", {}))

    def save_checkpoint(self, run_dir: str | Path, step: int, trainer_state: dict) -> str | None:
        """Write ``run_dir/checkpoints/step_N`` (full weights and full optimizer state, gathered on
        every rank under FSDP2; written by rank 0). Returns its path on the writer, else None."""
        weights = self.strategy.full_weights(self.model)
        optimizer = full_optimizer_state(self.model, self.optimizer)
        critic = self._critic_state()
        path = None
        if self.strategy.is_writer:
            path = save_checkpoint(Path(run_dir), step, self.model, tokenizer=self.tokenizer,
                                   optimizer_state={"optimizer": optimizer, "scheduler": self.opt.scheduler.state_dict()},
                                   trainer_state=trainer_state | {"skips": self.opt.skips.state_dict()},
                                   keep_last=self.cfg.train.keep_last, state_dict=weights,
                                   extra_files={CRITIC_FILE: critic} if critic is not None else None)
        self.strategy.barrier()
        return None if path is None else str(path)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore weights, optimizer, schedule (with ``train.lr`` applied) and skip counter; the
        engine follows. Returns the checkpoint's trainer state.

        Raises:
            ValueError: a file of ``path`` is missing, unreadable or does not fit the model (named).
        """
        path = Path(path)
        state, optimizer_state = load_trainer_state(path)
        self.strategy.load_weights(self.model, path)
        load_optimizer_and_schedule(self.model, self.optimizer, self.opt.scheduler, optimizer_state, self.cfg.train.lr, path)
        self.opt.skips.load_state_dict(state.get("skips", {}))
        self._load_critic(path)
        self.engine.load_weights(self.strategy.rollout_weights(self.model))
        return state

    def close(self) -> None:
        """Close the rollout engine and leave the process group (FSDP2)."""
        engine = getattr(self, "engine", None)  # None when setup never ran
        if engine is not None:
            engine.close()
        self.strategy.close()


def shares_prompts(cfg: RunConfig, model: torch.nn.Module, packing: PackingCheck) -> tuple[bool, str]:
    """``train.share_prompts`` (true, or null = wherever it can run) where it can run: packs at all,
    no sequence parallelism, and an attention path that lets a segment see its prompt
    (`supports_shared_prompts`). When it cannot, a warning says why for true, a log line for null.

    Returns:
        ``(on, phrase)``: the phrase (``"on"`` or ``"off (why)"``) ends the run's model summary.
    """
    if cfg.train.share_prompts is False:
        return False, "off (train.share_prompts=false)"
    why = None
    if not packing.packs:
        why = "this model trains one sequence per micro-batch (its packs are not exact)"
    elif cfg.trainer.sequence_parallel_size > 1:
        why = "sequence parallelism splits packs across ranks"
    elif not supports_shared_prompts(model, cfg.model.packed_attention):
        why = (f"model.packed_attention={cfg.model.packed_attention} runs {model.config._attn_implementation!r}, which cannot let a "
               "response see a prompt segment (use varlen on CPU SDPA, or block_mask)")
    if why is not None:
        if cfg.train.share_prompts:
            logger.warning("train.share_prompts=true has no effect: %s; every sequence is packed whole", why)
        else:
            logger.info("train.share_prompts: off, %s", why)
        return False, f"off ({why})"
    if cfg.rollout.n == 1:
        if cfg.train.share_prompts:
            logger.warning("train.share_prompts=true with rollout.n=1: a group has one response, so only a prompt that repeats "
                           "in a micro-batch is written once; set rollout.n > 1 for shared prompts to save tokens")
        return True, "on (rollout.n=1: only a prompt that repeats in a micro-batch is written once)"
    return True, "on (a group's prompt once per pack)"


def describe_policy(model: torch.nn.Module, cfg: RunConfig, max_context_tokens: int) -> str:
    """One line on the policy for the start of a run: parameters (trainable of total) and the
    memory features in force, e.g. ``policy: 4,884,480 trainable of 139,399,488 parameters
    (3.50%); LoRA rank 16, alpha 32 on 210 Linear layers; ...``."""
    trainable, total = parameter_counts(model)
    lora = "off (full fine-tuning)"
    if is_lora(model):
        from peft.tuners.lora import LoraLayer

        num_layers = sum(isinstance(module, LoraLayer) for module in model.modules())
        adapter = model.peft_config["default"]
        lora = f"rank {adapter.r}, alpha {adapter.lora_alpha:g} on {num_layers} Linear layers"
    checkpointing = any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
    rope = cfg.model.rope_scaling
    scaling = "none" if rope.type == "none" else f"{rope.type} x{rope.factor:g}"
    return (f"policy: {trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%); "
            f"LoRA {lora}; gradient checkpointing {'on' if checkpointing else 'off'}; "
            f"activation offload {'on' if cfg.model.activation_offload else 'off'}; RoPE scaling {scaling} "
            f"(model context {max_context_tokens:,} tokens)")
