"""Warm worker processes: start once, import once, run many tasks.

``kvspec verify`` and ``kvspec mutants`` run hundreds of short, independent
tasks (a bug's seeds, a campaign, a proof obligation). Started one process
each, every task paid for a Python start and for importing MLX, the
implementation, the spec, Hypothesis and the fuzz machinery, often more than
the task itself. A :class:`WarmPool` starts ``workers`` processes that import
``preload`` once and then run tasks one after another::

    with WarmPool(2) as pool:
        for result in pool.run([Task("kvspec.fuzz.commands.verify:run_job", (job,), limit=60.0, weight=8.0)]):
            ...  # TaskResult, as each task finishes

* **Order.** The queue starts the heaviest task first (``Task.weight``,
  expected seconds; ties in list order); results come back as tasks finish,
  each with its index in the list (:func:`in_order` puts them back in list
  order).
* **Hang guard.** A task past its wall-clock limit (``limit_of(task)``,
  by default ``Task.limit``; None: none) is stopped: its worker is killed
  and replaced, and the result says so, naming the task. The limit is a
  guard against a hang, never a verdict: a task that bounds its own work
  does so in examples or solver units.
* **A worker that dies** (a crash in native code, ``os._exit``) is reported
  as the result of the task it was running, and replaced.
* **One core each.** With one worker per core this process may use, each
  worker keeps to its own core, and so do the threads and processes it
  starts (:func:`worker_cores` says why); otherwise, or with
  ``pin=False``, the OS places them.
* **CPU seconds** per task: user and system time of the worker (its
  threads included) and of the child processes it waited for, as
  ``getrusage`` deltas around the task. Summed over a run, half of it is
  what the run takes on two cores of its own, whatever the load was.
* **Isolation guard.** A task must leave the worker as it found it: a
  monkeypatched method or an environment variable left behind would change
  the next task's verdict. Before its first task a worker fingerprints what
  a task could leak (:func:`fingerprint`): every attribute of every loaded
  module under ``spec``, ``impl``, ``fuzz`` and ``proofs`` and of the
  classes they define (by identity; a module-level dict, list or set also
  by its shallow contents: keys and the values' identities), ``os.environ``, the working directory,
  ``sys.path``, Hypothesis's default settings profile, the garbage
  collector's freeze count and MLX's default device. After each task it
  compares; a difference is the result's ``leaked`` (the names that
  changed), the result's status is ``leaked`` (a tool failure: the verdict
  may be wrong) and the worker is replaced. :data:`MAY_CHANGE` lists the
  few module globals that change by design (a lazily built schema checker,
  the last queued read), each with its reason.

Processes come from the ``forkserver`` context: MLX hangs in a plainly
forked child once its parent has evaluated an array, and the fork server
imports only what touches no MLX (:data:`SERVER_PRELOAD`); MLX, ``impl``
and the rest are imported in each worker after its fork.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Self

#: imported by every worker before its first task: what the tasks of
#: ``verify`` and ``mutants`` import anyway (about 3 s of CPU once, instead
#: of once per task). ``"package.*"`` imports every module of the package
#: (but :data:`NOT_PRELOADED`), so that the isolation guard knows each of
#: them from before the first task; a ``"module:function"`` entry is
#: called with no argument after the imports (it fills a cache a task
#: would otherwise fill).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "numpy", "mlx.core", "hypothesis", "hypothesis.stateful", "hypothesis.strategies", "z3",
    "kvspec.impl.*", "kvspec.spec.*", "kvspec.proofs.*", "kvspec.fuzz.*", "kvspec.fuzz.commands.verify", "kvspec.fuzz.commands.mutants",
    "kvspec.fuzz.commands.e2e", "kvspec.fuzz.bugs:catalog", "kvspec.fuzz.trace:_op_checker",
)

#: left out of a ``"package.*"`` preload: other engines' adapters (their
#: own dependencies, imported on use), the CLI, and the pytest and
#: HypoFuzz entry points
NOT_PRELOADED = ("kvspec.fuzz.adapters", "kvspec.fuzz.commands", "kvspec.fuzz.hypofuzz_targets", "kvspec.fuzz.pytest_plugin")

#: imported once by the fork server before it forks each worker: none of
#: them touches MLX (a forked child hangs once its parent evaluated an MLX
#: array)
SERVER_PRELOAD: tuple[str, ...] = ("numpy", "hypothesis", "hypothesis.stateful", "hypothesis.strategies", "z3",
                                   "rich.console", "rich.table")

#: module packages whose state the isolation guard fingerprints
GUARDED = ("kvspec.spec", "kvspec.impl", "kvspec.fuzz", "kvspec.proofs")

#: module globals that change by design, each with why that is no leak
MAY_CHANGE: dict[str, str] = {
    "kvspec.impl.write._QUEUED": "the reads queued last, which the next host write waits for (kvspec.impl.write.queue_read)",
    "kvspec.impl.write._KERNEL": "the CUDA write kernel, compiled on first use",
    "kvspec.fuzz.trace._CHECKER": "the kvtrace op schema's checker, built on first use",
    "kvspec.proofs.domain._counter": "fresh variable names, renumbered from 0 by every obligation (reset_names)",
    "kvspec.fuzz.interrupt._installed": "the SIGINT handler installed by a command",
    "kvspec.fuzz.adapters.vllm._V": "vLLM's modules, imported on first use",
    "kvspec.fuzz.adapters.llama_cpp._FOLDER": "llama.cpp's build folder, found on first use",
    "kvspec.impl.write.COUNTS": "how many in-place writes each mechanism made in this process (a counter, read to show "
                         "which path ran)",
    "kvspec.impl.batch._RING_BATCH": "the batched ring class over mlx-lm's, built on first use",
    "kvspec.impl.recurrent._RECORDED": "the recorded subclass of each recurrent model class, built on first use",
    "kvspec.fuzz.failures._HARNESS": "the harness's folders, found on first use",
    "kvspec.fuzz.rows._DTYPE_NAMES": "the kvtrace name of each MLX dtype, cached on first use",
    "kvspec.fuzz.trace._VALIDATORS": "the kvtrace schema's validators, built on first use",
    "kvspec.fuzz.targets._DECLARED": "the lockstep driver over a target's class, built on first use per kind",
    "kvspec.impl.write._BACKENDS": "where each device type's arrays live, read once per device type",
    "kvspec.fuzz.zygote._ZYGOTES": "the zygote process of each preload (the proof obligations'), started on first "
                                   "use and kept for the next task; each task's call runs in a child forked for it "
                                   "alone",
}

#: attributes Python itself adds on first use: copyreg's slot names on a
#: class (cached when an instance is first copied or pickled), the
#: warnings module's registry on a module (which warnings were shown; any
#: change of the warning filters invalidates it)
_LAZY_CLASS_ATTRS = frozenset({"__slotnames__"})
_LAZY_MODULE_ATTRS = frozenset({"__warningregistry__"})


@dataclass(frozen=True)
class Task:
    """``func`` (``"module:function"``) called as ``func(*args)`` in a
    worker. ``limit``: wall-clock seconds before it is stopped (a hang
    guard; None: none); ``weight``: expected seconds (the heaviest start
    first); ``name``: what messages call it (default: ``func``)."""

    func: str
    args: tuple = ()
    limit: float | None = None
    weight: float = 1.0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.func


@dataclass
class TaskResult:
    """What became of ``tasks[index]``. ``status``: ``ok`` (``value`` is
    the function's return), ``error`` (it raised: ``error`` holds the
    traceback), ``stopped`` (past its wall-clock limit, the worker killed),
    ``died`` (the worker died during it), ``leaked`` (it returned or
    raised, and left the worker changed: ``leaked`` names what; the worker
    was replaced). ``cpu``: CPU seconds of the worker and its waited-for
    children during the task (for a stopped or dead worker, its own CPU
    as the system counted it, children excluded); ``seconds``: wall
    clock."""

    index: int
    value: Any = None
    error: str | None = None
    cpu: float = 0.0
    seconds: float = 0.0
    leaked: str | None = None
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class WorkerStartError(RuntimeError):
    """A worker could not import its preload (every worker would fail the
    same way): the traceback it sent."""


# -- the fingerprint ---------------------------------------------------------------
def _in_packages(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def _guarded_modules(packages: tuple[str, ...] = GUARDED) -> dict[str, ModuleType]:
    return {name: mod for name, mod in list(sys.modules.items())
            if isinstance(mod, ModuleType) and _in_packages(name, packages)}


def _contents(value: Any) -> int | None:
    """A shallow fingerprint of a module-level dict, list or set (None: not
    one): a dict's keys (by value) in order with its values' identities, a
    list's items' identities, a set's items, hashed. Cheap; it sees an
    entry added, removed or replaced in place, not a change inside an
    entry's own value."""
    try:
        if isinstance(value, dict):
            return hash(tuple([(k, id(v)) for k, v in list(value.items())]))
        if isinstance(value, list):
            return hash(tuple([id(v) for v in list(value)]))
        if isinstance(value, set):
            return hash(frozenset(list(value)))
    except Exception:  # noqa: BLE001 - a key whose hash raises: its identity is all we compare
        return None
    return None


