"""bench/gpu_check.py: the staged GPU check runs on the CPU with tiny shapes (``--cpu-smoke``),
writes every stage's JSON with its fields, records a stage's failure while the next stage still
runs, and runs a stage in a process of its own; its bisection and FLOP count on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gpu_check import FAIL_ENV, STAGES
from bench.gpu_perf import _bisect
from bench.gpu_setup import update_flops

ROOT = Path(__file__).resolve().parents[2]
COMMON = {"stage", "index", "status", "error", "traceback", "mode", "budget_s", "wall_s", "started_at", "host", "dtype"}
FIELDS = {
    "device": {"python", "torch", "cuda_runtime", "packages", "matmul"},
    "correctness": {"checks", "passed"},
    "speed": {"peaks_tflops", "model", "num_params", "overrides", "steps", "measured_step", "step_s", "gen_tokens_per_s",
              "update_tokens_per_s", "update_mfu", "targets"},
    "memory": {"peak_measure", "estimate", "rows", "longest_microbatch", "targets"},
    "pytest": {"command", "test_paths", "returncode", "summary", "counts", "tests", "passed", "all_skipped"},
}
CHECKS = {"packed_padded_alone", "chunked_vs_full", "microbatch_split", "first_step_kl"}


def _check(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out", str(out), *args], cwd=ROOT,
                          env=os.environ | (env or {}), capture_output=True, text=True, timeout=600)


def _stage(out: Path, name: str) -> dict:
    return json.loads((out / f"{STAGES.index(name) + 1}_{name}.json").read_text())


@pytest.mark.slow
def test_cpu_smoke_writes_every_stage_and_runs_on_past_a_failed_one(tmp_path):
    proc = _check(tmp_path, env={FAIL_ENV: "speed"})
    assert proc.returncode == 1, proc.stderr[-3000:]  # the injected failure is a problem
    for name, fields in FIELDS.items():
        data = _stage(tmp_path, name)
        assert COMMON | fields <= data.keys(), (name, (COMMON | fields) - data.keys())
        assert data["mode"] == "cpu-smoke" and data["stage"] == name
        assert data["status"] == ("failed" if name == "speed" else "ok"), (name, data["error"])
    speed = _stage(tmp_path, "speed")
    assert FAIL_ENV in speed["error"] and "RuntimeError" in speed["traceback"]
    assert [s["step"] for s in speed["steps"]] == [1, 2]  # measured before the failure, kept
    assert all(s["gen_tokens_per_s"] > 0 and s["update_tokens_per_s"] > 0 and s["update_gflop"]["packrl"] > 0 for s in speed["steps"])
    correctness = _stage(tmp_path, "correctness")
    assert set(correctness["checks"]) == CHECKS and correctness["passed"]
    assert {"varlen", "block_mask", "position_ids"} <= correctness["checks"]["packed_padded_alone"]["paths"].keys()
    assert correctness["checks"]["first_step_kl"]["kl_loss"][0] == 0.0
    memory = _stage(tmp_path, "memory")  # the stage after the failed one ran
    assert {(r["variant"], r["tokens"]) for r in memory["rows"]} == {(v, t) for v in ("full", "gradient_checkpointing", "lora")
                                                                     for t in (64, 128, 256)}
    assert all(r["peak_bytes"] > 0 and r["estimate_bytes"] > 0 for r in memory["rows"])
    for longest in memory["longest_microbatch"].values():
        assert longest["probes"] and longest["claim_tokens"] > 0 and "within_one_step" in longest
    pytest_stage = _stage(tmp_path, "pytest")
    assert pytest_stage["passed"] and pytest_stage["all_skipped"]  # the gpu tests skip themselves without CUDA
    assert pytest_stage["tests"] and all(t["reason"] for t in pytest_stage["tests"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_status"] == 1 and len(summary["problems"]) == 1 and summary["problems"][0].startswith("speed: failed")
    assert {"speed.update_mfu_vs_spec", "memory.estimate_within_10pct", "memory.longest_within_one_step"} <= summary["targets"].keys()


@pytest.mark.slow
def test_an_isolated_stage_runs_in_its_own_process(tmp_path):
    proc = _check(tmp_path, "--isolate", "--stages", "device")
    assert proc.returncode == 0, proc.stderr[-3000:]
    device = _stage(tmp_path, "device")
    assert device["status"] == "ok" and device["matmul"]["dtype"] == "fp32" and device["matmul"]["measured_tflops"] > 0
    assert (tmp_path / "logs" / "device.log").is_file()
    assert list(json.loads((tmp_path / "summary.json").read_text())["stages"]) == ["device"]


def test_bisection_finds_the_limit_from_either_side_of_the_claim():
    def fits(limit):
        return lambda tokens: {"tokens": tokens, "fits": tokens <= limit}

    for claim, limit in ((900, 1000), (1500, 1000), (100, 1000), (5000, 1000)):
        out = {"probes": []}
        lo, hi = _bisect(fits(limit), claim, 100, 4000, float("inf"), out, lambda part: None)
        assert (lo, hi) == (1000, 1100), (claim, lo, hi, out["probes"])
        assert [p["tokens"] for p in out["probes"]][0] == min(claim // 100 * 100, 4000)
    out = {"probes": []}
    assert _bisect(fits(10_000), 900, 100, 4000, float("inf"), out, lambda part: None) == (4000, None)  # nothing failed
    out = {"probes": []}
    assert _bisect(fits(1000), 900, 100, 4000, 0.0, out, lambda part: None) == (0, None) and "time budget" in out["stopped"]


def test_update_flops_counts_each_term():
    shape = SimpleNamespace(num_matmul_params=1000, num_heads=2, head_dim=4, num_layers=3, hidden_size=8, vocab_size=50)
    flops = update_flops(shape, [2, 3], [4, 1])  # sequences of 6 and 4 tokens, 5 response tokens
    attention = 6 * 3 * 8 * (36 + 16) / 2
    assert flops.packrl == 6 * 1000 * 10 + 6 * 8 * 50 * 5 + attention
    assert flops.verl == 6 * (1000 + 2 * 50 * 8) * 10 + 2 * attention
