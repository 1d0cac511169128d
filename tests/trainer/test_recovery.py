"""The supervisor of a run (`packrl.trainer.recovery.run_with_recovery`) without Ray: after a
`WorkerLost` it records the restart (restarts.jsonl, train/restarts) and runs a fresh attempt
resumed from the newest checkpoint, until ``trainer.max_restarts`` is spent; other errors pass
through untouched; the recovery keys are checked at load. The restart records have one writer
(`packrl.trainer.restarts.RestartLog`), and both recipes run their attempts through one block
(`packrl.trainer.recovery.run_attempts`). tests/distributed/test_recovery.py runs the same on a
real cluster with real faults."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from packrl.config import ConfigError, load_config
from packrl.distributed.health import ActorRecord, WorkerLost
from packrl.trainer.recovery import run_attempts, run_with_recovery
from packrl.trainer.restarts import RESTARTS_FILE, RestartLog, RestartRecord
from packrl.trainer.run import Run

RANKS = ["trainer.num_workers=2", "train.loggers=[]"]
RECORD = ActorRecord("rank 1", "packrl-rank1-ab12cd", "aa" * 16, "bb" * 28, "10.0.0.7", 4242)


def _lost(stage: str = "update") -> WorkerLost:
    return WorkerLost(RECORD, stage, "process_died", "The actor is dead because its worker process has died.")


def _checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "sampler": {}}))
    return path


def _lines(run_dir, name):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


def test_a_lost_actor_resumes_from_the_newest_checkpoint_and_is_recorded(tmp_path):
    cfg = load_config("demo", [*RANKS, f"train.out_dir={tmp_path}", "trainer.max_restarts=2", "trainer.restart_wait_s=5"])
    seen = []

    def attempt(resume):
        seen.append(resume)
        if len(seen) == 1:
            for step in (1, 2, 3):
                run.log_step(step, {"timing_s/step": 0.5})
            _checkpoint(tmp_path, 1)
            _checkpoint(tmp_path, 2)
            (tmp_path / "checkpoints" / ".tmp-step_3").mkdir()  # an interrupted write is never resumed from
            raise _lost()
        run.truncate_metrics(2)  # what the loop's resume does
        run.log_step(3, {"timing_s/step": 0.5})

    with Run(cfg) as run:
        run_with_recovery(cfg.trainer, cfg.train.resume, run, attempt)
    assert seen == [None, "auto"]
    (line,) = _lines(tmp_path, "restarts.jsonl")
    assert line["restart"] == 1 and line["resumed_from"] == str(tmp_path / "checkpoints" / "step_2")
    assert (line["resumed_step"], line["last_logged_step"], line["steps_redone"]) == (2, 3, 1)
    assert line["failed"] | {"cause": ""} == {"role": "rank 1", "actor_name": "packrl-rank1-ab12cd", "actor_id": "aa" * 16,
                                              "node_id": "bb" * 28, "node_ip": "10.0.0.7", "pid": 4242, "stage": "update",
                                              "step": 4, "kind": "process_died", "cause": ""}
    assert line["waited_s"] == 0.0, "a private local Ray starts afresh: nothing to wait for"
    assert line["startup_s"] is not None and line["seconds_lost"] == pytest.approx(
        line["work_lost_s"] + line["teardown_s"] + line["waited_s"] + line["startup_s"], abs=2e-3)
    assert [(m["step"], m["train/restarts"]) for m in _lines(tmp_path, "metrics.jsonl")] == [(1, 0.0), (2, 0.0), (3, 1.0)]


def test_without_a_checkpoint_the_run_starts_over_and_a_resume_path_is_kept(tmp_path):
    """No checkpoint in RUN_DIR: ``auto`` (the loop then starts at step 1, metrics emptied); a run
    started from ``train.resume=PATH`` elsewhere resumes from that path again."""
    for resume, expected in ((None, "auto"), (str(_checkpoint(tmp_path / "elsewhere", 5)), None)):
        out = tmp_path / f"run-{expected}"
        overrides = [f"train.resume={resume}"] if resume else []
        cfg = load_config("demo", [*RANKS, f"train.out_dir={out}", "trainer.max_restarts=1", *overrides])
        seen = []

        def attempt(resume, seen=seen):
            seen.append(resume)
            if len(seen) == 1:
                raise _lost("save_checkpoint")

        with Run(cfg) as run:
            run_with_recovery(cfg.trainer, cfg.train.resume, run, attempt)
        assert seen == [resume, expected or resume]
        (line,) = _lines(out, "restarts.jsonl")
        assert line["resumed_step"] == (0 if resume is None else 5) and line["failed"]["step"] == 0
        assert line["startup_s"] is None, "no step was logged after the restart"


def test_spent_restarts_end_the_run_naming_what_died_and_how_to_continue(tmp_path):
    for limit in (0, 1):
        out = tmp_path / str(limit)
        cfg = load_config("demo", [*RANKS, f"train.out_dir={out}", f"trainer.max_restarts={limit}"])
        calls = []

        def attempt(resume, calls=calls):
            calls.append(resume)
            raise _lost()

        with pytest.raises(WorkerLost) as failure, Run(cfg) as run:
            run_with_recovery(cfg.trainer, cfg.train.resume, run, attempt)
        note = " ".join(failure.value.__notes__)
        assert len(calls) == limit + 1
        assert ("trainer.max_restarts=0: no automatic restart" if limit == 0 else
                "after 1 restart(s), trainer.max_restarts=1 is spent") in note
        assert f"train.resume=auto train.out_dir={out}" in note
        assert "rank 1 (Ray actor packrl-rank1-ab12cd, pid 4242) on node bbbbbbbbbbbb (10.0.0.7)" in str(failure.value)
        assert len(_lines(out, "restarts.jsonl")) == limit if limit else not (out / "restarts.jsonl").exists()


def test_other_errors_are_never_restarted(tmp_path):
    cfg = load_config("demo", [*RANKS, f"train.out_dir={tmp_path}", "trainer.max_restarts=3"])
    calls = []

    def attempt(resume):
        calls.append(resume)
        raise ValueError("data.train_files: no usable prompt")

    with pytest.raises(ValueError, match="no usable prompt"), Run(cfg) as run:
        run_with_recovery(cfg.trainer, cfg.train.resume, run, attempt)
    assert len(calls) == 1 and not (tmp_path / "restarts.jsonl").exists()


@pytest.mark.parametrize("overrides, key, fix", [
    (["trainer.num_workers=2", "trainer.max_restarts=-1"], "trainer.max_restarts=-1", "set trainer.max_restarts=0"),
    (["trainer.num_workers=2", "trainer.restart_wait_s=30"], "trainer.restart_wait_s=30.0", "set trainer.max_restarts to a positive"),
    (["trainer.num_workers=2", "trainer.max_restarts=1", "trainer.restart_wait_s=-1"], "trainer.restart_wait_s=-1.0",
     "set trainer.restart_wait_s=60"),
    (["trainer.max_restarts=2"], "trainer.max_restarts=2", "trainer.rollout_mode=separate_async"),
    (["trainer.placement=spread"], "trainer.placement='spread'", "set trainer.num_workers > 1"),
    (["trainer.num_workers=2", "trainer.collective_timeout_s=0"], "trainer.collective_timeout_s=0.0",
     "set trainer.collective_timeout_s=600"),
])
def test_recovery_keys_are_refused_with_the_key_and_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as refused:
        load_config("demo", overrides)
    assert key in str(refused.value) and fix in str(refused.value)


def test_recovery_keys_that_have_an_effect_load():
    cfg = load_config("demo", ["trainer.num_workers=2", "trainer.max_restarts=3", "trainer.restart_wait_s=120",
                               "trainer.placement=spread", "trainer.collective_timeout_s=300"])
    assert (cfg.trainer.max_restarts, cfg.trainer.restart_wait_s, cfg.trainer.placement) == (3, 120.0, "spread")
    separate = load_config("demo", ["trainer.rollout_mode=separate_async", "trainer.max_restarts=1"])
    assert separate.trainer.max_restarts == 1


KEYS = ["restart", "detected_at", "failed", "resumed_from", "resumed_step", "last_logged_step", "steps_redone", "work_lost_s",
        "teardown_s", "waited_s", "startup_s", "seconds_lost"]
"""The keys of a restarts.jsonl line, in order, as docs/distributed.md lists them and bench/bench_faults.py reads them."""


def _record(number: int) -> RestartRecord:
    return RestartRecord(restart=number, detected_at="2025-01-01T00:00:00.000Z", failed={"role": "rank 1"}, resumed_from=None,
                         resumed_step=0, last_logged_step=3, steps_redone=3, work_lost_s=1.5, teardown_s=0.25, waited_s=2.0)


def test_the_restart_log_writes_each_record_at_once_and_completes_it_at_the_next_step(tmp_path):
    """A record is a line as soon as it is added (start-up unknown); the first step that began
    after the restart fills in ``startup_s`` and ``seconds_lost``; later steps change nothing. An
    earlier process's lines are kept as they were, even one with the same restart number."""
    path = tmp_path / RESTARTS_FILE
    earlier = '{"restart": 1, "note": "an earlier process, kept as written"}'
    path.write_text(earlier + "\n\n")
    log = RestartLog(path)
    assert len(log) == 1
    log.step_began(100.0)  # no restart waits for a step: the file is not touched
    assert path.read_text() == earlier + "\n\n"
    log.add(_record(1), relaunched_at=100.0)
    assert len(log) == 2
    first, line = path.read_text().split("\n\n")[0], _lines(tmp_path, RESTARTS_FILE)[1]
    assert first == earlier and list(line) == KEYS and (line["startup_s"], line["seconds_lost"]) == (None, None)
    log.step_began(104.0004)
    (kept, line) = _lines(tmp_path, RESTARTS_FILE)
    assert kept == json.loads(earlier)
    assert line | {"startup_s": 0, "seconds_lost": 0} == _record(1).to_json() | {"startup_s": 0, "seconds_lost": 0}
    assert (line["startup_s"], line["seconds_lost"]) == (4.0, 7.75)  # 1.5 + 0.25 + 2.0 + 4.0
    log.step_began(200.0)
    assert _lines(tmp_path, RESTARTS_FILE)[1]["startup_s"] == 4.0, "only the first step after the restart completes it"
    assert len(RestartLog(path)) == 2, "a later process counts both lines"


