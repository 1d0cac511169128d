"""The compute-dtype decision (`packrl.hardware.resolve_dtype`) over CPU capability strings, CPU
flags, oneDNN caps and CUDA devices, and how a run reports it."""

from __future__ import annotations

import pytest

from packrl.hardware import Host, probe_host, resolve_dtype, resolve_for_device

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX512 = frozenset({"avx2", "avx512f"})
AVX2 = frozenset({"avx2", "fma"})


def cpu(capability: str, flags: frozenset[str], onednn: str | None = None) -> Host:
    return Host(device="cpu", cpu_model="test CPU", cpu_capability=capability, cpu_flags=flags, onednn_max_isa=onednn)


@pytest.mark.parametrize(("host", "expected"), [
    (cpu("AVX512", AMX), "bf16"),                        # Sapphire Rapids and later
    (cpu("AVX512", AVX512_BF16), "bf16"),                # Cooper Lake, Zen 4
    (cpu("AVX512", AVX512), "fp32"),                     # Skylake-X, Ice Lake: AVX-512 without bf16
    (cpu("AVX2", AVX2), "fp32"),                         # most laptops, Zen 2/3 (the 48x case)
    (cpu("DEFAULT", frozenset()), "fp32"),
    (cpu("NO AVX", frozenset()), "fp32"),
    (cpu("SVE256", frozenset({"sve", "bf16"})), "fp32"),  # aarch64: bf16 speed not established, so not by default
    (cpu("AVX2", AMX), "fp32"),                          # ATEN_CPU_CAPABILITY=avx2 on an AMX CPU
    (cpu("AVX512", AMX, onednn="AVX2"), "fp32"),         # ONEDNN_MAX_CPU_ISA caps oneDNN below bf16
    (cpu("AVX512", AMX, onednn="AVX512_CORE_AMX"), "bf16"),
    (Host(device="cuda", cuda_name="H200", cuda_bf16=True), "bf16"),
    (Host(device="cuda", cuda_name="Tesla V100", cuda_bf16=False), "fp32"),  # never fp16 by default
])
def test_auto_is_bf16_only_where_the_device_computes_it_natively(host, expected):
    choice = resolve_dtype("auto", host)
    assert choice.name == expected and choice.requested == "auto" and choice.warning is None
    assert (expected == "bf16") == host.native_bf16
    if expected == "fp32" and host.device == "cpu":
        assert "bf16 would run tens of times slower" in choice.reason


def test_the_reason_names_what_the_cpu_has_and_lacks():
    assert resolve_dtype("auto", cpu("AVX2", AVX2)).reason.startswith("this CPU has no native bf16 (AVX2; no AVX512_BF16 or AMX)")
    assert "natively (AVX512 with AMX)" in resolve_dtype("auto", cpu("AVX512", AMX)).reason
    assert "has AMX, but bf16 is not native here (ONEDNN_MAX_CPU_ISA=AVX2)" in resolve_dtype("auto", cpu("AVX512", AMX, "AVX2")).reason
    assert "compute capability below 8.0" in resolve_dtype("auto", Host(device="cuda", cuda_name="T4")).reason


def test_an_explicit_bf16_runs_where_it_is_slow_with_one_warning_naming_the_cost_and_the_fix():
    slow = resolve_dtype("bf16", cpu("AVX2", AVX2))
    assert slow.name == "bf16" and slow.warning is not None
    assert "48x slower" in slow.warning and "1.3 vs 63 GFLOP/s" in slow.warning
    assert "set model.dtype=auto (fp32 here) or model.dtype=fp32" in slow.warning
    assert resolve_dtype("bf16", cpu("AVX512", AMX)).warning is None
    assert resolve_dtype("bf16", Host(device="cuda", cuda_name="T4")).warning is not None


def test_fp32_and_fp64_are_taken_as_set_without_reading_the_machine():
    for name in ("fp32", "fp64"):
        choice = resolve_dtype(name, Host(device="cpu"))
        assert (choice.name, choice.reason, choice.warning) == (name, "as set", None)
    assert resolve_dtype("fp64").param_bytes == 8 and resolve_dtype("fp32").param_bytes == 4
    with pytest.raises(ValueError, match="model.dtype='fp16' is not one of auto, bf16, fp32, fp64"):
        resolve_dtype("fp16")


def test_a_check_for_cuda_on_a_machine_without_one_assumes_a_bf16_gpu():
    choice = resolve_for_device("auto", "cuda")
    host = probe_host("cuda")
    assert choice.name == ("bf16" if host.native_bf16 else "fp32")
    if host.assumed:
        assert "Ampere or newer" in choice.reason


def test_this_machine_is_read_and_recorded():
    host = probe_host()
    assert host.device in ("cpu", "cuda") and host.num_threads >= 1 and host.cpu_capability
    record = host.to_dict()
    assert record["native_bf16"] == host.native_bf16 and isinstance(record["cpu_flags"], list)


def test_the_batch_plan_and_the_budgets_command_say_what_was_chosen_and_why():
    from packrl.config.plan import BatchPlan
    from packrl.config.schema import ModelConfig, RunConfig

    plan = BatchPlan.from_config(RunConfig(), host=cpu("AVX2", AVX2))
    assert plan.compute_dtype.name == "fp32"
    assert "compute dtype             fp32 (model.dtype=auto: this CPU has no native bf16 (AVX2" in plan.summary()
    warned = BatchPlan.from_config(RunConfig(model=ModelConfig(dtype="bf16")), host=cpu("AVX2", AVX2)).summary()
    assert "warning: model.dtype=bf16 where this CPU has no native bf16" in warned
