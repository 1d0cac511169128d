"""The in-process worker group: one actor (and an optional frozen reference) on one device.

The memory features meet here: the model arrives from `load_policy` with RoPE scaling, gradient
checkpointing and LoRA applied; the group adds activation offload to the update's context
(`LocalWorkerGroup.update_context`), runs the LoRA reference with the adapters disabled, keeps
the bf16 rollout copy in step with the merged adapter, and saves and restores adapters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import save_on_cpu

from packrl.config.schema import RunConfig
from packrl.diagnostics.trace import NullTracer
from packrl.distributed.protocol import Role
from packrl.models.attention import PACKRL_SDPA
from packrl.models.loading import disable_gradient_checkpointing, load_policy, load_reference
from packrl.models.lora import (
    base_policy, is_lora, load_adapter, merged_copy, parameter_counts, sync_merged_weights,
)
from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.seqlen.budgets import model_context_tokens
from packrl.trainer.actor import LogprobResult, SkipCounter, compute_logprobs, update_actor
from packrl.trainer.checkpoint import (
    check_disk_space, checkpoint_bytes, full_optimizer_state, load_optimizer_and_schedule, load_trainer_state, save_checkpoint,
    weights_state_dict,
)
from packrl.types import PromptBatch, RolloutBatch, TrainBatch


logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rollout_weights(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """The model generation runs on: ``model`` itself in float32, else a copy in ``dtype``.

    Under autocast every decode step would re-cast all float32 weights; a bf16 copy, synced
    after each optimizer step (`sync_rollout_weights`), generates about twice as fast on CPU
    for one extra bf16 copy of the weights (0.27 GB for 135M parameters). For a LoRA model the
    copy is a plain model holding the merged weights ``W + (alpha / r) B A``
    (`packrl.models.lora.merged_copy`), so decoding pays no adapter matmuls; in float32 the peft
    model itself generates, adapters included. The copy never checkpoints activations.
    """
    if dtype is None:
        return model
    import copy

    twin = merged_copy(model) if is_lora(model) else copy.deepcopy(model)
    disable_gradient_checkpointing(twin)
    for param in twin.parameters():  # buffers (RoPE frequencies) stay float32, as in training
        param.data = param.data.to(dtype)
    twin.config.dtype = dtype
    if twin.config._attn_implementation == PACKRL_SDPA:  # the copy never runs packs
        twin.set_attn_implementation("sdpa")
    # requires_grad stays True (generation runs under no_grad and no optimizer holds the copy):
    # with frozen weights, torch's matmul turns the prefill's LM head on the last position's
    # strided hidden states into a batched matmul over a b-fold expanded copy of the
    # V x H weight (1.8 GB and about 1 s for 32 rows of SmolLM2-135M).
    return twin.eval()


@torch.no_grad()
def sync_rollout_weights(model: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Copy (and cast) the trained parameters into the rollout copy; no-op when they are one.
    A LoRA model's adapters are merged into the copy's weights (`sync_merged_weights`)."""
    if twin is model:
        return
    if is_lora(model):
        sync_merged_weights(model, twin)
        return
    for dst, src in zip(twin.parameters(), model.parameters(), strict=True):
        dst.copy_(src)


