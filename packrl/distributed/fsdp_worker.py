"""One data-parallel rank: a torch.distributed process holding an FSDP2 shard of the actor (and of
the frozen reference), an unsharded copy of the weights for generation, and its optimizer shard.

`RayWorkerGroup` runs one `FSDPWorker` per Ray actor; the controller hands each rank its part of
every batch (`packrl.seqlen.balance.balance_ranks`) and puts the results back in order. Inside a
rank the work is the single-process code of `packrl.trainer.actor`, given this rank's
micro-batches and the mini-batch's global loss denominators (summed over ranks with an
all-reduce before the loss), so every ``algorithm.loss_agg_mode`` is exact across ranks.

Sharding (`torch.distributed.fsdp.fully_shard`): every decoder layer, then the root, of the actor
and of the reference. Each rank's loss is its share of the globally normalised loss, so the
gradient is the sum over ranks: the loss is scaled by the rank count before the backward, which
the reduce-scatter's mean undoes (gloo has no pre-scaled sum), and gradients are reduced once per
mini-batch (``set_requires_gradient_sync`` off for all but its last micro-batch). Generation never
touches the shards: it runs on the unsharded copy (bf16 with ``model.dtype=bf16``), refreshed after
every update by gathering each parameter, so ranks generating different lengths never wait on each
other. Collectives: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from packrl.algos.loss_agg import LossDenominators
from packrl.config.schema import RunConfig
from packrl.diagnostics.trace import RemoteSpan, SpanRecorder
from packrl.distributed.local import default_device, describe_policy, rollout_weights
from packrl.models.loading import load_policy, load_reference
from packrl.models.logprobs import enable_fsdp_forward
from packrl.rollout.engine import SamplingParams
from packrl.rollout.hf_engine import HFEngine
from packrl.seqlen.budgets import model_context_tokens
from packrl.trainer.actor import SkipCounter, UpdateStats, compute_logprobs, run_update
from packrl.trainer.checkpoint import (
    full_optimizer_state, load_optimizer_and_schedule, load_trainer_state, save_checkpoint, weights_state_dict,
)
from packrl.types import RolloutBatch, TrainBatch

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a rank that never joins a collective fails the run instead of hanging it


def rendezvous_listener(loopback: bool) -> socket.socket:
    """A listening socket for torch.distributed's store on rank 0: on loopback for a local run, else
    on this machine's address as Ray sees it (never on all interfaces, where the store would
    listen by default)."""
    if loopback:
        host = "127.0.0.1"
    else:
        import ray

        host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def shard_model(model: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer, then the whole model, and register
    `packrl.models.logprobs.pack_logprobs` as a forward (`enable_fsdp_forward`)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    enable_fsdp_forward(model)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters every FSDP unit of ``model`` still holds. A no-grad forward
    leaves the root unit's parameters gathered (FSDP keeps the root's for the backward that never
    comes); a later training forward would then reuse them without the hooks that reduce their
    gradients."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class FSDPWorker:
    """One rank. Construct cheaply, then `setup` on every rank at once (the rendezvous blocks
    until all ranks have joined).

    Args:
        cfg: the run's config.
        rank / world_size: this rank and ``trainer.num_workers``.
        loopback: a local run: collectives on the loopback interface only.
    """

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, loopback: bool):
        self.cfg, self.rank, self.world_size, self.loopback = cfg, rank, world_size, loopback
        self._listener: socket.socket | None = None  # rank 0's rendezvous socket, opened by `address`
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            os.environ["NCCL_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(cfg.trainer.num_cpus_per_worker)

    def address(self) -> tuple[str, int]:
        """Open rank 0's rendezvous socket (`rendezvous_listener`) and return its address."""
        self._listener = rendezvous_listener(self.loopback)
        host, port = self._listener.getsockname()[:2]
        return host, port

    def setup(self, host: str, port: int) -> dict[str, Any]:
        """Join the process group, load and shard the policy, build the engine and optimizer.

        Returns:
            ``max_context_tokens``, ``rope_factor`` and ``model_summary`` (as `LocalWorkerGroup`).
        """
        cfg = self.cfg
        device = default_device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        listener = self._listener
        store = dist.TCPStore(host, port, self.world_size, is_master=self.rank == 0, timeout=COLLECTIVE_TIMEOUT,
                              **({"master_listen_fd": listener.fileno()} if listener is not None else {}))
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        model, self.tokenizer = load_policy(cfg.model, device=device)
        self.max_context_tokens, self.rope_factor = model_context_tokens(model.config)
        summary = describe_policy(model, cfg, self.max_context_tokens)
        self.reference = load_reference(model) if cfg.algorithm.kl_coef > 0 else None
        self._dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else None
        self.rollout_model = rollout_weights(model, self._dtype or torch.float32)  # always an unsharded copy
        shard_model(model)
        if self.reference is not None:
            shard_model(self.reference)
        self.model = model
        self.engine = HFEngine(self.rollout_model, self.tokenizer, max_context_tokens=self.max_context_tokens,
                               max_num_seqs=cfg.rollout.max_num_seqs)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        warmup = cfg.train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.skips = SkipCounter(cfg.train.max_consecutive_skips)
        return {"max_context_tokens": self.max_context_tokens, "rope_factor": self.rope_factor,
                "model_summary": f"{summary}; data-parallel over {self.world_size} FSDP2 ranks ({backend})"}

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(default_device().type, dtype=self._dtype)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list:
        """This rank's share of the prompts: ``[B_r][G]`` responses (`HFEngine.generate`)."""
        return self.engine.generate(prompt_ids, params, seeds)

    def compute_logprobs(self, rollout: RolloutBatch, role: str, microbatches: Sequence[Sequence[int]]) -> dict[int, tuple]:
        """Log-probs and entropy of this rank's sequences: ``{index: (logprobs [R_i], entropy [R_i])}``."""
        model = self.model if role == "actor" else self.reference
        assert model is not None, "the controller asks for ref log-probs only when a reference exists"
        result = compute_logprobs(model, rollout, self.cfg, self.autocast, microbatches)
        reshard(model)
        return {i: (result.logprobs[i], result.entropy[i]) for mb in microbatches for i in mb}

    def update(self, batch: TrainBatch, plans: dict[int, list[list[int]]]) -> tuple[UpdateStats, list[RemoteSpan]]:
        """The update over this rank's micro-batches of every mini-batch (``plans``: first index of
        the mini-batch -> this rank's micro-batches), then the rollout copy refresh."""
        scale = self.cfg.algorithm.loss_scale_factor or self.cfg.rollout.max_response_tokens
        device = default_device()

        def shard(indices: list[int]) -> tuple[list[list[int]], LossDenominators]:
            microbatches = plans[indices[0]]
            local = LossDenominators.from_masks([batch.loss_masks[i] for mb in microbatches for i in mb], scale)
            counts = torch.tensor([local.num_tokens, local.num_sequences], dtype=torch.int64, device=device)
            dist.all_reduce(counts)  # the global counts, before any loss is formed
            return microbatches, LossDenominators(int(counts[0]), int(counts[1]), scale)

        recorder = SpanRecorder()
        stats = run_update(self.model, self.optimizer, self.scheduler, batch, self.cfg, self.autocast, recorder, self.skips,
                           shard, grad_sync=self.model.set_requires_gradient_sync, loss_scale=float(self.world_size))
        self._sync_rollout()
        return stats, recorder.spans

    @torch.no_grad()
    def _sync_rollout(self) -> None:
        """Gather each parameter (a collective on every rank, in the same order) into the rollout copy."""
        for dst, src in zip(self.rollout_model.parameters(), self.model.parameters(), strict=True):
            dst.copy_(src.full_tensor() if hasattr(src, "full_tensor") else src)

    def save_checkpoint(self, run_dir: str, step: int, trainer_state: dict) -> str | None:
        """Gather the full weights and optimizer state (collectives); rank 0 writes the checkpoint
        in the single-process layout. Returns its path on rank 0, None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for name in _tied_duplicates(self.rollout_model):  # written once, as one process writes them
            weights.pop(name, None)
        optimizer = full_optimizer_state(self.model, self.optimizer)
        path = None
        if self.rank == 0:
            with _as_saved(self.rollout_model):
                path = save_checkpoint(Path(run_dir), step, self.rollout_model, self.tokenizer,
                                       {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()},
                                       trainer_state | {"skips": self.skips.state_dict()}, keep_last=self.cfg.train.keep_last,
                                       state_dict=weights)
        dist.barrier()
        return None if path is None else str(path)

    def load_checkpoint(self, path: str) -> None:
        """Every rank reads the full checkpoint and keeps its shards; the rollout copy follows."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state, optimizer_state = load_trainer_state(Path(path))
        set_model_state_dict(self.model, weights_state_dict(Path(path)),
                             options=StateDictOptions(full_state_dict=True, strict=False))
        load_optimizer_and_schedule(self.model, self.optimizer, self.scheduler, optimizer_state, self.cfg.train.lr, Path(path))
        self.skips.load_state_dict(state.get("skips", {}))
        self._sync_rollout()

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _tied_duplicates(model: torch.nn.Module) -> list[str]:
    """Names of parameters that are another parameter under a second name (tied embeddings)."""
    seen: set[int] = set()
    duplicates = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            duplicates.append(name)
        seen.add(id(param))
    return duplicates


@contextlib.contextmanager
def _as_saved(twin: torch.nn.Module) -> Iterator[None]:
    """The rollout copy's config says float32 (the weights written are the float32 master weights)."""
    dtype = twin.config.dtype
    twin.config.dtype = torch.float32
    try:
        yield
    finally:
        twin.config.dtype = dtype
