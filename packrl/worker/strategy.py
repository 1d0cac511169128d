"""Parallelism strategies: how one policy worker holds the policy in its process.

A `PolicyWorker` is the same code in one process and on every data-parallel rank; its strategy
supplies what differs:

==========================  ===========================  =====================================
                            `SingleProcess`              `FSDP2` (``trainer.num_workers > 1``)
==========================  ===========================  =====================================
process group               none                         torch.distributed (gloo on CPU, NCCL)
wrapping                    none                         ``fully_shard`` per decoder layer, root
                                                         (LoRA adapters sharded in their layer)
gradient sync, loss scale   none, 1                      once per mini-batch, x rank count
after a no-grad pass        nothing                      reshard every FSDP unit
rollout weights             the parameters (LoRA:        each parameter gathered whole
                            merged ``W + (alpha/r) BA``)  (``full_tensor``), a collective (LoRA:
                                                         W, A and B gathered, then merged)
checkpoint weights          ``save_pretrained`` (LoRA:   gathered on every rank, written by rank
                            the adapter alone)           0 (LoRA: the adapters alone)
engine may share weights    yes (fp32)                   no: the engine keeps an unsharded copy
==========================  ===========================  =====================================

With ``model.param_offload`` `FSDP2` shards with FSDP2's ``CPUOffloadPolicy``: the parameter
shards, their gradients and the optimizer states live in host memory, each unit is copied to
the device while it computes, and the optimizer steps on the CPU (CUDA only; on a CPU rank it is
refused at set-up).

`weight_layout` tells the memory estimate (`packrl.inspect.memory`) the same facts from the
config alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

if TYPE_CHECKING:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

T = TypeVar("T")

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # torch's default; a run sets its own (trainer.collective_timeout_s)


@dataclass(frozen=True)
class Parallel:
    """What the parallelism strategy adds to the micro-batch loop.

    Attributes:
        grad_sync: called with True before a mini-batch's last backward and False before the
            others (FSDP's ``set_requires_gradient_sync``: gradients reduced once per mini-batch);
            None in one process.
        loss_scale: multiplies the loss before the backward (the rank count under FSDP, whose
            reduce-scatter averages gradients over ranks); metrics are not scaled.
    """

    grad_sync: Callable[[bool], None] | None = None
    loss_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """How one device holds the policy under a strategy, from the config alone.

    Attributes:
        num_shards: the parameters, gradients, optimizer states and reference weights are split
            this many ways (1 = whole on every device).
        engine_copy_always: the rollout engine keeps its own copy of the weights even in float32
            (a sharded policy cannot generate).
        gathers_layers: FSDP gathers whole units while it computes: the root unit (embeddings,
            final norm, LM head) and up to two decoder layers (the current one and the prefetched next).
        params_on_host: the shards of the parameters (policy, reference, critic), their gradients
            and the optimizer states live in host memory (``model.param_offload``); gathered units
            and the engine's copy stay on the device.
    """

    num_shards: int
    engine_copy_always: bool
    gathers_layers: bool
    params_on_host: bool = False


def weight_layout(num_workers: int, param_offload: bool) -> WeightLayout:
    """The layout of a run's strategy: `FSDP2` for ``num_workers > 1`` (``trainer.num_workers``),
    else `SingleProcess`; ``param_offload``: ``model.param_offload``."""
    sharded = num_workers > 1
    return WeightLayout(num_shards=num_workers, engine_copy_always=sharded, gathers_layers=sharded,
                        params_on_host=sharded and param_offload)


def default_device() -> torch.device:
    """CUDA when available (one GPU per process), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Strategy(Protocol):
    """How one policy worker holds the policy in its process: what `SingleProcess` and `FSDP2`
    both implement, and what `packrl.worker.policy.PolicyWorker` asks of its strategy.

    Attributes:
        rank / world_size: this process's rank and the rank count.
        dp_rank: its data-parallel rank (its share of every batch).
        sp: its sequence-parallel group (`packrl.models.ulysses.SequenceParallel`), or None.
        device: where it computes.
        may_share_policy: the rollout engine may generate on the policy's own parameters.
        is_writer: this rank writes checkpoints.
    """

    rank: int
    world_size: int
    dp_rank: int
    sp: Any
    device: torch.device
    may_share_policy: bool

    @property
    def is_writer(self) -> bool: ...

    def listen(self) -> tuple[str, int] | None:
        """Open the rendezvous (rank 0 of several) and return its address; None without one."""
        ...

    def join(self, address: tuple[str, int] | None) -> None:
        """Join the process group at ``address`` (rank 0's `listen`)."""
        ...

    def sequence_parallel(self) -> contextlib.AbstractContextManager:
        """The context of every pass: this rank's sequence-parallel group active, when it has one."""
        ...

    def wrap(self, model: torch.nn.Module) -> None:
        """Shard ``model`` (FSDP2) or leave it whole; before its optimizer is made."""
        ...

    def parallel(self, model: torch.nn.Module) -> Parallel:
        """The gradient sync and loss scale of the update loop for ``model``."""
        ...

    def after_no_grad(self, model: torch.nn.Module) -> None:
        """After a no-grad pass: reshard what the pass gathered."""
        ...

    def rollout_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor)`` of every parameter, for the rollout engine."""
        ...

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole state dict gathered on every rank for a checkpoint (a collective); None when
        the model's own state dict is whole."""
        ...

    def load_weights(self, model: torch.nn.Module, path: Path) -> None:
        """Load a checkpoint's weights into ``model`` (sharding them under FSDP2)."""
        ...

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective under FSDP2: call it on every rank),
        so that one rank's failure reaches the others instead of leaving them waiting."""
        ...

    def close(self) -> None:
        """Leave the process group."""
        ...

    def describe(self) -> str:
        """The strategy's phrase of the run's model summary."""
        ...