class LocalWorkerGroup:
    """Actor, reference, rollout engine and optimizer in this process.

    The reference model exists only when ``algorithm.kl_coef > 0``; with LoRA it is the policy
    itself, whose ``ref`` forwards run with the adapters disabled. Parameters and optimizer
    states are float32, and the optimizer holds only trainable parameters (the adapters, with
    LoRA); ``model.dtype=bf16`` runs training forwards under autocast and generation on a bf16
    copy of the weights, synced after every update.

    With one optimizer step per rollout (``train.ppo_epochs=1``, ``train.mini_batch_size`` =
    ``data.batch_size``), the policy that sampled is the policy being updated: its old log-probs
    equal the update's own (detached) log-probs, so that forward is skipped (as TRL does with
    ``num_iterations=1``), unless in-reward KL or rollout log-probs ask for them.
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, reference: torch.nn.Module | None = None):
        if cfg.model.lora.rank > 0 and not is_lora(model):
            raise ValueError(f"model.lora.rank={cfg.model.lora.rank} but the model given has no LoRA adapters; load it with "
                             "packrl.models.loading.load_policy (which applies model.lora), or set model.lora.rank=0")
        self.cfg, self.model, self.tokenizer, self.reference = cfg, model, tokenizer, reference
        self.device = next(model.parameters()).device
        self.max_context_tokens, self.rope_factor = model_context_tokens(model.config)
        self.model_summary = describe_policy(model, cfg, self.max_context_tokens)
        logger.info("%s", self.model_summary)
        if cfg.model.activation_offload and self.device.type != "cuda":
            logger.warning("model.activation_offload=true on %s: activations already live in host memory, so offloading only "
                           "copies them; set model.activation_offload=false", self.device.type)
        self._dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else None
        self.rollout_model = rollout_weights(model, self._dtype)
        self.engine = HFEngine(self.rollout_model, tokenizer, max_context_tokens=self.max_context_tokens,
                               max_num_seqs=cfg.rollout.max_num_seqs, autocast_dtype=None)
        self.on_policy = is_on_policy(cfg)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warmup = cfg.train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.skips = SkipCounter(cfg.train.max_consecutive_skips)

    @classmethod
    def build(cls, cfg: RunConfig, device: torch.device | None = None, run_dir: Path | None = None) -> LocalWorkerGroup:
        """Load the policy (and reference) for ``cfg``. With ``run_dir``, first check from the model
        config alone that its disk can hold one checkpoint (`check_disk_space`)."""
        if run_dir is not None:
            check_disk_space(run_dir, checkpoint_bytes(cfg), lora=cfg.model.lora.rank > 0)
        model, tokenizer = load_policy(cfg.model, device=device or default_device())
        reference = load_reference(model) if cfg.algorithm.kl_coef > 0 else None
        return cls(cfg, model, tokenizer, reference)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    @contextlib.contextmanager
    def update_context(self) -> Iterator[None]:
        """The context of each update micro-batch's forward: autocast to ``model.dtype`` and, with
        ``model.activation_offload``, `torch.autograd.graph.save_on_cpu` (pinned host memory on
        CUDA): every tensor the forward saves for the backward is moved to host memory when saved
        and brought back when the backward reads it. With gradient checkpointing that is each
        checkpointed layer's input and the tensors outside the layers (embeddings, LM head chunks).
        Measured on one H200 (SmolLM2-135M shape, one 32,768-token pack, bf16): peak memory above
        the weights 30.3 GiB -> 3.1 GiB at 2.0 s instead of 0.45 s per forward + backward alone;
        with gradient checkpointing 4.4 GiB -> 3.1 GiB at 0.69 s instead of 0.56 s.
        """
        offload = save_on_cpu(pin_memory=self.device.type == "cuda") if self.cfg.model.activation_offload else contextlib.nullcontext()
        with self.autocast(), offload:
            yield

    @contextlib.contextmanager
    def reference_context(self) -> Iterator[None]:
        """The context of the reference forwards: autocast, and the base model of a LoRA reference."""
        with self.autocast(), base_policy(self.reference):
            yield

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        """Generate the step's responses; a raising engine is retried once, then the failure names
        the data rows of the batch and the cause (RuntimeError). Bad prompts (ValueError) are not
        retried."""
        groups = generate_with_retry(lambda: self.engine.generate(prompts.prompt_ids, params), prompts)
        return RolloutBatch(prompts, params.n, tuple(r for group in groups for r in group))

    def compute_logprobs(self, rollout: RolloutBatch, role: Role) -> LogprobResult | None:
        model = self.model if role == "actor" else self.reference
        if model is None or (role == "actor" and self.on_policy):
            return None
        return compute_logprobs(model, rollout, self.cfg, self.autocast if role == "actor" else self.reference_context)

    def update(self, batch: TrainBatch, tracer: NullTracer = NullTracer()) -> dict[str, float]:
        metrics = update_actor(self.model, self.optimizer, self.scheduler, batch, self.cfg, self.update_context, tracer=tracer,
                               skips=self.skips)
        sync_rollout_weights(self.model, self.rollout_model)
        return metrics

    def close(self) -> None:
        """Nothing to release: the models go with the group."""

    def save_checkpoint(self, run_dir: Path, step: int, trainer_state: dict) -> Path:
        optimizer_state = {"optimizer": full_optimizer_state(self.model, self.optimizer), "scheduler": self.scheduler.state_dict()}
        return save_checkpoint(run_dir, step, self.model, self.tokenizer, optimizer_state,
                               trainer_state | {"skips": self.skips.state_dict()}, keep_last=self.cfg.train.keep_last)

    def load_checkpoint(self, path: Path) -> dict:
        """Restore weights, optimizer, schedule (with ``train.lr`` applied) and skip counter.

        Raises:
            ValueError: a file of ``path`` is missing, unreadable or does not fit the model (named).
        """
        state, optimizer_state = load_trainer_state(path)
        load_weights(self.model, path)
        sync_rollout_weights(self.model, self.rollout_model)
        load_optimizer_and_schedule(self.model, self.optimizer, self.scheduler, optimizer_state, self.cfg.train.lr, path)
        self.skips.load_state_dict(state.get("skips", {}))
        return state


def generate_with_retry(generate: Callable[[], list], prompts: PromptBatch) -> list:
    """``generate()``, retried once when it raises anything but a ValueError (a bad prompt is not
    retried); a second failure is a RuntimeError naming the batch's data rows and the cause."""
    try:
        return generate()
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - engine failures (OOM, a driver hiccup) get one more try
        logger.warning("generation raised %s: %s; retrying once", type(err).__name__, err)
        try:
            return generate()
        except Exception as again:
            raise RuntimeError(f"generation failed twice for data rows {list(prompts.rows)[:16]}: "
                               f"{type(again).__name__}: {again}") from again


def is_on_policy(cfg: RunConfig) -> bool:
    """One optimizer step per rollout and nothing else that needs them: the old log-probs equal
    the update's own detached log-probs, so their forward is skipped."""
    mini = cfg.train.mini_batch_size
    return (cfg.train.ppo_epochs == 1 and mini in (None, cfg.data.batch_size)
            and not cfg.algorithm.kl_in_reward and not cfg.rollout.return_logprobs)


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


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's weights into ``model`` in place: its safetensors weights
    (`packrl.trainer.checkpoint.weights_state_dict`; tied weights absent from the files keep
    their tie), or for a LoRA model its adapter (`packrl.models.lora.load_adapter`; the base
    weights are ``model.path``'s).

    Raises:
        ValueError: no safetensors weights under ``path`` (naming ``model.lora.rank`` when it holds
            an adapter instead), a parameter of the model missing, or an adapter that does not fit.
    """
    if is_lora(model):
        load_adapter(model, path)
        return
    try:
        state = weights_state_dict(path)
    except ValueError:
        raise
    except Exception as err:  # safetensors raises its own error type for a truncated or corrupt file
        raise ValueError(f"the weights in {path} cannot be read ({type(err).__name__}: {err}); resume from another "
                         "checkpoint with train.resume=RUN_DIR/checkpoints/step_N") from err
    missing, _ = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=True)}
    really_missing = [m for m in missing if m in tied]
    if really_missing:
        raise ValueError(f"{path} lacks weights for {really_missing[:5]}")
