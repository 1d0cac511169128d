"""Stages 3 (speed) and 4 (memory) of the GPU check (bench/gpu_check.py).

Speed: GRPO steps of the real loop (`packrl.trainer.loop.train`, the HF engine, bf16) on a random
Qwen2.5-0.5B-shaped policy, 8 prompts x 4 responses of a 512-token prompt budget (prompts about
500 tokens: the arithmetic task with a long instruction, one token per character) and 1,024
response tokens (a random model rarely samples its eos, so most responses run to the budget).
Per step, from ``metrics.jsonl`` and the rollout dump: step time, generation tokens/s (response
tokens / ``timing_s/gen``), update tokens/s (prompt + response tokens / ``timing_s/update_actor``)
and update MFU: the update's FLOPs (`bench.gpu_setup.update_flops`, packrl's count and verl's)
over ``timing_s/update_actor``, against the spec peak and against the bf16 matmul rate stage 1
measured. The first step includes CUDA's warm-up; the figures are the last step's. Shared
prompts are off (``train.share_prompts=false``) so every sequence's FLOPs are computed in full,
as the count assumes.

Memory: `packrl.inspect.preflight.preflight`'s update-phase estimate (in-process, from the
config alone) against the peak measured over one update (`WorkerGroup.update` on a synthetic
batch of 4 sequences filling exactly one micro-batch: bench/bench_memory.py's method), where the
peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (``--cpu-smoke``:
the process's peak RSS, reset through /proc/self/clear_refs), for the 0.5B shape in full
fine-tuning, gradient checkpointing and LoRA (rank 16) at three micro-batch sizes; then, for a
1.5B shape (full) and a 7B shape (LoRA rank 16 + gradient checkpointing), the longest micro-batch
that fits the device (no out-of-memory error), found by bisection around preflight's
recommended ``train.max_tokens_per_microbatch`` (the budget column of ``preflight --table``).
"""

from __future__ import annotations

import gc
import json
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu_setup import (
    REWARD,
    model_config,
    model_folder,
    offline_tokenizer,
    progress,
    random_policy,
    register_hash_reward,
    scratch_dir,
    shape_name,
    synthetic_batch,
    update_flops,
)

GIB = 1 << 30
INSTRUCTION = ("Give the final answer after ####. Work through the problem one operation at a time, write each intermediate "
               "result on its own line, check every step before moving on, and keep the explanation short and plain. ")
"""The speed stage's prompts' instruction, cut to fill the prompt budget (no quotes: an override keeps them literally)."""
MEMORY_COMMON = ["algorithm.kl_coef=0", "train.mini_batch_size=null", "train.ppo_epochs=1", "data.val_files=[]"]
"""bench/bench_memory.py's overrides: no reference model, one optimizer step per update."""
VARIANTS = {"full": [], "gradient_checkpointing": ["model.gradient_checkpointing=true"],
            "lora": ["model.lora.rank=16", "model.lora.alpha=32"]}
MEMORY_TARGET = 0.10
"""preflight's estimate within 10% of the measured peak."""
MFU_TARGET = 0.10
"""Update MFU against the spec peak, packrl's FLOP count, at 0.5B."""