def write_on_writer(strategy: Strategy, what: str, write: Callable[[], T]) -> T | None:
    """Run ``write`` on the writer rank only, then tell every rank whether it succeeded (in place
    of a barrier): a write that fails on the writer (a full disk, a permission) fails every rank at
    once instead of leaving the others waiting in their next collective until its timeout
    (``trainer.collective_timeout_s``). Call it on every rank. Returns what ``write`` returned on the writer, else None.

    Raises:
        Exception: the writer's own error, on the writer.
        RuntimeError: on the other ranks when the writer failed, naming ``what``.
    """
    result, failure = None, None
    if strategy.is_writer:
        try:
            result = write()
        except Exception as error:  # noqa: BLE001 - re-raised below, once every rank has heard of it
            failure = error
    if not strategy.all_ok(failure is None):
        if failure is not None:
            raise failure
        raise RuntimeError(f"the writer rank (rank 0) failed to write {what}; its own error names the cause")
    return result


class SingleProcess:
    """The whole policy in this process, on one device."""

    rank = 0
    world_size = 1
    dp_rank = 0
    sp = None
    may_share_policy = True
    is_writer = True

    def __init__(self) -> None:
        self.device = default_device()

    def sequence_parallel(self) -> contextlib.AbstractContextManager:
        """No sequence parallelism in one process."""
        return contextlib.nullcontext()

    def listen(self) -> tuple[str, int] | None:
        """No rendezvous."""
        return None

    def join(self, address: tuple[str, int] | None) -> None:
        """No process group."""

    def wrap(self, model: torch.nn.Module) -> None:
        """Nothing to wrap."""

    def parallel(self, model: torch.nn.Module) -> Parallel:
        return Parallel()

    def after_no_grad(self, model: torch.nn.Module) -> None:
        """Nothing is gathered."""

    def rollout_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters by name; a LoRA model's merged weights (`packrl.models.lora.merged_weights`)."""
        from packrl.models.lora import is_lora, merged_weights

        return merged_weights(model) if is_lora(model) else iter(model.named_parameters())

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """None: the model saves its own weights (a LoRA model its adapter)."""
        return None

    def load_weights(self, model: torch.nn.Module, path: Path) -> None:
        """A checkpoint's weights, or its adapter for a LoRA model (`packrl.worker.checkpoint.load_weights`)."""
        from packrl.worker.checkpoint import load_weights

        load_weights(model, path)

    def all_ok(self, ok: bool) -> bool:
        return ok

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "one process"


