"""packrl's CUDA paths checked in one command on a bare GPU machine, stage by stage.

Five stages, in order, each writing ``OUT/<n>_<stage>.json`` as it goes (a run cut short keeps
what it measured) and recording its own failure, after which the next stage still runs:

1. ``device``: the GPU (name, memory, compute capability), torch, CUDA, cuDNN and NCCL versions,
   the packages packrl and its tests import, and a measured bf16 matmul rate (8192^3), beside
   the device's spec peak (`bench.gpu_setup.SPEC_BF16_TFLOPS`).
2. ``correctness``: packed vs padded vs alone log-probs on every packed-attention path the device
   runs, chunked vs full log-probs, a GRPO mini-batch's loss for three micro-batch splits, and
   the first step's KL to the reference exactly 0 (bench/gpu_correctness.py).
3. ``speed``: GRPO steps on a random Qwen2.5-0.5B-shaped policy at 512 + 1,024 tokens with the
   HF engine: step time, generation and update tokens/s, update MFU (bench/gpu_perf.py).
4. ``memory``: preflight's estimate against the measured peak (full, gradient checkpointing,
   LoRA at three micro-batch sizes), and the longest micro-batch that fits a 1.5B (full) and a
   7B (LoRA + gradient checkpointing) shape against preflight's claim (bench/gpu_perf.py).
5. ``pytest``: ``pytest -m gpu`` over tests/ (every CUDA-only test), its summary and each test's
   outcome (JUnit XML). Under ``--cpu-smoke`` only the files that hold a ``gpu`` mark are
   collected (the whole suite's collection alone takes ~25 s on 2 cores); their tests skip
   themselves without CUDA, and the stage records that.

Every stage has a time budget (`BUDGET_S`; the whole run at most `TOTAL_BUDGET_S`, 8 minutes on
one H100). On CUDA each stage runs in a process of its own (``--isolate``, the default there),
killed when its budget runs out, so a hang or a CUDA fault costs one stage, not the run; loops
(steps, bisection probes) also stop on their own before the budget ends.

Every stage JSON holds: ``stage``, ``index``, ``status`` (``running`` while it runs, then ``ok``,
``failed``, ``timeout`` or ``crashed``), ``error`` and ``traceback`` (None when ok), ``mode``
(``cuda`` or ``cpu-smoke``), ``budget_s``, ``wall_s``, ``started_at``, ``host`` and ``dtype``
(`bench.common.machine`), then the stage's own fields (docs/gpu.md lists them). ``OUT/summary.json``
(also printed) lists every stage's status, the correctness checks and the targets.

``--cpu-smoke`` runs every stage with tiny shapes on the CPU, single-threaded, in well under a
minute (in float32: the matmul rate too, recorded as such); the test suite runs it
(tests/bench/test_gpu_check.py).
``PACKRL_GPU_CHECK_FAIL=<stage>`` makes that stage raise after its work (the test's hook).

Commands (repository root)::

    python bench/gpu_check.py --out DIR                    # on the GPU machine (docs/gpu.md: the wheels first)
    python bench/gpu_check.py --cpu-smoke --out DIR        # anywhere
    python bench/gpu_check.py --out DIR --stages memory    # one stage again

Exit status: 0 when every stage ran to ``ok``, every correctness check passed and ``pytest -m gpu``
passed; 1 otherwise. The targets (update MFU, memory estimate, longest micro-batch) are reported
in the JSONs and the summary, not in the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import machine  # noqa: E402
from bench.gpu_setup import matmul_tflops, progress, spec_peak_tflops  # noqa: E402

STAGES = ("device", "correctness", "speed", "memory", "pytest")
BUDGET_S = {"device": 25, "correctness": 70, "speed": 140, "memory": 150, "pytest": 60}
"""Seconds per stage on the GPU; 445 in all, the rest of `TOTAL_BUDGET_S` for the processes' starts."""
SMOKE_BUDGET_S = 60
"""Seconds per stage under ``--cpu-smoke`` (each takes a few)."""
TOTAL_BUDGET_S = 480
FAIL_ENV = "PACKRL_GPU_CHECK_FAIL"
GRACE_S = 10
"""Seconds an isolated stage's process gets past its budget to record its end before it is killed."""
EXTRA_PACKAGES = ("hypothesis", "pillow", "psutil", "flash-attn", "vllm", "ray", "setuptools", "pip")
"""Packages the tests or optional paths import, reported beside packrl's dependencies."""


