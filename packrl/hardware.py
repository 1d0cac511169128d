"""What the machine computes natively, and the compute dtype packrl runs in (``model.dtype``).

bf16 halves the bytes of every activation and weight copy, and where the hardware multiplies
bf16 natively it is also faster: on 2 cores with AMX a 1024x576 @ 576x1536 matmul ran at 2,750
GFLOP/s in bf16 against 415 in float32. Where it does not, bf16 is emulated and far slower: on
an AVX2-only AMD EPYC host the same matmul ran at 1.3 GFLOP/s in bf16 against 63 in float32
(48x), and a demo step took 291 s against 20-31 s. ``model.dtype=auto`` (the default) therefore
resolves per machine (`resolve_dtype`):

=====================================  ======  ==============================================
device                                 auto    why
=====================================  ======  ==============================================
CUDA with bf16 (compute capability 8+) bf16    tensor cores multiply bf16
CUDA without bf16 (V100, T4)           fp32    fp16 would need loss scaling; never a default
CPU with AVX512_BF16 or AMX            bf16    native bf16 dot products (oneDNN)
any other CPU (AVX2, AVX-512 w/o BF16) fp32    bf16 is emulated: tens of times slower
=====================================  ======  ==============================================

A CPU counts as native only when its flags name AVX512_BF16 or AMX-BF16, torch dispatches at
least its AVX512 kernels (`torch.backends.cpu.get_cpu_capability`; ``ATEN_CPU_CAPABILITY`` can
lower it) and ``ONEDNN_MAX_CPU_ISA``, when set, does not cap oneDNN below AVX512_CORE_BF16.
An explicit ``bf16`` on a CPU without it runs, with one warning (`ComputeDtype.warning`).
``fp64`` (float64 parameters and compute) is never chosen by default: it is a numerical
reference, used to check that one layout (ranks, micro-batches, a resumed checkpoint) trains as
another independently of which kernels a CPU has.

This module imports torch only inside `probe_host`, so config commands stay light until they
need the machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

DtypeName = Literal["bf16", "fp32", "fp64"]
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names, best first
# torch.backends.cpu.get_cpu_capability() values under which bf16 kernels are not native
_NON_NATIVE_CAPABILITIES = frozenset({"DEFAULT", "NO AVX", "AVX2", "VSX", "Z VECTOR"})
# ONEDNN_MAX_CPU_ISA values that keep oneDNN below its bf16 instructions
_ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
BF16_SLOWDOWN = ("bf16 matmuls ran 48x slower than float32 on an AVX2-only CPU (1.3 vs 63 GFLOP/s, a 1024x576 @ 576x1536 "
                 "matmul) and a demo step took 291 s instead of 20-31 s")
DTYPE_BYTES = {"bf16": 2, "fp32": 4, "fp64": 8}
# the CPU flags worth recording (/proc/cpuinfo names, x86 and aarch64)
_RECORDED_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve", "sve2", "bf16", "i8mm"})


@dataclass(frozen=True)
class Host:
    """The machine a run computes on, as far as the compute dtype and benchmarks care.

    Attributes:
        device: ``cpu`` or ``cuda``.
        cpu_model: the CPU's model name (``/proc/cpuinfo``, else `platform.processor`).
        cpu_capability: torch's CPU kernel level (`torch.backends.cpu.get_cpu_capability`:
            ``AVX2``, ``AVX512``, ...).
        cpu_flags: the CPU's instruction-set flags that matter here (lower case, /proc/cpuinfo names).
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` when set, else None.
        num_threads: torch's intra-op threads.
        cuda_name: the CUDA device's name (None on the CPU).
        cuda_bf16: the CUDA device computes bf16 (`torch.cuda.is_bf16_supported`).
        assumed: the facts are assumed, not read off this machine (preflight for a GPU from a
            machine without one).
    """

    device: str
    cpu_model: str = ""
    cpu_capability: str = ""
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    onednn_max_isa: str | None = None
    num_threads: int = 1
    cuda_name: str | None = None
    cuda_bf16: bool = False
    assumed: bool = False

    @property
    def native_bf16_flag(self) -> str | None:
        """The flag that makes this CPU's bf16 native (``amx_bf16`` or ``avx512_bf16``), or None."""
        return next((f for f in NATIVE_BF16_FLAGS if f in self.cpu_flags), None)

    @property
    def native_bf16(self) -> bool:
        """Whether this device multiplies bf16 natively (see the module docstring)."""
        if self.device == "cuda":
            return self.cuda_bf16
        capped = (self.onednn_max_isa or "").upper() in _ONEDNN_BELOW_BF16
        return self.native_bf16_flag is not None and self.cpu_capability not in _NON_NATIVE_CAPABILITIES and not capped

    def cpu_level(self) -> str:
        """The CPU's vector level in words, e.g. ``AVX512 with AMX`` or ``AVX2``."""
        flag = self.native_bf16_flag
        extra = {"amx_bf16": " with AMX", "avx512_bf16": " with AVX512_BF16"}.get(flag or "", "")
        capped = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.cpu_capability or 'unknown'}{extra}{capped}"

    def bf16_gap(self) -> str:
        """Why this CPU's bf16 is not native, in words ("" when it is)."""
        if self.native_bf16:
            return ""
        flag = self.native_bf16_flag
        if flag is None:
            return f"this CPU has no native bf16 ({self.cpu_capability or 'unknown'}; no AVX512_BF16 or AMX)"
        name = {"amx_bf16": "AMX", "avx512_bf16": "AVX512_BF16"}[flag]
        limits = [f"torch runs its {self.cpu_capability} kernels"] if self.cpu_capability in _NON_NATIVE_CAPABILITIES else []
        limits += [f"ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}"] if (self.onednn_max_isa or "").upper() in _ONEDNN_BELOW_BF16 else []
        return f"this CPU has {name}, but bf16 is not native here ({' and '.join(limits)})"

    def describe(self) -> str:
        """One line: device, CPU model and level, threads."""
        cpu = f"{self.cpu_model or 'unknown CPU'} ({self.cpu_level()}), {self.num_threads} threads"
        if self.device == "cuda":
            return f"cuda: {self.cuda_name or 'a CUDA device'}{' (assumed)' if self.assumed else ''}; host CPU {cpu}"
        return f"cpu: {cpu}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (for benchmark output)."""
        out = asdict(self)
        out["cpu_flags"] = sorted(self.cpu_flags)
        out["native_bf16"] = self.native_bf16
        return out

    @classmethod
    def assumed_cuda(cls) -> Host:
        """A CUDA device with bf16 (Ampere or newer), for checks made on a machine without one."""
        return cls(device="cuda", cuda_name="a CUDA device with bf16 (Ampere or newer)", cuda_bf16=True, assumed=True)


def _cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); ("", {}) elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.lower().split()) & _RECORDED_FLAGS
    return model, flags


@functools.cache
def probe_host(device: str | None = None) -> Host:
    """Read this machine: CUDA if torch sees one (or ``device``), else the CPU.

    Args:
        device: ``cpu`` or ``cuda`` to describe that device of this machine; None = CUDA when
            available, else the CPU.
    """
    import torch

    model, flags = _cpu_info()
    if not flags:  # not Linux: torch's own cpuinfo answers the two questions that matter
        flags = frozenset(name for name, probe in (("amx_bf16", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
                          if getattr(torch.cpu, probe, lambda: False)())
    cuda = torch.cuda.is_available() if device in (None, "cuda") else False
    common: dict[str, Any] = dict(cpu_model=model or platform.processor(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                                  cpu_flags=flags, onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA"),
                                  num_threads=torch.get_num_threads())
    if cuda:
        return Host(device="cuda", cuda_name=torch.cuda.get_device_name(), cuda_bf16=torch.cuda.is_bf16_supported(), **common)
    if device == "cuda":
        return Host.assumed_cuda()
    return Host(device="cpu", **common)


@dataclass(frozen=True)
class ComputeDtype:
    """The compute dtype a run uses, and why.

    Attributes:
        name: ``bf16`` (forwards and generation under bf16 autocast, float32 parameters),
            ``fp32`` or ``fp64`` (parameters, optimizer states and compute in that dtype).
        requested: what ``model.dtype`` said (``auto``, ``bf16``, ``fp32``, ``fp64``).
        reason: why, in words (for ``auto``: the device's facts).
        warning: a warning to show once (an explicit ``bf16`` on a device without it), or None.
    """

    name: DtypeName
    requested: str
    reason: str
    warning: str | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return DTYPE_BYTES[self.name]

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters, gradients and optimizer states (float64 under
        ``fp64``, else float32)."""
        return 8 if self.name == "fp64" else 4

    @property
    def autocast(self) -> bool:
        """Forwards run under autocast (``bf16``); otherwise in the parameters' own dtype."""
        return self.name == "bf16"

    def torch_dtype(self) -> Any:
        """The torch dtype of the compute (``torch.bfloat16``, ``torch.float32``, ``torch.float64``)."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[self.name]

    def describe(self) -> str:
        """``compute dtype fp32 (model.dtype=auto: ...)``."""
        return f"compute dtype {self.name} (model.dtype={self.requested}: {self.reason})"


def resolve_dtype(requested: str, host: Host | None = None) -> ComputeDtype:
    """The compute dtype for ``model.dtype=requested`` on ``host`` (see the module docstring).

    Args:
        requested: ``auto``, ``bf16``, ``fp32`` or ``fp64``.
        host: the machine (`probe_host`); read from this machine when None and needed (``auto``
            and ``bf16`` ask it; ``fp32`` and ``fp64`` do not).

    Raises:
        ValueError: ``requested`` is not one of the four.
    """
    if requested in ("fp32", "fp64"):
        return ComputeDtype(requested, requested, "as set")  # type: ignore[arg-type]
    if requested not in ("auto", "bf16"):
        raise ValueError(f"model.dtype={requested!r} is not one of auto, bf16, fp32, fp64; set model.dtype=auto")
    host = host or probe_host()
    if host.device == "cuda":
        name = host.cuda_name or "the CUDA device"
        if host.native_bf16:
            return ComputeDtype("bf16", requested, f"{name} computes bf16 natively" if requested == "auto" else "as set")
        if requested == "auto":
            return ComputeDtype("fp32", requested, f"{name} has no bf16 (compute capability below 8.0); fp16 is never a default")
        return ComputeDtype("bf16", requested, "as set", f"model.dtype=bf16 on {name}, which has no native bf16: it runs emulated "
                            "and slowly; set model.dtype=auto (fp32 here) or model.dtype=fp32")
    if host.native_bf16:
        return ComputeDtype("bf16", requested, f"this CPU computes bf16 natively ({host.cpu_level()})" if requested == "auto"
                            else "as set")
    if requested == "auto":
        return ComputeDtype("fp32", requested, f"{host.bf16_gap()}: bf16 would run tens of times slower")
    return ComputeDtype("bf16", requested, "as set", f"model.dtype=bf16 where {host.bf16_gap()}: {BF16_SLOWDOWN}; set "
                        "model.dtype=auto (fp32 here) or model.dtype=fp32")


def resolve_for_device(requested: str, device: str) -> ComputeDtype:
    """`resolve_dtype` for a run on ``device`` (``cpu`` or ``cuda``): this machine's facts, or, for
    ``cuda`` on a machine without CUDA, those of a CUDA device with bf16 (`Host.assumed_cuda`)."""
    if requested in ("fp32", "fp64"):
        return resolve_dtype(requested)
    return resolve_dtype(requested, probe_host(device))


def host_record() -> dict[str, Any]:
    """This machine for a benchmark's JSON: `Host.to_dict` plus the torch version and what
    ``model.dtype=auto`` resolves to here."""
    import torch

    host = probe_host()
    choice = resolve_dtype("auto", host)
    return host.to_dict() | {"num_threads": torch.get_num_threads(), "torch": torch.__version__, "auto_dtype": choice.name,
                             "auto_dtype_reason": choice.reason}
