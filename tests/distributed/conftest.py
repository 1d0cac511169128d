"""Every test here stops the Ray it started: after each test no Ray process started by this pytest
process is left (orphans included) and no socket it opened still listens, except those of a
module's live local cluster (`tests.distributed.faults.LIVE_CLUSTERS`); after each module, none
at all.

This pytest process marks its environment (`OWNER`), which every process it starts inherits, so
Ray processes of other programs on the machine are never counted."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from tests.distributed.faults import LIVE_CLUSTERS, OWNER

os.environ[OWNER] = f"{os.getpid()}-{time.time_ns()}"
_RAY_BINARIES = ("raylet", "gcs_server")
_GONE_WITHIN_S = 30.0  # Ray's processes exit shortly after ray.shutdown / a cluster's shutdown


def _ours(proc: psutil.Process) -> bool:
    try:
        return proc.environ().get(OWNER) == os.environ[OWNER]
    except (psutil.Error, OSError):
        return False


def _is_ray(proc: psutil.Process) -> bool:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return False
    return name in _RAY_BINARIES or name.startswith("ray::") or "/ray/" in cmdline


def _ray_processes() -> set[int]:
    """Pids of the live Ray processes this pytest process started (its descendants or orphans)."""
    return {p.pid for p in psutil.process_iter() if p.pid != os.getpid() and _is_ray(p) and _ours(p)}


def _live_cluster_pids() -> set[int]:
    """The processes of the clusters alive now, with their descendants (workers of their raylets)."""
    pids: set[int] = set()
    for cluster in LIVE_CLUSTERS:
        for pid in cluster.pids():
            pids.add(pid)
            try:
                pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                continue
    return pids


def _listening(pids: set[int]) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` of the listening sockets of this process and ``pids``."""
    out: set[tuple[int, str, int]] = set()
    for pid in {os.getpid(), *pids}:
        try:
            out.update((pid, c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
                       if c.status == psutil.CONN_LISTEN)
        except (psutil.Error, OSError):
            continue
    return out


def _leftovers(before: set[int], sockets_before: set[tuple[int, str, int]]) -> tuple[set[int], set[tuple[int, str, int]]]:
    """New Ray processes and listening sockets (not the live clusters'), waited for up to `_GONE_WITHIN_S`."""
    deadline = time.monotonic() + _GONE_WITHIN_S
    while True:
        live = _live_cluster_pids()
        processes = _ray_processes() - before - live
        sockets = {s for s in _listening(processes | {os.getpid()}) if s not in sockets_before and s[0] not in live}
        if (not processes and not sockets) or time.monotonic() > deadline:
            return processes, sockets
        time.sleep(0.5)


def _describe(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} {psutil.Process(pid).name()}")
        except psutil.Error:
            out.append(f"{pid} (gone)")
    return out


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_after_the_module():
    before = _ray_processes()
    yield
    processes, sockets = _leftovers(before, _listening(set()))
    assert not processes, f"Ray processes left behind by this module: {_describe(processes)}"
    assert not sockets, f"sockets still listening after this module: {sorted(sockets)}"


@pytest.fixture(autouse=True)
def _no_ray_left_after_the_test():
    before = _ray_processes()
    sockets_before = _listening(before)
    yield
    processes, sockets = _leftovers(before, sockets_before)
    assert not processes, f"Ray processes left behind by this test: {_describe(processes)}"
    assert not sockets, f"sockets still listening after this test: {sorted(sockets)}"