@dataclass(frozen=True)
class Context:
    """What a stage needs to know: where to write, the mode, the device and when it must end
    (``deadline``: seconds since the epoch)."""

    out: Path
    smoke: bool
    deadline: float
    budget_s: float
    speed_steps: int = 2

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"


class Record:
    """One stage's JSON, rewritten whole (temporary file, then rename) on every `save`."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, dict(data)

    def save(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def stage_path(out: Path, name: str) -> Path:
    return out / f"{STAGES.index(name) + 1}_{name}.json"


# --- the stages --------------------------------------------------------------------------------------


def stage_device(ctx: Context, rec: Record) -> None:
    """Stage 1: the device, the versions, the packages and the matmul rate."""
    import torch

    rec.save(python=platform.python_version(), torch=torch.__version__, cuda_runtime=torch.version.cuda, packages=_packages())
    name = None
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = props.name
        rec.save(device_name=name, total_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                 multiprocessors=props.multi_processor_count, bf16_supported=torch.cuda.is_bf16_supported(),
                 cudnn=_version_of(torch.backends.cudnn.version), nccl=_version_of(torch.cuda.nccl.version))
    dtype, size = ("fp32", 512) if ctx.smoke else ("bf16", 8192)
    rate = matmul_tflops(ctx.device, dtype, size, repeats=3 if ctx.smoke else 5)
    spec, source = spec_peak_tflops(name)
    rec.save(matmul={"dtype": dtype, "size": size, "measured_tflops": round(rate, 3), "spec_peak_tflops": spec, "spec_source": source,
                     "measured_over_spec": None if spec is None else round(rate / spec, 3),
                     "note": "float32 on the CPU (cpu-smoke): not a bf16 rate" if ctx.smoke else "bf16 tensor cores, best of 5 x 10"})


def _version_of(fn: Callable[[], Any]) -> str:
    """A library's version as text (NCCL's is a tuple or an int, by torch release), or why there is none."""
    try:
        version = fn()
    except Exception as err:  # a missing library is a fact to record, not the stage's failure
        return f"unavailable: {type(err).__name__}: {err}"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _packages() -> dict[str, Any]:
    """Installed versions (None: missing) of packrl's runtime dependencies (pyproject.toml) and `EXTRA_PACKAGES`."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in deps]

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    runtime = {n: version(n) for n in names}
    return {"runtime": runtime, "runtime_missing": [n for n, v in runtime.items() if v is None],
            "other": {n: version(n) for n in EXTRA_PACKAGES}}


def stage_correctness(ctx: Context, rec: Record) -> None:
    """Stage 2 (bench/gpu_correctness.py)."""
    from bench.gpu_correctness import run_correctness

    checks = run_correctness(ctx.device, ctx.smoke, rec.save)
    rec.save(passed=all(c["passed"] for c in checks.values()))


def _peaks(ctx: Context) -> dict[str, Any]:
    """The spec peak and the matmul rate of stage 1's JSON; the rate measured again when stage 1 left none."""
    path = stage_path(ctx.out, "device")
    matmul = json.loads(path.read_text()).get("matmul") if path.is_file() else None
    if matmul is None:
        import torch

        name = torch.cuda.get_device_name() if ctx.device == "cuda" else None
        dtype = "fp32" if ctx.smoke else "bf16"
        spec, _ = spec_peak_tflops(name)
        return {"spec": spec, "measured": matmul_tflops(ctx.device, dtype, 512 if ctx.smoke else 8192, 3), "source": "measured here"}
    return {"spec": matmul["spec_peak_tflops"], "measured": matmul["measured_tflops"], "source": f"{path.name} ({matmul['dtype']})"}


