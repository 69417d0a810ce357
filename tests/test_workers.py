"""kvspec.fuzz.workers.WarmPool: warm processes that run tasks one after another,
heaviest first, with a wall-clock hang guard, dead workers reported and
replaced, CPU seconds per task, and the isolation guard (a task that leaves
a monkeypatch or an environment variable behind is caught and its worker
replaced, so the next task never sees it)."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest

from kvspec.fuzz import workers
from kvspec.fuzz.workers import Task, WarmPool

HERE = "tests.test_workers"
#: a small preload: the tests need impl and the guard, not the whole harness
PRELOAD = ("kvspec.impl.dense",)


# -- tasks (run in the workers) ------------------------------------------------------
def pid() -> int:
    return os.getpid()


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def spin(seconds: float) -> int:
    end, n = time.process_time() + seconds, 0
    while time.process_time() < end:
        n += 1
    return n


def boom() -> None:
    raise ValueError("boom in the task")


def die(code: int) -> None:
    os._exit(code)


def patch_impl() -> str:
    """Leaks: replaces a method of an impl class and never restores it."""
    from kvspec.impl.dense import KVCache

    KVCache.trim = lambda self, n: 0  # type: ignore[method-assign]
    return "patched"


def trim_is_original() -> bool:
    from kvspec.impl.dense import KVCache

    return KVCache.trim.__qualname__ == "KVCache.trim"


def set_env() -> None:
    os.environ["KVSPEC_LEAKED_BY_A_TASK"] = "1"


def env_is_clean() -> bool:
    return "KVSPEC_LEAKED_BY_A_TASK" not in os.environ


def patch_and_restore() -> str:
    from kvspec.impl.dense import KVCache

    saved = KVCache.trim
    KVCache.trim = lambda self, n: 0  # type: ignore[method-assign]
    KVCache.trim = saved  # type: ignore[method-assign]
    os.environ["KVSPEC_LEAKED_BY_A_TASK"] = "1"
    del os.environ["KVSPEC_LEAKED_BY_A_TASK"]
    return "restored"


def preset_env() -> None:
    """A preload entry: an environment variable set before the first task."""
    os.environ["KVSPEC_SET_BEFORE_THE_POOL"] = "1"


def del_env() -> None:
    del os.environ["KVSPEC_SET_BEFORE_THE_POOL"]


def env_is_intact() -> bool:
    return os.environ.get("KVSPEC_SET_BEFORE_THE_POOL") == "1"


def del_class_attr() -> None:
    """Leaks: deletes a method of an impl class (its base class's, if any,
    answers from then on)."""
    from kvspec.impl.dense import KVCache

    del KVCache.trim


def trim_is_defined() -> bool:
    from kvspec.impl.dense import KVCache

    return "trim" in vars(KVCache)


def pop_kind() -> None:
    """Leaks: removes a kind from the registry in place (the dict is the same object)."""
    from kvspec.fuzz.kinds import KINDS

    KINDS.pop(next(iter(KINDS)))


def kinds_are_whole() -> bool:
    from kvspec.fuzz.kinds import KINDS

    return len(KINDS) == KINDS_AT_IMPORT


def _kinds_at_import() -> int:
    from kvspec.fuzz.kinds import KINDS

    return len(KINDS)


KINDS_AT_IMPORT = _kinds_at_import()

LEAK_DIR = "/"
LEAK_PATH = "/kvspec-leaked-by-a-task"
LEAK_PROFILE = "kvspec-leaked-by-a-task"
LEAK_DEVICE = "Device(cpu, 1)"


def leak_cwd() -> None:
    os.chdir(LEAK_DIR)


def cwd_is_clean() -> bool:
    return os.getcwd() != LEAK_DIR


def leak_sys_path() -> None:
    sys.path.append(LEAK_PATH)


def sys_path_is_clean() -> bool:
    return LEAK_PATH not in sys.path


def leak_profile() -> None:
    from hypothesis import settings

    settings.register_profile(LEAK_PROFILE, max_examples=3)
    settings.load_profile(LEAK_PROFILE)


def profile_is_clean() -> bool:
    from hypothesis import settings

    return settings._current_profile != LEAK_PROFILE and settings.default.max_examples != 3


def leak_gc_freeze() -> None:
    gc.freeze()


def gc_is_unfrozen() -> bool:
    return gc.get_freeze_count() == 0


def leak_device() -> None:
    import mlx.core as mx

    mx.set_default_device(mx.Device(mx.cpu, 1))  # neither a GPU machine's default nor a CPU one's


def device_is_clean() -> bool:
    import mlx.core as mx

    return str(mx.default_device()) != LEAK_DEVICE


def import_new_module() -> bool:
    import kvspec.fuzz.render  # noqa: F401 - a first import is no leak

    return True


# -- the tests -----------------------------------------------------------------------
def test_tasks_run_warm_heaviest_first_and_come_back_with_their_index():
    tasks = [Task(f"{HERE}:pid", weight=1), Task(f"{HERE}:pid", weight=3), Task(f"{HERE}:pid", weight=2),
             Task(f"{HERE}:sleep", (0.0,), weight=2)]
    with WarmPool(1, preload=PRELOAD) as pool:
        results = list(pool.run(tasks))
        again = pool.map([Task(f"{HERE}:pid")])
    assert [r.index for r in results] == [1, 2, 3, 0]  # weight 3, then 2 in list order, then 1
    assert all(r.ok and r.error is None and r.leaked is None for r in results)
    # one warm process ran all of them, and the next run too
    assert len({r.value for r in results if r.index != 3} | {again[0].value}) == 1 and pool.started == 1
    assert [r.index for r in workers.in_order(results, 4)] == [0, 1, 2, 3]


def test_cpu_seconds_count_work_not_waiting():
    with WarmPool(2, preload=PRELOAD) as pool:
        spun, slept = pool.map([Task(f"{HERE}:spin", (0.6,)), Task(f"{HERE}:sleep", (0.6,))])
    assert spun.ok and slept.ok
    assert spun.cpu >= 0.5, spun
    assert slept.cpu < 0.2 and slept.seconds >= 0.6, slept


def test_a_task_that_raises_is_an_error_result_with_its_traceback():
    with WarmPool(1, preload=PRELOAD) as pool:
        bad, good = pool.map([Task(f"{HERE}:boom"), Task(f"{HERE}:pid")])
    assert bad.status == "error" and not bad.ok and "ValueError: boom in the task" in bad.error
    assert good.ok and pool.started == 1  # an exception does not cost the worker


def test_a_hung_task_is_stopped_by_name_and_the_pool_goes_on():
    tasks = [Task(f"{HERE}:sleep", (600,), limit=2.0, weight=9, name="hangs"),
             Task(f"{HERE}:pid", weight=1), Task(f"{HERE}:pid", weight=1)]
    start = time.perf_counter()
    with WarmPool(1, preload=PRELOAD) as pool:
        hung, after, later = pool.map(tasks)
    assert time.perf_counter() - start < 60
    assert hung.status == "stopped" and "'hangs'" in hung.error and "wall-clock limit of 2 s" in hung.error
    assert 2.0 <= hung.seconds < 30
    assert after.ok and later.ok and pool.started == 2 and "stopped 'hangs'" in pool.replaced[0]


def test_limit_of_overrides_the_tasks_own_limit():
    with WarmPool(1, preload=PRELOAD) as pool:
        (r,) = pool.map([Task(f"{HERE}:sleep", (600,), limit=None)], limit_of=lambda t: 1.0)
    assert r.status == "stopped"


def test_a_worker_that_dies_is_reported_and_replaced():
    with WarmPool(1, preload=PRELOAD) as pool:
        died, after = pool.map([Task(f"{HERE}:die", (3,), weight=2, name="dies"), Task(f"{HERE}:pid")])
    assert died.status == "died" and "'dies'" in died.error and "exit code 3" in died.error
    assert after.ok and pool.started == 2


@pytest.mark.parametrize("leak, probe, name", [
    ("patch_impl", "trim_is_original", "kvspec.impl.dense.KVCache.trim"),
    ("set_env", "env_is_clean", "os.environ[KVSPEC_LEAKED_BY_A_TASK]"),
    # what a task deletes is a change too: an environment variable set
    # before the first task, a class attribute
    ("del_env", "env_is_intact", "os.environ[KVSPEC_SET_BEFORE_THE_POOL]"),
    ("del_class_attr", "trim_is_defined", "kvspec.impl.dense.KVCache.trim"),
    # a module-level container changed in place (the same dict object)
    ("pop_kind", "kinds_are_whole", "kvspec.fuzz.kinds.KINDS"),
    # every entry of the fingerprint the module's doc promises beyond the
    # modules and the environment
    ("leak_cwd", "cwd_is_clean", "os.getcwd()"),
    ("leak_sys_path", "sys_path_is_clean", "sys.path"),
    ("leak_profile", "profile_is_clean", "hypothesis settings profile"),
    ("leak_gc_freeze", "gc_is_unfrozen", "gc.get_freeze_count()"),
    ("leak_device", "device_is_clean", "mlx default device"),
])
def test_a_leaking_task_is_caught_and_the_next_task_never_sees_the_leak(leak, probe, name):
    tasks = [Task(f"{HERE}:{leak}", weight=2), Task(f"{HERE}:{probe}", weight=1)]
    preload = (*PRELOAD, "kvspec.fuzz.kinds", "mlx.core", "hypothesis", f"{HERE}:preset_env")
    with WarmPool(1, preload=preload) as pool:
        leaked, after = pool.map(tasks)
    assert leaked.status == "leaked" and not leaked.ok and name in (leaked.leaked or "").split(", "), leaked
    assert after.ok and after.value is True and after.leaked is None, after
    assert pool.started == 2 and name in pool.replaced[0]
    # the control: without the guard the same worker runs the next task, and
    # it sees the leak (what the guard is there for)
    with WarmPool(1, preload=preload, guard=False) as pool:
        leaked, after = pool.map(tasks)
    assert leaked.ok and after.ok and after.value is False and pool.started == 1


def test_what_is_restored_or_first_imported_is_no_leak():
    with WarmPool(1, preload=PRELOAD) as pool:
        results = pool.map([Task(f"{HERE}:patch_and_restore", weight=3), Task(f"{HERE}:import_new_module", weight=2),
                            Task(f"{HERE}:pid")])
    assert [r.status for r in results] == ["ok", "ok", "ok"] and pool.started == 1


def test_the_fingerprint_sees_a_changed_class_attribute_and_a_new_module_global():
    import kvspec.impl.dense

    before = workers.fingerprint(modules=["kvspec.impl.dense"])
    saved = kvspec.impl.dense.KVCache.trim
    try:
        kvspec.impl.dense.KVCache.trim = lambda self, n: 0
        kvspec.impl.dense._a_new_global = 1  # type: ignore[attr-defined]
        got = workers.changed(before, workers.fingerprint(modules=["kvspec.impl.dense"]))
    finally:
        kvspec.impl.dense.KVCache.trim = saved
        del kvspec.impl.dense._a_new_global  # type: ignore[attr-defined]
    assert got == ["kvspec.impl.dense.KVCache.trim", "kvspec.impl.dense._a_new_global"]
    assert workers.changed(before, workers.fingerprint(modules=["kvspec.impl.dense"])) == []


def test_a_preload_that_fails_stops_the_run():
    with pytest.raises(workers.WorkerStartError, match="kvspec.fuzz.no_such_module"), \
            WarmPool(1, preload=("kvspec.fuzz.no_such_module",)) as pool:
        pool.map([Task(f"{HERE}:pid")])


def test_a_third_party_module_not_installed_is_left_out_of_the_preload():
    # Z3 is missing on a GPU machine without the extras: the proof jobs say
    # so themselves; the workers still start and run everything else
    with WarmPool(1, preload=(*PRELOAD, "no_such_third_party_module")) as pool:
        (r,) = pool.map([Task(f"{HERE}:pid")])
    assert r.ok


def test_a_caller_that_stops_early_leaves_the_pool_usable():
    with WarmPool(2, preload=PRELOAD) as pool:
        # the first task runs 3 s: by then the second worker has started the sleeper
        it = pool.run([Task(f"{HERE}:sleep", (3,), weight=2), Task(f"{HERE}:sleep", (600,), weight=1)])
        first = next(it)
        assert first.index == 0
        it.close()  # the sleeping task is abandoned: its worker killed and replaced
        (again,) = pool.map([Task(f"{HERE}:pid")])
    assert first.ok and again.ok and pool.started == 3


def test_the_limit_counts_from_the_tasks_own_start():
    # one worker, three tasks of 1.2 s under a 2.5 s limit: the last starts
    # 2.4 s into the run and must not be stopped (a limit counted from the
    # run's start, or from when it was queued, would stop it)
    tasks = [Task(f"{HERE}:sleep", (1.2,), limit=2.5) for _ in range(3)]
    with WarmPool(1, preload=PRELOAD) as pool:
        results = pool.map(tasks)
    assert [r.status for r in results] == ["ok", "ok", "ok"] and pool.started == 1


def test_a_stopped_task_is_reported_under_its_own_index():
    # two workers: the hung task goes out first, a quick one after it; the
    # quick one's result comes back first and must stay its own
    tasks = [Task(f"{HERE}:sleep", (600,), limit=2.0, weight=9, name="hangs"), Task(f"{HERE}:pid", weight=1)]
    with WarmPool(2, preload=PRELOAD) as pool:
        results = list(pool.run(tasks))
    assert sorted(r.index for r in results) == [0, 1]
    hung, quick = workers.in_order(results, 2)
    assert hung.index == 0 and hung.status == "stopped" and "'hangs'" in hung.error
    assert quick.index == 1 and quick.ok and isinstance(quick.value, int) and quick.error is None


def test_cpu_seconds_are_per_task_not_cumulative():
    # one worker, a spinning task then a sleeping one: the second's CPU is its own
    with WarmPool(1, preload=PRELOAD) as pool:
        spun, slept = pool.map([Task(f"{HERE}:spin", (0.5,), weight=2), Task(f"{HERE}:sleep", (0.5,), weight=1)])
    assert spun.ok and slept.ok and spun.cpu >= 0.4, spun
    assert slept.cpu < 0.2, slept


def test_the_fingerprint_sees_a_module_container_changed_in_place(monkeypatch):
    import types

    mod = types.ModuleType("kvspec.fuzz._a_probe_module")
    mod.D, mod.L, mod.S = {"a": 1, "b": [2]}, [1, 2], {1, 2}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    before = workers.fingerprint(modules=[mod.__name__])
    whole = dict(mod.D)
    changes = [
        ("D", lambda: mod.D.__setitem__("c", 3), lambda: mod.D.pop("c")),
        ("L", lambda: mod.L.append(3), lambda: mod.L.pop()),
        ("S", lambda: mod.S.add(3), lambda: mod.S.discard(3)),
        ("D", lambda: mod.D.pop("a"), lambda: (mod.D.clear(), mod.D.update(whole))),
        ("D", lambda: mod.D.__setitem__("b", [2]), None),  # an equal value, another object
    ]
    for attr, change, undo in changes:
        change()
        assert workers.changed(before, workers.fingerprint(modules=[mod.__name__])) == [f"{mod.__name__}.{attr}"]
        if undo is None:
            break
        undo()
        assert workers.changed(before, workers.fingerprint(modules=[mod.__name__])) == []
    # the registry itself
    from kvspec.fuzz import kinds

    before = workers.fingerprint(modules=["kvspec.fuzz.kinds"])
    saved = dict(kinds.KINDS)
    try:
        kinds.KINDS.pop(next(iter(kinds.KINDS)))
        assert workers.changed(before, workers.fingerprint(modules=["kvspec.fuzz.kinds"])) == ["kvspec.fuzz.kinds.KINDS"]
    finally:
        kinds.KINDS.clear()
        kinds.KINDS.update(saved)
    assert workers.changed(before, workers.fingerprint(modules=["kvspec.fuzz.kinds"])) == []


def test_warm_cli_fails_the_test_of_a_command_that_leaked(monkeypatch):
    from kvspec.fuzz.workers import TaskResult
    from tests import warm_cli

    class Leaky:
        def map(self, tasks):
            return [TaskResult(0, (0, "out", ""), leaked="kvspec.impl.dense.KVCache.trim, os.getcwd()", status="leaked")]

    monkeypatch.setattr(warm_cli, "_POOL", Leaky())
    with pytest.raises(AssertionError, match=r"kvspec list: .*kvspec\.impl\.dense\.KVCache\.trim, os\.getcwd\(\)"):
        warm_cli.kvspec("list")
