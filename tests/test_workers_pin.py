"""kvspec.fuzz.workers: one worker per core keeps to its core (its threads
and the processes it starts too); fewer workers than cores, or pin=False,
go where the OS puts them; a replacement takes its predecessor's core."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvspec.fuzz import workers
from kvspec.fuzz.workers import Task, WarmPool

HERE = "tests.test_workers_pin"
PRELOAD = ("kvspec.impl.dense",)
CORES = sorted(os.sched_getaffinity(0))


def where(hold: float = 0.3) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(pid, this process's cores, a child process's cores), after ``hold``
    seconds (so that the other worker takes the next task)."""
    time.sleep(hold)
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True).stdout
    return os.getpid(), tuple(sorted(os.sched_getaffinity(0))), tuple(eval(child))


def warm() -> None:
    """A preload step that evaluates an MLX array (MLX starts its threads)."""
    import mlx.core as mx

    mx.eval(mx.arange(4) + 1)


def threads_cores() -> list[tuple[int, ...]]:
    """The cores of every thread of this process (MLX's included)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        out.append(tuple(_cores(line.split(":", 1)[1].strip())))
    return out


def _cores(spec: str) -> list[int]:
    got = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        got += range(int(lo), int(hi or lo) + 1)
    return got


def leak() -> None:
    os.environ["KVSPEC_TEST_PIN_LEAK"] = "1"


def test_worker_cores_one_per_core_only(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1})
    assert workers.worker_cores(2) == [1, 3]
    assert workers.worker_cores(1) is None and workers.worker_cores(3) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert workers.worker_cores(1) is None


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_one_worker_per_core_keeps_to_it_and_so_do_its_children():
    n = len(CORES)
    with WarmPool(n, preload=PRELOAD) as pool:
        got = [r.value for r in pool.map([Task(f"{HERE}:where") for _ in range(2 * n)])]
    by_pid = {pid: (own, child) for pid, own, child in got}
    assert len(by_pid) == n
    assert sorted(own for own, _ in by_pid.values()) == [(c,) for c in CORES]
    assert all(own == child for own, child in by_pid.values())


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_a_replacement_keeps_to_the_core_its_predecessor_had():
    n = len(CORES)
    with WarmPool(n, preload=PRELOAD) as pool:
        first = [r.value for r in pool.map([Task(f"{HERE}:where") for _ in range(2 * n)])]
        leaked = pool.map([Task(f"{HERE}:leak")])[0]
        assert leaked.status == "leaked" and pool.started == n + 1
        later = [r.value for r in pool.map([Task(f"{HERE}:where") for _ in range(2 * n)])]
    assert sorted({own for _, own, _ in later}) == [(c,) for c in CORES]
    assert {pid for pid, _, _ in later} != {pid for pid, _, _ in first}


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_fewer_workers_or_pin_off_go_anywhere():
    with WarmPool(1, preload=PRELOAD) as pool:
        (r,) = pool.map([Task(f"{HERE}:where", (0.0,))])
    assert r.value[1] == tuple(CORES)
    with WarmPool(len(CORES), preload=PRELOAD, pin=False) as pool:
        got = pool.map([Task(f"{HERE}:where", (0.0,)) for _ in range(2)])
    assert all(g.value[1] == tuple(CORES) for g in got)


@pytest.mark.skipif(len(CORES) < 2 or not os.path.isdir("/proc/self/task"), reason="needs two cores and /proc")
def test_every_thread_of_a_worker_keeps_to_its_core_mlx_threads_included():
    n = len(CORES)
    with WarmPool(n, preload=(*PRELOAD, f"{HERE}:warm")) as pool:
        got = [r.value for r in pool.map([Task(f"{HERE}:threads_cores") for _ in range(n)])]
    assert all(len(threads) >= 2 for threads in got), got  # MLX's stream thread beside the worker's own
    assert all(len(set(threads)) == 1 and len(threads[0]) == 1 for threads in got), got