def stage_speed(ctx: Context, rec: Record) -> None:
    """Stage 3 (bench/gpu_perf.py)."""
    from bench.gpu_perf import run_speed

    peaks = _peaks(ctx)
    rec.save(peaks_tflops=peaks)
    rec.save(**run_speed(ctx.device, ctx.smoke, rec.save, peaks, steps=ctx.speed_steps))


def stage_memory(ctx: Context, rec: Record) -> None:
    """Stage 4 (bench/gpu_perf.py)."""
    from bench.gpu_perf import run_memory

    memory = None
    if ctx.device == "cuda":
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
    rec.save(**run_memory(ctx.device, ctx.smoke, rec.save, ctx.deadline, memory))


def stage_pytest(ctx: Context, rec: Record) -> None:
    """Stage 5: ``pytest -m gpu`` in a subprocess; its summary and every test's outcome."""
    targets = [str(p.relative_to(REPO)) for p in _gpu_test_files()] if ctx.smoke else ["tests"]
    junit = ctx.out / "5_pytest_junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *targets]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if k != FAIL_ENV} | {"PYTHONPATH": path}
    rec.save(command=" ".join(cmd[1:]), test_paths=targets,
             collected="the files with a gpu mark (cpu-smoke)" if ctx.smoke else "the whole suite")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(5.0, ctx.deadline - time.time()))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", summary)}
    tests = _junit_tests(junit)
    rec.save(returncode=proc.returncode, summary=summary, counts=counts, tests=tests, output_tail=(proc.stdout + proc.stderr)[-3000:],
             passed=proc.returncode == 0, all_skipped=bool(tests) and all(t["outcome"] == "skipped" for t in tests))


def _gpu_test_files() -> list[Path]:
    return sorted(p for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


def _junit_tests(path: Path) -> list[dict[str, Any]]:
    """Every test case of a JUnit XML report: its id, outcome and the reason of a skip or failure."""
    if not path.is_file():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", None
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                reason = (child.get("message") or "")[:500]
        out.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "reason": reason,
                    "seconds": float(case.get("time") or 0)})
    return out


RUNNERS: dict[str, Callable[[Context, Record], None]] = {
    "device": stage_device, "correctness": stage_correctness, "speed": stage_speed, "memory": stage_memory, "pytest": stage_pytest,
}


# --- running stages ----------------------------------------------------------------------------------