def run_speed(device: str, smoke: bool, save: Callable[..., None], peaks: dict[str, float | None], steps: int = 2) -> dict[str, Any]:
    """Stage 3 (module docstring). ``peaks``: ``spec`` and ``measured`` TFLOP/s (None when unknown)."""
    from packrl.config import load_config
    from packrl.config.plan import BatchPlan
    from packrl.distributed.local import local_group
    from packrl.models.model_config import ModelShape
    from packrl.trainer.loop import train

    register_hash_reward()
    config = model_config("0.5B", smoke)
    shape = ModelShape.from_config(config)
    prompt_budget, response_budget, prompts, n, budget = (64, 8, 2, 2, 512) if smoke else (512, 1024, 8, 4, 16384)
    dtype = "fp32" if smoke else "bf16"
    instruction = (INSTRUCTION * 4)[: prompt_budget - 48].strip()
    with scratch_dir("gpu-check-speed-") as tmp:
        overrides = [f"train.total_steps={steps}", f"data.batch_size={prompts}", f"rollout.n={n}", f"model.dtype={dtype}",
                     f"data.max_prompt_tokens={prompt_budget}", f"rollout.max_response_tokens={response_budget}",
                     f"data.instruction={instruction}", f"train.max_tokens_per_microbatch={budget}",
                     f"train.max_tokens_per_logprob_microbatch={2 * budget}", "algorithm.kl_coef=0.001", f"reward.name={REWARD}",
                     "data.val_files=[]", "train.loggers=[]", "train.dump_rollouts=true", "train.share_prompts=false"]
        save(model=shape_name("0.5B", smoke), num_params=shape.num_params, overrides=overrides)
        start = time.perf_counter()
        tokenizer = offline_tokenizer(config.vocab_size)
        path = model_folder(config, tokenizer, Path(tmp) / "model")
        cfg = load_config("demo", [f"model.path={path}", f"train.out_dir={tmp}/run", *overrides])
        policy = random_policy(config, cfg.model, tokenizer, device, BatchPlan.from_config(cfg).compute_dtype)
        workers = local_group(cfg, policy, tokenizer)
        build_s = time.perf_counter() - start
        run_dir = Path(tmp) / "run"
        record = lambda: _speed_steps(run_dir, shape, peaks)  # noqa: E731

        def on_step() -> None:
            done = record()
            save(build_s=round(build_s, 2), steps=done)
            progress(f"speed: step {done[-1]['step']} took {done[-1]['step_s']} s (generation {done[-1]['gen_s']} s)")

        progress(f"speed: policy and workers built in {build_s:.1f} s; training {steps} steps")
        with _Watch(run_dir / "metrics.jsonl", on_step):
            start = time.perf_counter()
            train(cfg, workers)
            train_s = time.perf_counter() - start
        measured = record()
    last = measured[-1]
    result = {"build_s": round(build_s, 2), "train_s": round(train_s, 2), "steps": measured, "measured_step": last["step"],
              "step_s": last["step_s"], "gen_tokens_per_s": last["gen_tokens_per_s"], "update_tokens_per_s": last["update_tokens_per_s"],
              "update_mfu": last["update_mfu"]}
    mfu = last["update_mfu"]["packrl_count_vs_spec"]
    met = None if mfu is None else mfu >= MFU_TARGET
    result["targets"] = {"update_mfu_vs_spec": {"value": mfu, "target": f">= {MFU_TARGET}", "met": met}}
    return result