def test_a_start_before_the_restart_counts_as_no_startup():
    assert _record(1).started(-0.5).startup_s == 0.0 and _record(1).started(-0.5).seconds_lost == 3.75


def test_both_recipes_run_their_attempts_through_one_block(tmp_path, caplog):
    """`run_attempts`: each attempt gets the config with the ``train.resume`` it resumes from, logs
    the compute dtype's warning, notes model.txt, and runs the recipe's steps; a lost actor is
    recorded and a fresh attempt resumes."""
    import packrl.trainer.loop as loop
    import packrl.trainer.sft as sft

    assert loop.run_attempts is run_attempts and sft.run_attempts is run_attempts
    cfg = load_config("demo", [*RANKS, f"train.out_dir={tmp_path}", "trainer.max_restarts=1"])
    group = SimpleNamespace(plan=SimpleNamespace(compute_dtype=SimpleNamespace(warning="bf16 emulated here")),
                            model_summary="policy: 1 parameter")
    seen = []

    def steps(current, workers):
        seen.append((current.train.resume, workers))
        assert (tmp_path / "model.txt").read_text() == "policy: 1 parameter\n"
        if len(seen) == 1:
            run.log_step(1, {"timing_s/step": 0.5})
            raise _lost()
        run.log_step(1, {"timing_s/step": 0.5})

    with caplog.at_level(logging.WARNING, logger="packrl.trainer.recovery"), Run(cfg) as run:
        run_attempts(cfg, run, steps, workers=group)
    assert seen == [(None, group), ("auto", group)]
    assert [r.getMessage() for r in caplog.records].count("bf16 emulated here") == 2
    (line,) = _lines(tmp_path, RESTARTS_FILE)
    assert line["restart"] == 1 and line["startup_s"] is not None