def _base(ctx: Context, name: str) -> dict[str, Any]:
    return {"stage": name, "index": STAGES.index(name) + 1, "status": "running", "error": None, "traceback": None,
            "mode": "cpu-smoke" if ctx.smoke else "cuda", "budget_s": round(ctx.budget_s, 1),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run_stage(ctx: Context, name: str) -> dict[str, Any]:
    """Run stage ``name`` in this process; its JSON ends ``ok`` or ``failed`` (with the error)."""
    start = time.perf_counter()
    rec = Record(stage_path(ctx.out, name), _base(ctx, name))
    rec.save(**machine("fp32" if ctx.smoke else "bf16", device=ctx.device if ctx.smoke else None))
    progress(f"stage {name} started, budget {ctx.budget_s:.0f} s")
    try:
        RUNNERS[name](ctx, rec)
        if os.environ.get(FAIL_ENV) == name:
            raise RuntimeError(f"failure injected by {FAIL_ENV}={name} after the stage's work (a test hook)")
        rec.save(status="ok")
    except Exception as err:  # the stage's failure is its result; the next stage still runs
        rec.save(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
    finally:
        rec.save(wall_s=round(time.perf_counter() - start, 2))
    return rec.data


def run_isolated(ctx: Context, name: str) -> dict[str, Any]:
    """Run stage ``name`` in a child process killed ``GRACE_S`` after ``ctx.deadline``; a child
    that ends without recording its end leaves its JSON ``timeout`` or ``crashed``."""
    path, log = stage_path(ctx.out, name), ctx.out / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(ctx.out), "--child", name, "--deadline", str(ctx.deadline),
           "--budget-s", str(ctx.budget_s), "--speed-steps", str(ctx.speed_steps), *(["--cpu-smoke"] if ctx.smoke else [])]
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})  # the log survives a kill
        try:
            rc: int | None = proc.wait(timeout=max(1.0, ctx.deadline - time.time()) + GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    data = json.loads(path.read_text()) if path.is_file() else _base(ctx, name)
    rec = Record(path, data)
    if data.get("status") in ("ok", "failed"):  # it recorded its end; a crash on the way out (CUDA teardown) changes nothing
        if rc != 0:
            rec.save(process_returncode=rc)
        return rec.data
    tail = log.read_text(errors="replace")[-3000:]
    if rc is None:
        rec.save(status="timeout", error=f"the stage ran past its budget ({data.get('budget_s')} s) and its process was killed; "
                 f"what it measured until then is above", log_tail=tail)
    else:
        rec.save(status="crashed", error=f"the stage's process exited with status {rc} before recording its end (log: {log})",
                 log_tail=tail)
    rec.save(wall_s=round(time.perf_counter() - start, 2))
    return rec.data


def summarize(out: Path, results: dict[str, dict[str, Any]], smoke: bool) -> dict[str, Any]:
    """``OUT/summary.json``: each stage's status, the correctness checks, the targets and the problems."""
    problems = [f"{name}: {r['status']}: {r.get('error')}" for name, r in results.items() if r["status"] != "ok"]
    checks = {k: v.get("passed") for k, v in results.get("correctness", {}).get("checks", {}).items()}
    problems += [f"correctness check {k} did not pass" for k, ok in checks.items() if not ok]
    pytest_result = results.get("pytest", {})
    if pytest_result.get("status") == "ok" and not pytest_result.get("passed"):
        problems.append(f"pytest -m gpu: {pytest_result.get('summary')}")
    targets = {f"{name}.{k}": v for name, r in results.items() for k, v in (r.get("targets") or {}).items()}
    summary = {"mode": "cpu-smoke" if smoke else "cuda", "stages": {n: {"status": r["status"], "wall_s": r.get("wall_s"),
                                                                       "error": r.get("error")} for n, r in results.items()},
               "correctness_checks": checks, "pytest": {k: pytest_result.get(k) for k in ("summary", "passed", "all_skipped")},
               "targets": targets, "problems": problems, "exit_status": 1 if problems else 0}
    Record(out / "summary.json", summary).save()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the stage JSONs (created)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="a subset, run in the check's order")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each stage in its own process (default: on CUDA yes, under --cpu-smoke no)")
    parser.add_argument("--speed-steps", type=int, default=2, help="GRPO steps of the speed stage (the first warms up)")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.speed_steps < 1:
        parser.error(f"--speed-steps {args.speed_steps} must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        import torch

        torch.set_num_threads(1)  # tiny shapes gain nothing from threads; on a busy CPU two contending threads ran 30x slower
    if args.child:
        run_stage(Context(args.out, args.cpu_smoke, args.deadline, args.budget_s, args.speed_steps), args.child)
        return 0
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            parser.error("torch sees no CUDA device here: run on the GPU machine, or add --cpu-smoke for the tiny CPU run")
    isolate = (not args.cpu_smoke) if args.isolate is None else args.isolate
    end = time.time() + (len(STAGES) * SMOKE_BUDGET_S if args.cpu_smoke else TOTAL_BUDGET_S)
    results = {}
    for name in [s for s in STAGES if s in args.stages]:
        deadline = min(time.time() + (SMOKE_BUDGET_S if args.cpu_smoke else BUDGET_S[name]), end)
        ctx = Context(args.out, args.cpu_smoke, deadline, deadline - time.time(), args.speed_steps)
        results[name] = (run_isolated if isolate else run_stage)(ctx, name)
        print(f"stage {name}: {results[name]['status']} in {results[name].get('wall_s')} s", file=sys.stderr, flush=True)
    summary = summarize(args.out, results, args.cpu_smoke)
    print(json.dumps(summary, indent=2, default=str))
    return summary["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