class FSDP2:
    """One data-parallel rank: a torch.distributed process holding an FSDP2 shard of the policy.

    Sharding (`torch.distributed.fsdp.fully_shard`): every decoder layer, then the root. A LoRA
    policy's adapters are sharded in the unit of the layer they sit in, beside its frozen base
    weights: FSDP2 shards each parameter on its own (a DTensor per parameter), all-gathers the
    unit's frozen and trainable parameters together and reduce-scatters only the gradients that
    exist, so a unit may mix both, and the gradients and AdamW states of the adapters are split
    over the ranks too. Each
    rank's loss is its share of the globally normalised loss, so the gradient is the sum over
    ranks: the loss is scaled by the rank count before the backward, which the reduce-scatter's
    mean undoes (gloo has no pre-scaled sum), and gradients are reduced once per mini-batch
    (``set_requires_gradient_sync`` off for all but its last micro-batch).

    With ``trainer.sequence_parallel_size = S > 1`` consecutive ranks form sequence-parallel
    groups (ranks ``0..S-1``, ``S..2S-1``, ...): every rank of a group runs the same micro-batches
    on its shard of each pack (`packrl.models.ulysses`), the groups are the data-parallel ranks, and
    FSDP still shards the weights over all ranks.

    Args:
        rank / world_size: this rank and ``trainer.num_workers``.
        loopback: a local run: the rendezvous and collectives stay on the loopback interface.
        sp_size: ``trainer.sequence_parallel_size``.
        param_offload: ``model.param_offload``: shard with FSDP2's ``CPUOffloadPolicy``, so the
            parameter shards, gradients and optimizer states live in host memory.
        collective_timeout_s: ``trainer.collective_timeout_s``: how long the rendezvous and every
            collective of the process group (and its sequence-parallel groups) may wait.

    Raises:
        ValueError: ``param_offload`` on a rank without CUDA.
    """

    may_share_policy = False

    def __init__(self, rank: int, world_size: int, loopback: bool, sp_size: int = 1, param_offload: bool = False,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT.total_seconds()):
        self.rank, self.world_size, self.loopback, self.sp_size = rank, world_size, loopback, sp_size
        self.timeout = timedelta(seconds=collective_timeout_s)
        self.dp_rank = rank // sp_size
        self.sp: Any = None  # the SequenceParallel group, made in `join`
        self.device = default_device()
        if param_offload and self.device.type != "cuda":
            raise ValueError(f"model.param_offload=true moves parameters from GPU memory to host memory, but rank {rank} runs on "
                             f"{self.device.type} (no CUDA device), where they already live in host memory; set "
                             "model.param_offload=false, or run on GPUs")
        self.param_offload = param_offload
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._listener: socket.socket | None = None
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            os.environ["NCCL_SOCKET_IFNAME"] = "lo"

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def listen(self) -> tuple[str, int]:
        """Open rank 0's rendezvous socket for torch.distributed's store and return its address: on
        loopback for a local run, else on this machine's address as Ray sees it (never on all
        interfaces, where the store would listen by default)."""
        if self.loopback:
            host = "127.0.0.1"
        else:
            import ray

            host = ray.util.get_node_ip_address()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen()
        self._listener = sock
        bound_host, port = sock.getsockname()[:2]
        return bound_host, port

    def join(self, address: tuple[str, int] | None) -> None:
        """Join the process group whose rank 0 listens at ``address`` (blocks until every rank has)."""
        import torch.distributed as dist

        assert address is not None, "FSDP2 ranks rendezvous at rank 0's address"
        listener = self._listener
        listen_fd: dict[str, Any] = {"master_listen_fd": listener.fileno()} if listener is not None else {}
        store = dist.TCPStore(address[0], address[1], self.world_size, is_master=self.rank == 0, timeout=self.timeout,
                              **listen_fd)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=self.timeout)
        if self.sp_size > 1:
            from packrl.models.ulysses import SequenceParallel

            size = self.sp_size
            groups = [dist.new_group(list(range(g * size, (g + 1) * size)), timeout=self.timeout)  # all ranks make all
                      for g in range(self.world_size // size)]
            self.sp = SequenceParallel(groups[self.dp_rank], size, self.rank % size, inner="packrl_sdpa")

    def sequence_parallel(self) -> contextlib.AbstractContextManager:
        """The forwards inside split each pack over this rank's sequence-parallel group (a no-op without one)."""
        from packrl.models.ulysses import sequence_parallel

        return sequence_parallel(self.sp)

    def wrap(self, model: torch.nn.Module) -> None:
        """``fully_shard`` each decoder layer, then the whole model, and register
        `packrl.models.logprobs.pack_logprobs` as a forward (`enable_fsdp_forward`)."""
        from torch.distributed.fsdp import fully_shard

        from packrl.models.logprobs import enable_fsdp_forward

        if self.sp is not None:  # attention gathers its heads over the group (packrl.models.ulysses)
            from packrl.models.ulysses import PACKRL_ULYSSES, check_heads

            hf = cast("PreTrainedModel", model)  # torch types a module's attributes beyond its own as Tensor | Module
            problem = check_heads(hf.config, self.sp_size)
            if problem is not None:
                raise ValueError(f"{problem}; set trainer.sequence_parallel_size to a divisor of it")
            if hf.config._attn_implementation != PACKRL_ULYSSES:
                self.sp.inner = hf.config._attn_implementation
                hf.set_attn_implementation(PACKRL_ULYSSES)
        options: dict[str, Any] = {}
        if self.param_offload:  # shards, gradients and optimizer states in (pinned) host memory
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy()
        for layer in cast("PreTrainedModel", model).get_decoder().layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        enable_fsdp_forward(model)

    def parallel(self, model: torch.nn.Module) -> Parallel:
        # `wrap` made ``model`` an FSDPModule (fully_shard swaps its class)
        return Parallel(grad_sync=cast("FSDPModule", model).set_requires_gradient_sync, loss_scale=float(self.world_size))

    def after_no_grad(self, model: torch.nn.Module) -> None:
        """Free the gathered parameters every FSDP unit of ``model`` still holds. A no-grad forward
        leaves the root unit's parameters gathered (FSDP keeps the root's for the backward that
        never comes); a later training forward would then reuse them without the hooks that
        reduce their gradients (the gradient norm was 0.29 instead of 1.14 until this was done)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _whole(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` detached and gathered whole (a collective for a shard). An offloaded shard is
        copied to the device first: NCCL gathers device tensors only."""
        value = param.detach()
        return cast("DTensor", value.to(self.device)).full_tensor() if hasattr(value, "full_tensor") else value

    def rollout_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter gathered whole (a collective on every rank, in the same order); for a
        LoRA model the merged weights of its base model (`packrl.models.lora.merged_weights`,
        each LoRA layer's W, A and B gathered, then merged as one process merges them)."""
        from packrl.models.lora import is_lora, merged_weights

        if is_lora(model):
            return merged_weights(model, self._whole)
        return ((name, self._whole(param)) for name, param in model.named_parameters())

    def full_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights on the CPU, gathered on every rank (a collective), tied duplicates
        dropped (written once, as one process writes them); of a LoRA model its adapters alone
        (`packrl.models.lora.adapter_parameters`: the base weights are ``model.path``'s), which its
        ``save_pretrained`` writes as one process does."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from packrl.models.lora import adapter_parameters, is_lora

        if is_lora(model):
            return {name: self._whole(param).cpu() for name, param in adapter_parameters(model)}
        # a full state dict holds tensors only (torch annotates the union of every state-dict value)
        weights = cast("dict[str, torch.Tensor]",
                       get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        seen: set[int] = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                weights.pop(name, None)
            seen.add(id(param))
        return weights

    def load_weights(self, model: torch.nn.Module, path: Path) -> None:
        """Every rank reads the full checkpoint (of a LoRA model its adapter,
        `packrl.models.lora.read_adapter`) and keeps its shards.

        Raises:
            ValueError: no safetensors weights under ``path`` (`weights_state_dict`); an adapter
                that does not fit the model (`read_adapter`).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from packrl.models.lora import is_lora, read_adapter
        from packrl.worker.checkpoint import weights_state_dict

        # torch annotates an invariant dict of the union of every state-dict value: a dict of tensors is one
        weights = cast("dict[str, Any]", read_adapter(model, path) if is_lora(model) else weights_state_dict(path))
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))

    def all_ok(self, ok: bool) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(ok)], dtype=torch.int32)  # gloo reduces CPU tensors
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def describe(self) -> str:
        if self.param_offload:
            return self._describe() + ", parameters, gradients and optimizer states in host memory"
        return self._describe()

    def _describe(self) -> str:
        if self.sp_size > 1:
            return (f"{self.world_size} FSDP2 ranks ({self.backend}): {self.world_size // self.sp_size} data-parallel x "
                    f"{self.sp_size} sequence-parallel (Ulysses)")
        return f"data-parallel over {self.world_size} FSDP2 ranks ({self.backend})"