def _speed_steps(run_dir: Path, shape: Any, peaks: dict[str, float | None]) -> list[dict[str, Any]]:
    """Each logged step's times and rates (module docstring)."""
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    out = []
    for m in lines:
        dump = run_dir / "rollouts" / f"step_{m['step']}.jsonl"
        rows = [json.loads(line) for line in dump.read_text().splitlines()]
        prompt, response = [r["prompt_tokens"] for r in rows], [r["response_tokens"] for r in rows]
        tokens = sum(prompt) + sum(response)
        flops = update_flops(shape, prompt, response)
        update_s, gen_s = m["timing_s/update_actor"], m["timing_s/gen"]
        mfu: dict[str, float | None] = {}
        for count in ("packrl", "verl"):
            achieved = getattr(flops, count) / update_s / 1e12
            mfu[f"{count}_count_tflops"] = _sig(achieved)
            for peak in ("spec", "measured"):
                value = peaks.get(peak)
                mfu[f"{count}_count_vs_{peak}"] = None if not value else _sig(achieved / value)
        out.append({"step": m["step"], "step_s": round(m["timing_s/step"], 3), "gen_s": round(gen_s, 3),
                    "ref_s": round(m["timing_s/ref"], 3), "update_s": round(update_s, 3), "num_sequences": len(rows),
                    "prompt_tokens_mean": sum(prompt) / len(rows), "response_tokens_mean": sum(response) / len(rows),
                    "response_tokens_total": sum(response), "update_tokens_total": tokens,
                    "gen_tokens_per_s": round(sum(response) / gen_s, 1), "update_tokens_per_s": round(tokens / update_s, 1),
                    "num_microbatches": m["seqlen/num_microbatches"], "update_gflop": {"packrl": _sig(flops.packrl / 1e9),
                                                                                        "verl": _sig(flops.verl / 1e9)},
                    "update_mfu": mfu, "finish_reason_length": m["response/finish_reason/length"]})
    return out


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (tiny CPU-smoke rates stay readable)."""
    return float(f"{x:.{digits}g}")


def dedupe(overrides: list[str]) -> list[str]:
    """``key=value`` overrides with each key once, its last value kept (later ones refine earlier ones)."""
    return list({o.split("=", 1)[0]: o for o in overrides}.values())


class _Watch:
    """Calls ``on_change()`` from a thread whenever ``path`` grows (a step was logged), and once
    more on exit: a stage cut short keeps the steps it finished."""

    def __init__(self, path: Path, on_change: Callable[[], None], interval_s: float = 1.0):
        self.path, self.on_change, self.interval_s = path, on_change, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _size(self) -> int:
        return self.path.stat().st_size if self.path.is_file() else 0

    def _loop(self) -> None:
        seen = 0
        while not self._stop.wait(self.interval_s):
            size = self._size()
            if size != seen:
                try:
                    self.on_change()
                    seen = size
                except (OSError, ValueError, KeyError):  # a line or a dump half written: read it again next time
                    pass

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self._size():
            self.on_change()


def run_memory(device: str, smoke: bool, save: Callable[..., None], deadline: float, device_memory_bytes: int | None) -> dict[str, Any]:
    """Stage 4 (module docstring). ``device_memory_bytes``: the device's memory (None under
    ``--cpu-smoke``, where the bisection's limit is preflight's own estimate at 384 tokens: that
    runs the search's code, but process RSS on a CPU says nothing about a device's limit). A
    variant or model that raises is recorded (``errors``, or its entry's ``error``) and the next
    one still runs."""
    peak = "peak RSS (VmHWM after /proc/self/clear_refs)" if smoke else "torch.cuda.max_memory_allocated"
    result: dict[str, Any] = {"peak_measure": peak, "estimate": "packrl.inspect.preflight.preflight(...).memory.phases['update']",
                              "device_memory_bytes": device_memory_bytes, "rows": [], "longest_microbatch": {}, "errors": {},
                              "leftover_allocated_bytes": {}}
    with scratch_dir("gpu-check-memory-") as tmp:
        for variant in VARIANTS:
            try:
                _estimate_rows(variant, smoke, device, Path(tmp), device_memory_bytes, result, save)
            except Exception as err:  # the next variant still runs
                result["errors"][f"0.5B {variant}"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
                save(**result)
        for name, extra in (("1.5B", []), ("7B", [*VARIANTS["lora"], *VARIANTS["gradient_checkpointing"]])):
            if time.time() > deadline - (5 if smoke else 45):
                result["longest_microbatch"][name] = {"ran": False, "reason": "the stage's time budget ran out before this model"}
                continue

            def keep(part: dict[str, Any], name: str = name) -> None:  # the search so far, saved after every probe
                result["longest_microbatch"][name] = part
                save(**result)

            try:
                keep(_longest(name, extra, smoke, device, Path(tmp), deadline, device_memory_bytes, keep))
            except Exception as err:
                keep(result["longest_microbatch"].get(name, {}) | {"error": f"{type(err).__name__}: {err}",
                                                                   "traceback": traceback.format_exc()})
    return result | {"targets": _memory_targets(result)}


def _estimate_rows(variant: str, smoke: bool, device: str, tmp: Path, device_memory_bytes: int | None, result: dict[str, Any],
                   save: Callable[..., None]) -> None:
    """The 0.5B rows of one variant: preflight's estimate and the measured peak at each micro-batch size."""
    lengths = (64, 128, 256) if smoke else (4096, 16384, 32768)
    policy = _Policy("0.5B", smoke, device, tmp, [*VARIANTS[variant], f"train.max_tokens_per_microbatch={max(lengths)}"])
    with policy:
        for tokens in lengths:
            estimate = policy.preflight(tokens, device_memory_bytes).memory.phases["update"]
            row = {"model": policy.name, "variant": variant, "tokens": tokens, "estimate_bytes": estimate}
            probe = policy.fits(tokens, device_memory_bytes or 1 << 62)
            if "out_of_memory" in probe:  # a row that did not fit is a result too (and no estimate is within 10% of it)
                row |= {"out_of_memory": probe["out_of_memory"], "estimate_over_measured": None, "within_10pct": False}
            else:
                ratio = estimate / probe["peak_bytes"]
                row |= {k: v for k, v in probe.items() if k not in ("tokens", "fits")}
                row |= {"estimate_over_measured": round(ratio, 4), "within_10pct": abs(ratio - 1) <= MEMORY_TARGET}
            result["rows"].append(row)
            progress(f"memory: {policy.name} {variant} {tokens} tokens: estimate/measured {row['estimate_over_measured']}")
            save(**result)
    result["leftover_allocated_bytes"][f"0.5B {variant}"] = policy.leftover_bytes


def _memory_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The two memory targets; a row, variant or model that did not measure counts as not met."""
    rows, longest = result["rows"], result["longest_microbatch"]
    return {
        "estimate_within_10pct": {"value": max((abs(r["estimate_over_measured"] - 1) for r in rows if r["estimate_over_measured"]),
                                               default=None),
                                  "target": f"|estimate / measured - 1| <= {MEMORY_TARGET} for every row (9 rows)",
                                  "met": len(rows) == 3 * len(VARIANTS) and all(r["within_10pct"] for r in rows)},
        "longest_within_one_step": {"value": {k: v.get("claim_minus_found_tokens") for k, v in longest.items()},
                                    "target": "|preflight's claim - longest found| <= one bisection step, search complete, 1.5B and 7B",
                                    "met": len(longest) == 2 and all(v.get("within_one_step") is True for v in longest.values())},
    }


class _Policy:
    """One random policy and its worker group (`packrl.distributed.local.local_group`) on the
    `demo` preset with `MEMORY_COMMON` and ``overrides``; ``model.path`` is a folder holding only
    its ``config.json`` and tokenizer, which preflight reads. Closing it frees the device."""

    def __init__(self, name: str, smoke: bool, device: str, tmp: Path, overrides: list[str]):
        self.name, self.smoke, self.device = shape_name(name, smoke), smoke, device
        self.config = model_config(name, smoke)
        self.tokenizer = offline_tokenizer(self.config.vocab_size)
        self.path = model_folder(self.config, self.tokenizer, tmp / f"model-{name}")
        self.leftover_bytes: int | None = None
        self.overrides = dedupe([f"model.path={self.path}", f"model.dtype={'fp32' if smoke else 'bf16'}", *MEMORY_COMMON, *overrides])

    def __enter__(self) -> _Policy:
        from packrl.config import load_config
        from packrl.config.plan import BatchPlan
        from packrl.distributed.local import local_group

        start = time.perf_counter()
        self.cfg = load_config("demo", self.overrides)
        self.model = random_policy(self.config, self.cfg.model, self.tokenizer, self.device, BatchPlan.from_config(self.cfg).compute_dtype)
        self.workers = local_group(self.cfg, self.model, self.tokenizer)
        self.build_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc: Any) -> None:
        self.workers.close()
        del self.workers, self.model
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            self.leftover_bytes = torch.cuda.memory_allocated()  # what the next model's measurements start above

    def preflight(self, tokens: int, memory_bytes: int | None) -> Any:
        """preflight's report for this run at ``tokens`` per update micro-batch, checked against ``memory_bytes``."""
        from packrl.inspect.preflight import preflight

        overrides = dedupe([*self.overrides, f"train.max_tokens_per_microbatch={tokens}"])
        report = preflight("demo", overrides, device_memory_gib=None if memory_bytes is None else memory_bytes / GIB,
                           device="cpu" if self.smoke else "cuda")
        if report.memory is None:
            raise RuntimeError(f"preflight gave no memory estimate: {'; '.join(map(str, report.problems))}")
        return report

    def measure(self, tokens: int) -> dict[str, Any]:
        """One update on a synthetic batch filling one micro-batch of ``tokens``; its peak memory."""
        batch = synthetic_batch(tokens, self.config.vocab_size)
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _status_bytes("VmRSS")
        start = time.perf_counter()
        metrics = self.workers.update(batch)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if metrics["seqlen/num_microbatches"] != 1:
            raise RuntimeError(f"the synthetic batch of {tokens} tokens took {metrics['seqlen/num_microbatches']} micro-batches, not 1")
        peak = torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")
        return {"peak_bytes": int(peak), "before_bytes": int(before), "update_s": round(seconds, 3)} | (
            {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved())} if cuda else {})

    def fits(self, tokens: int, limit_bytes: int) -> dict[str, Any]:
        """Whether an update of ``tokens`` fits: no out-of-memory error and a peak within ``limit_bytes``."""
        try:
            probe = self.measure(tokens)
        except torch.OutOfMemoryError as err:
            message = str(err).splitlines()[0]
            del err
            self.model.zero_grad(set_to_none=True)  # gradients of the failed backward
            gc.collect()
            torch.cuda.empty_cache()
            return {"tokens": tokens, "fits": False, "out_of_memory": message}
        return {"tokens": tokens, "fits": probe["peak_bytes"] <= limit_bytes, **probe}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _longest(name: str, overrides: list[str], smoke: bool, device: str, tmp: Path, deadline: float, device_memory_bytes: int | None,
             save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The longest micro-batch of ``name`` that fits, by bisection around preflight's claim."""
    hi_bound = 512 if smoke else 4 * 32768  # 4 sequences of at most the model context
    probe = _Policy(name, smoke, device, tmp, [*overrides, f"train.max_tokens_per_microbatch={hi_bound}"])
    with probe as policy:
        limit = device_memory_bytes if device_memory_bytes is not None else policy.preflight(384, None).memory.phases["update"]
        claim = policy.preflight(256, limit).recommended_tokens_per_microbatch or 0
        step = 128 if smoke else max(256, (claim // 32) // 256 * 256)
        out: dict[str, Any] = {"model": policy.name, "overrides": overrides, "build_s": round(policy.build_s, 2), "limit_bytes": limit,
                               "claim_tokens": claim, "step_tokens": step, "probes": []}
        save(out)
        found = _bisect(lambda t: policy.fits(t, limit), claim, step, hi_bound, deadline, out, save)
    out["leftover_allocated_bytes"] = policy.leftover_bytes
    lo, hi = found
    complete = hi is not None and hi - lo <= step
    return out | {"longest_found_tokens": lo, "first_failing_tokens": hi, "search_complete": complete,
                  "claim_minus_found_tokens": claim - lo, "within_one_step": complete and abs(claim - lo) <= step}


def _bisect(fits: Callable[[int], dict[str, Any]], claim: int, step: int, hi_bound: int, deadline: float, out: dict[str, Any],
            save: Callable[[dict[str, Any]], None]) -> tuple[int, int | None]:
    """``(lo, hi)``: ``lo`` the largest probed multiple of ``step`` that fits (0: none), ``hi`` the
    smallest that does not (None: none failed up to ``hi_bound``). Starts at ``claim``, brackets by
    doubling gaps, then halves; stops early (``out["stopped"]``) when the next probe would run
    past ``deadline``."""
    lo, hi, slowest = 0, None, 0.0

    def probe(tokens: int) -> bool | None:
        nonlocal slowest
        if time.time() + 2 * slowest > deadline:
            out["stopped"] = f"time budget: the next probe ({tokens} tokens) could run past the stage's end"
            return None
        start = time.perf_counter()
        result = fits(tokens)
        slowest = max(slowest, time.perf_counter() - start)
        out["probes"].append(result | {"probe_s": round(time.perf_counter() - start, 2)})
        progress(f"memory: {out.get('model', 'bisection')}: {tokens} tokens {'fit' if result['fits'] else 'did not fit'}")
        save(out)
        return result["fits"]

    tokens, gap = min(max(step, claim // step * step), hi_bound), step
    first = probe(tokens)
    if first is None:
        return lo, hi
    if first:
        lo = tokens
        while lo < hi_bound and hi is None:
            nxt = min(lo + gap, hi_bound)
            ok = probe(nxt)
            if ok is None:
                return lo, hi
            lo, hi = (nxt, hi) if ok else (lo, nxt)
            gap *= 2
    else:
        hi = tokens
        while hi > step and lo == 0:
            nxt = max(hi - gap, step)
            ok = probe(nxt)
            if ok is None:
                return lo, hi
            lo, hi = (nxt, hi) if ok else (lo, nxt)
            gap *= 2
    while hi is not None and hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        ok = probe(mid)
        if ok is None:
            break
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, hi
