"""A checkpoint write that fails on the writer rank fails every rank at once (gloo, 2 processes):
the writer raises its own error, the other rank a RuntimeError naming what was written, instead of
waiting in its next collective until the 30-minute collective timeout."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from packrl.worker.strategy import FSDP2, SingleProcess, write_on_writer


def _rank(rank: int, out_dir: str, fail: bool) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    strategy = FSDP2(rank, 2, True)

    def write() -> str:
        if fail:
            raise OSError(28, "No space left on device")
        return "written"

    try:
        outcome = {"result": write_on_writer(strategy, "checkpoint step_2 under /run", write)}
    except Exception as error:  # noqa: BLE001 - the test reads what each rank raised
        outcome = {"error": type(error).__name__, "message": str(error)}
    dist.barrier()  # both ranks are still in step after the failure
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(outcome, f)
    dist.destroy_process_group()


def _outcomes(tmp_path, fail: bool) -> list[dict]:
    mp.spawn(_rank, args=(str(tmp_path), fail), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_failed_write_on_the_writer_fails_the_other_rank_too(tmp_path):
    writer, other = _outcomes(tmp_path, fail=True)
    assert writer == {"error": "OSError", "message": "[Errno 28] No space left on device"}
    assert other["error"] == "RuntimeError" and "checkpoint step_2 under /run" in other["message"]


def test_a_write_that_succeeds_returns_on_the_writer_only(tmp_path):
    assert _outcomes(tmp_path, fail=False) == [{"result": "written"}, {"result": None}]


def test_one_process_writes_and_raises_its_own_error():
    assert write_on_writer(SingleProcess(), "x", lambda: 3) == 3
    with pytest.raises(OSError, match="^full$"):
        write_on_writer(SingleProcess(), "x", lambda: (_ for _ in ()).throw(OSError("full")))
