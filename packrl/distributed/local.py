"""The in-process worker group: one actor (and an optional frozen reference) on one device."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from packrl.config.schema import RunConfig
from packrl.distributed.protocol import Role
from packrl.models.attention import PACKRL_SDPA
from packrl.models.loading import load_policy, load_reference
from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.seqlen.budgets import model_context_tokens
from packrl.trainer.actor import LogprobResult, compute_logprobs, update_actor
from packrl.trainer.checkpoint import load_trainer_state, save_checkpoint
from packrl.types import PromptBatch, RolloutBatch, TrainBatch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rollout_weights(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """The model generation runs on: ``model`` itself in float32, else a copy in ``dtype``.

    Under autocast every decode step would re-cast all float32 weights; a bf16 copy, synced
    after each optimizer step (`sync_rollout_weights`), generates about twice as fast on CPU
    for one extra bf16 copy of the weights (0.27 GB for 135M parameters).
    """
    if dtype is None:
        return model
    import copy

    twin = copy.deepcopy(model)
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
    """Copy (and cast) the trained parameters into the rollout copy; no-op when they are one."""
    if twin is model:
        return
    for dst, src in zip(twin.parameters(), model.parameters(), strict=True):
        dst.copy_(src)


class LocalWorkerGroup:
    """Actor, reference, rollout engine and optimizer in this process.

    The reference model exists only when ``algorithm.kl_coef > 0``. Parameters and optimizer
    states are float32; ``model.dtype=bf16`` runs training forwards under autocast and
    generation on a bf16 copy of the weights, synced after every update.

    With one optimizer step per rollout (``train.ppo_epochs=1``, ``train.mini_batch_size`` =
    ``data.batch_size``), the policy that sampled is the policy being updated: its old log-probs
    equal the update's own (detached) log-probs, so that forward is skipped (as TRL does with
    ``num_iterations=1``), unless in-reward KL or rollout log-probs ask for them.
    """

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, reference: torch.nn.Module | None = None):
        self.cfg, self.model, self.tokenizer, self.reference = cfg, model, tokenizer, reference
        self.device = next(model.parameters()).device
        self.max_context_tokens = model_context_tokens(model.config)[0]
        self._dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else None
        self.rollout_model = rollout_weights(model, self._dtype)
        self.engine = HFEngine(self.rollout_model, tokenizer, max_context_tokens=self.max_context_tokens,
                               max_num_seqs=cfg.rollout.max_num_seqs, autocast_dtype=None)
        mini = cfg.train.mini_batch_size
        self.on_policy = (cfg.train.ppo_epochs == 1 and mini in (None, cfg.data.batch_size)
                          and not cfg.algorithm.kl_in_reward and not cfg.rollout.return_logprobs)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        warmup = cfg.train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)

    @classmethod
    def build(cls, cfg: RunConfig, device: torch.device | None = None) -> LocalWorkerGroup:
        model, tokenizer = load_policy(cfg.model, device=device or default_device())
        reference = load_reference(model) if cfg.algorithm.kl_coef > 0 else None
        return cls(cfg, model, tokenizer, reference)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._dtype)

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        groups = self.engine.generate(prompts.prompt_ids, params)
        return RolloutBatch(prompts, params.n, tuple(r for group in groups for r in group))

    def compute_logprobs(self, rollout: RolloutBatch, role: Role) -> LogprobResult | None:
        model = self.model if role == "actor" else self.reference
        if model is None or (role == "actor" and self.on_policy):
            return None
        return compute_logprobs(model, rollout, self.cfg, self.autocast)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        metrics = update_actor(self.model, self.optimizer, self.scheduler, batch, self.cfg, self.autocast)
        sync_rollout_weights(self.model, self.rollout_model)
        return metrics

    def save_checkpoint(self, run_dir: Path, step: int, trainer_state: dict) -> Path:
        optimizer_state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return save_checkpoint(run_dir, step, self.model, self.tokenizer, optimizer_state, trainer_state)

    def load_checkpoint(self, path: Path) -> dict:
        state, optimizer_state = load_trainer_state(path)
        load_weights(self.model, path)
        sync_rollout_weights(self.model, self.rollout_model)
        self.optimizer.load_state_dict(optimizer_state["optimizer"])
        self.scheduler.load_state_dict(optimizer_state["scheduler"])
        return state


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's safetensors weights (single file or sharded with an index) into
    ``model`` in place. Tied weights absent from the files keep their tie.

    Raises:
        ValueError: no safetensors weights under ``path``, or a parameter of the model missing.
    """
    import json

    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    if not all((path / f).is_file() for f in files):
        raise ValueError(f"{path} holds no safetensors weights ({', '.join(files)} expected)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    missing, _ = model.load_state_dict(state, strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=True)}
    really_missing = [m for m in missing if m in tied]
    if really_missing:
        raise ValueError(f"{path} lacks weights for {really_missing[:5]}")