def _module_state(name: str, mod: ModuleType) -> dict[str, Any]:
    """``"module.attr"`` and ``"module.Class.attr"`` -> the value's id (None:
    a submodule, which an import binds and nothing else changes); for a
    module-level dict, list or set, its id and :func:`_contents` (an
    in-place ``KINDS.pop(k)`` is a change too)."""
    out: dict[str, int | None] = {}
    for attr, value in list(vars(mod).items()):
        key = f"{name}.{attr}"
        if attr in _LAZY_MODULE_ATTRS:
            continue
        if isinstance(value, ModuleType):
            out[key] = None
            continue
        contents = None if attr.startswith("__") else _contents(value)
        out[key] = id(value) if contents is None else (id(value), contents)
        if isinstance(value, type) and getattr(value, "__module__", None) == name and attr == value.__name__:
            for cattr, cvalue in list(vars(value).items()):
                if cattr not in _LAZY_CLASS_ATTRS:
                    out[f"{key}.{cattr}"] = id(cvalue)
    return out


def _process_state() -> dict[str, Any]:
    """What a task could leave behind outside the guarded modules."""
    state: dict[str, Any] = {f"os.environ[{k}]": v for k, v in os.environ.items()}
    state["os.getcwd()"] = os.getcwd()
    state["sys.path"] = tuple(sys.path)
    state["gc.get_freeze_count()"] = gc.get_freeze_count()
    hyp = sys.modules.get("hypothesis")
    if hyp is not None:
        state["hypothesis settings profile"] = hyp.settings._current_profile
        state["hypothesis settings.default"] = id(hyp.settings.default)
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        state["mlx default device"] = str(mx.default_device())
    return state


