"""One tiny run with every observability output on: trace.json, rollout dumps, bucketed and
mismatch metrics, the TensorBoard logger; and a run killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from packrl.diagnostics.buckets import length_buckets
from tests.builders import metric_lines
from tests.diagnostics.tiny_run import tiny_run

STAGES = {"gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"}
DUMP_KEYS = {
    "step": int, "index": int, "prompt_index": int, "sample_index": int, "row": int, "data_source": str, "prompt": str,
    "response": str, "prompt_tokens": int, "response_tokens": int, "finish_reason": str, "truncated": bool,
    "score": float, "reward": float, "advantage": float, "ground_truth": str, "prompt_truncated": bool,
}
ROOT = Path(__file__).resolve().parents[2]


def check_trace(data: dict) -> list[dict]:
    """Assert ``data`` is a Chrome trace-event JSON object of complete events; return the events."""
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    assert data.get("displayTimeUnit") in ("ms", "ns")
    for event in data["traceEvents"]:
        for key, kind in (("name", str), ("cat", str), ("ph", str), ("ts", (int, float)), ("dur", (int, float)),
                          ("pid", int), ("tid", int), ("args", dict)):
            assert isinstance(event.get(key), kind), (key, event)
        assert event["ph"] == "X" and event["ts"] >= 0 and event["dur"] >= 0, event
    return data["traceEvents"]


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    out = tmp_path_factory.mktemp("obs") / "run"
    overrides = ["train.total_steps=2", "train.dump_rollouts=true", "train.trace=true", "rollout.return_logprobs=true",
                 "algorithm.kl_coef=0.01", "algorithm.truncated=mask", "train.mini_batch_size=1",
                 "train.loggers=[console,tensorboard]" if _has_tensorboard() else "train.loggers=[console]"]
    run_dir, _ = tiny_run(out, smollm_tokenizer, overrides)
    return run_dir


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def test_trace_is_valid_and_micro_batches_nest_in_update(observed_run):
    events = check_trace(json.loads((observed_run / "trace.json").read_text()))
    metrics = [json.loads(line) for line in (observed_run / "metrics.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [e for e in events if e["args"].get("step") == step]
        stages = {e["name"]: e for e in mine if e["cat"] == "stage"}
        assert set(stages) == STAGES
        (whole,) = [e for e in mine if e["cat"] == "step"]
        update = stages["update_actor"]
        micro = [e for e in mine if e["cat"] == "microbatch"]
        assert micro and all(e["name"] == "microbatch" for e in micro)
        tol = 1e-2  # µs: rounding of ts and dur to ns
        for inner, outer in [(e, update) for e in micro] + [(e, whole) for e in stages.values()]:
            assert inner["ts"] >= outer["ts"] - tol and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + tol
        for e in stages.values():
            assert e["args"]["num_sequences"] == 6 and e["args"]["num_tokens"] > 0
        for e in micro:
            args = e["args"]
            assert 1 <= args["num_sequences"] <= 6 and 0 < args["num_tokens"] <= 150 and args["num_positions"] >= args["num_tokens"]
        # mini-batch of 1 prompt: 2 mini-batches, each planned on its own; every sequence with a loss token once (a
        # response cut under algorithm.truncated=mask has none and leaves the micro-batches, reported as left out)
        left_out = metrics[step - 1].get("seqlen/update_left_out_sequences", 0)
        assert sum(e["args"]["num_sequences"] for e in micro) == 6 - left_out
    assert not list(observed_run.glob(".trace.json*"))


def test_rollout_dump_rows(observed_run):
    metrics = metric_lines(observed_run)
    for step in (1, 2):
        rows = [json.loads(line) for line in (observed_run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 2 * 3  # data.batch_size * rollout.n
        for row in rows:
            assert set(row) == set(DUMP_KEYS)
            for key, kind in DUMP_KEYS.items():
                assert type(row[key]) is kind, (key, row[key])
            assert row["step"] == step and row["finish_reason"] in ("eos", "stop", "length", "context", "abort")
            assert row["truncated"] == (row["finish_reason"] in ("length", "context"))
            assert 0 < row["response_tokens"] <= 12
            if row["truncated"]:  # algorithm.truncated=mask: no loss tokens
                assert row["advantage"] == 0.0
        assert [r["index"] for r in rows] == list(range(6))
        assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(b, g) for b in range(2) for g in range(3)]
        line = metrics[step - 1]
        assert line["critic/score/mean"] == pytest.approx(sum(r["score"] for r in rows) / 6, abs=1e-6)
        assert line["response_length/mean"] == pytest.approx(sum(r["response_tokens"] for r in rows) / 6)
        truncated_tokens = sum(r["response_tokens"] for r in rows if r["truncated"])
        assert line["seqlen/masked_tokens/truncated"] == truncated_tokens


def test_bucket_and_mismatch_keys_inmetric_lines(observed_run):
    names = [f"{lo}-{hi}" for lo, hi in length_buckets(12)]
    for line in metric_lines(observed_run):
        buckets = {k for k in line if k.startswith("bucket/")}
        assert any(k.startswith("bucket/score/") for k in buckets)
        assert all(k.split("/")[2] in names and k.split("/")[1] in {"score", "kl", "entropy", "clipfrac", "advantage"} for k in buckets)
        for key in ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std"):
            assert 0.0 <= line[key] < 1e-3, key  # same fp32 weights generate and score
        assert any(k.startswith("training/rollout_probs_diff_mean/pos_") for k in line)


@pytest.mark.skipif(not _has_tensorboard(), reason="the tensorboard package is not installed (pip install 'packrl[tensorboard]')")
def test_tensorboard_logger_writes_events(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (observed_run / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert [s.step for s in acc.Scalars("critic/score/mean")] == [1, 2]


def test_killed_run_leaves_parseable_trace(tmp_path, smollm_tokenizer):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.diagnostics.tiny_run", str(out), "200"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (out / "trace.json").is_file():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no trace.json after 240 s"
            time.sleep(0.05)
        time.sleep(0.5)  # into a later step, maybe mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    events = check_trace(json.loads((out / "trace.json").read_text()))
    assert {e["name"] for e in events} >= STAGES | {"step", "microbatch"}