def fingerprint(packages: tuple[str, ...] = GUARDED, modules: Iterable[str] | None = None) -> dict[str, Any]:
    """The state the isolation guard compares (see the module's doc): of
    the loaded modules under ``packages``, or of the named ``modules``
    (those still loaded)."""
    state: dict[str, Any] = _process_state()
    mods = _guarded_modules(packages)
    for name in (mods if modules is None else [m for m in modules if m in mods]):
        state.update(_module_state(name, mods[name]))
    return state


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names whose state differs between two fingerprints, sorted;
    names of :data:`MAY_CHANGE`, and attributes that only appeared as
    submodules (an import binds them), left out."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        if key in MAY_CHANGE:
            continue
        old, new = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if old == new or (old is _ABSENT and new is None):
            continue
        out.append(key)
    return out


_ABSENT = object()


# -- the worker ----------------------------------------------------------------------
def _cpu() -> float:
    from kvspec.fuzz import zygote

    # a zygote's children are the zygote's, not this worker's: it reports their CPU seconds
    return zygote.own_cpu() + zygote.cpu()


def resolve(func: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    from kvspec.fuzz.zygote import resolve_name

    if not func.partition(":")[2]:
        raise ValueError(f"a task's func is 'module:function', not {func!r}")
    return resolve_name(func)


def _import(name: str) -> None:
    """Import ``name``; a third-party module that is not installed (Z3 on a
    machine without it) is left out: the task that needs it says so itself.
    A module of the project that is missing or broken is an error."""
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing = exc.name or ""
        if not missing or _in_packages(missing, GUARDED):
            raise


def _preload(preload: Iterable[str]) -> None:
    import pkgutil

    for entry in preload:
        if ":" in entry:
            resolve(entry)()
        elif entry.endswith(".*"):
            package = importlib.import_module(entry[:-2])
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if not info.name.startswith(NOT_PRELOADED):
                    _import(info.name)
        else:
            _import(entry)


def _worker_main(conn: Any, preload: tuple[str, ...], guard: bool, cpu: int | None = None) -> None:
    """A worker's life: keep to core ``cpu`` (None: any), import
    ``preload``, say ``ready``, then run each task sent until the pipe
    closes or ``None`` comes; after a task that leaked (``guard``), exit
    (the parent starts another)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if cpu is not None:
        # before MLX starts its stream thread: the threads (and the processes) it starts keep to the core too
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:  # the core was taken away since the pool looked (a changed cpuset): run anywhere
            pass
    try:
        _preload(preload)
        seen = set(_guarded_modules())
        base = fingerprint(modules=seen) if guard else {}
    except BaseException:  # noqa: BLE001 - sent to the parent, which stops the run
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", _cpu()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, func, args = msg
        c0, t0 = _cpu(), time.perf_counter()
        value, error = None, None
        try:
            value = resolve(func)(*args)
        except BaseException:  # noqa: BLE001 - the task's failure is its result
            error = traceback.format_exc()
        seconds, cpu = time.perf_counter() - t0, _cpu() - c0
        leaked: list[str] = []
        if guard:
            leaked = changed(base, fingerprint(modules=seen))
            # a module this task imported first is compared from now on
            new = set(_guarded_modules()) - seen
            if new:
                seen |= new
                base.update(fingerprint(modules=new))
        status = "leaked" if leaked else "error" if error is not None else "ok"
        reply = (index, value, error, cpu, seconds, ", ".join(leaked) or None, status, _cpu())
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - a value that does not pickle
            conn.send((index, None, f"the task's value could not be sent back: {traceback.format_exc()}", cpu,
                       seconds, reply[5], "error" if not leaked else "leaked", _cpu()))
        if leaked:
            return


_context: Any = None


def context() -> Any:
    """The ``forkserver`` context, its server preloading :data:`SERVER_PRELOAD`."""
    global _context
    if _context is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(SERVER_PRELOAD))
        _context = ctx
    return _context


@dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    #: the task index it runs, its start and the worker's CPU seconds then
    task: int | None = None
    began: float = 0.0
    cpu_then: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    #: the core it keeps to (None: any)
    cpu: int | None = None


def worker_cores(workers: int) -> list[int] | None:
    """The cores ``workers`` pool workers keep to, one each, when there are
    exactly as many workers as cores this process may use (and more than
    one); None otherwise (the workers go where the OS puts them).

    Why: a worker's decoding thread hands every MLX evaluation to MLX's
    stream thread and waits for it, tens of thousands of times a second;
    with both threads on one core the hand-off is a switch on that core,
    not a wake-up sent to the other one, which is busy with the other
    worker anyway (on this project's 2-core machine the bug jobs of
    ``kvspec verify`` take about 5 % less CPU, an e2e scenario beside a
    busy core up to 17 % less). What a job does is the same either way."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return None
    return cores if workers > 1 and len(cores) == workers else None


def _proc_cpu(pid: int) -> float | None:
    """A live process's own CPU seconds (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class WarmPool:
    """``workers`` warm processes (see the module's doc). A context
    manager: leaving it stops every worker. ``guard=False`` turns the
    isolation guard off (a caller that trusts its tasks). ``start_limit``:
    seconds a worker may take to import its preload before it counts as
    hung."""

    def __init__(self, workers: int, preload: tuple[str, ...] = DEFAULT_PRELOAD, guard: bool = True,
                 start_limit: float = 300.0, pin: bool = True):
        self.size = max(1, int(workers))
        self.preload, self.guard, self.start_limit = tuple(preload), guard, start_limit
        #: the core each worker keeps to, when there is one worker per core
        #: of this process (:func:`worker_cores`), else None
        self.cores = worker_cores(self.size) if pin else None
        self.workers: list[_Worker] = []
        #: workers started in all (the first ones and every replacement)
        self.started = 0
        #: CPU seconds the workers took to start and import their preload,
        #: summed (what each task no longer pays)
        self.start_cpu = 0.0
        #: why each replaced worker was replaced, in order
        self.replaced: list[str] = []

    # -- life cycle
    def __enter__(self) -> Self:
        while len(self.workers) < self.size:
            self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ask every idle worker to exit, kill the busy ones."""
        for w in self.workers:
            try:
                if w.task is None and w.ready:
                    w.conn.send(None)
                else:
                    w.proc.kill()
            except (OSError, ValueError):
                w.proc.kill()
        for w in self.workers:
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
            w.conn.close()
        self.workers = []

    def _start(self) -> _Worker:
        ctx = context()
        parent, child = ctx.Pipe(duplex=True)
        cpu = None
        if self.cores is not None:  # the core no live worker keeps to (a replacement takes its predecessor's)
            cpu = next(c for c in self.cores if c not in {w.cpu for w in self.workers})
        proc = ctx.Process(target=_worker_main, args=(child, self.preload, self.guard, cpu), daemon=True,
                           name=f"kvspec-worker-{self.started}")
        proc.start()
        child.close()
        self.started += 1
        w = _Worker(proc, parent, cpu=cpu)
        self.workers.append(w)
        return w

    def _replace(self, w: _Worker, why: str, restart: bool = True) -> None:
        """Stop ``w``; start another now (``restart``) or at the next
        :meth:`run`."""
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(5)
        w.conn.close()
        self.workers.remove(w)
        self.replaced.append(why)
        if restart:
            self._start()

    # -- running tasks
    def run(self, tasks: list[Task], limit_of: Callable[[Task], float | None] | None = None,
            poll: float = 1.0, on_poll: Callable[[], None] | None = None) -> Iterator[TaskResult]:
        """Run ``tasks``, heaviest first; yield each :class:`TaskResult` as
        it finishes. ``limit_of(task)``: its wall-clock limit (default
        ``task.limit``). ``on_poll()`` is called at least every ``poll``
        seconds while waiting (it may raise, e.g. ``KeyboardInterrupt`` for
        a recorded Ctrl-C). A caller that stops iterating early leaves the
        pool usable: workers still busy are killed and replaced."""
        from multiprocessing.connection import wait

        limit_of = limit_of or (lambda t: t.limit)
        queue = sorted(range(len(tasks)), key=lambda i: (-tasks[i].weight, i))
        pending = len(tasks)
        self.__enter__()  # as many workers as asked for (a run stopped early left fewer)
        try:
            while pending:
                for w in self.workers:
                    if w.ready and w.task is None and queue:
                        i = queue.pop(0)
                        w.task, w.began, w.cpu_then = i, time.perf_counter(), w.cpu_then
                        w.conn.send((i, tasks[i].func, tasks[i].args))
                ready = wait([w.conn for w in self.workers], timeout=poll)
                if on_poll is not None:
                    on_poll()
                now = time.perf_counter()
                for w in list(self.workers):
                    result = None
                    if w.conn in ready:
                        result = self._receive(w, tasks, now)
                    elif w.task is not None:
                        limit = limit_of(tasks[w.task])
                        if limit is not None and now - w.began > limit:
                            cpu = _proc_cpu(w.proc.pid)
                            t = tasks[w.task]
                            result = TaskResult(
                                w.task, None, f"task {t.label!r} ran past its wall-clock limit of {limit:g} s and "
                                f"was stopped (its worker killed and replaced)",
                                max(0.0, cpu - w.cpu_then) if cpu is not None else 0.0, now - w.began, None,
                                "stopped")
                            self._replace(w, f"stopped {t.label!r} past {limit:g} s")
                    elif not w.ready and now - w.started > self.start_limit:
                        self._replace(w, f"not ready after {self.start_limit:g} s")
                    if result is not None:
                        pending -= 1
                        yield result
        finally:
            for w in list(self.workers):
                if w.task is not None:
                    self._replace(w, f"abandoned with task {tasks[w.task].label!r} running", restart=False)

    def _receive(self, w: _Worker, tasks: list[Task], now: float) -> TaskResult | None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(5)
            code = w.proc.exitcode
            if w.task is None:
                if not w.ready:
                    raise WorkerStartError(f"a worker exited (code {code}) while importing its preload")
                self._replace(w, f"idle worker exited (code {code})")
                return None
            t = tasks[w.task]
            cpu = 0.0
            result = TaskResult(w.task, None, f"the worker running task {t.label!r} died (exit code {code}) "
                                "without a result", cpu, now - w.began, None, "died")
            self._replace(w, f"died running {t.label!r} (exit code {code})")
            return result
        if msg[0] == "ready":
            w.ready, w.cpu_then = True, msg[1]
            self.start_cpu += msg[1]
            return None
        if msg[0] == "failed":
            self.close()
            raise WorkerStartError(f"a worker could not import its preload:\n{msg[1]}")
        index, value, error, cpu, seconds, leaked, status, cpu_total = msg
        w.task, w.cpu_then = None, cpu_total
        if leaked:
            t = tasks[index]
            self._replace(w, f"{t.label!r} leaked {leaked}")
        return TaskResult(index, value, error, cpu, seconds, leaked, status)

    def map(self, tasks: list[Task], limit_of: Callable[[Task], float | None] | None = None) -> list[TaskResult]:
        """Every task's result, in list order."""
        return in_order(self.run(tasks, limit_of), len(tasks))


def in_order(results: Iterable[TaskResult], n: int) -> list[TaskResult]:
    """``n`` results (each index once) put back in list order."""
    out: list[TaskResult | None] = [None] * n
    for r in results:
        out[r.index] = r
    return [r for r in out if r is not None]


__all__ = ["DEFAULT_PRELOAD", "GUARDED", "MAY_CHANGE", "Task", "TaskResult", "WarmPool", "WorkerStartError",
           "changed", "fingerprint", "in_order", "resolve"]
