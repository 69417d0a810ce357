"""The mutation runner of ``make mutation`` and ``kvspec mutants --changed``.

mutmut 3 makes the mutants: a copy of the tree under ``mutants/`` in which
every function of ``spec/`` and ``impl/`` is a *trampoline* that, at each
call, runs the original or one of its mutants according to the name of the
active mutant (``MUTANT_UNDER_TEST``). mutmut's own runner then forks a child
per mutant and runs ``pytest.main`` on every test that reaches the mutated
*function*. Here that costs 1-2 s of pytest start-up a mutant and 13 s for a
killed mutant of a hot function (the fast unit tests that reach it pass; a
state machine kills it), about 17 hours for the 11,900 mutants of the tree on
two cores (docs/mutation.md, "Cost of a whole-tree run"). This runner keeps
mutmut's mutants, trampolines, result files and statuses, and changes how
they are run:

1. **Workers that collect once.** Each worker (a ``spawn`` process: MLX
   hangs in a forked child once its parent evaluated an array) starts pytest
   in ``mutants/`` on the ``[tool.mutmut]`` test selection, collects the
   tests once and then takes over pytest's run loop: it runs the tests it is
   sent with ``_pytest.runner.runtestprotocol``, switching the active mutant
   in between (``_activate``; the trampolines are ``_fast_trampolines``). A
   mutant costs the tests it runs, nothing else.
2. **Tests per mutated statement, not per function.** A clean pass runs every
   selected test once under coverage.py with one dynamic context per test
   (``Coverage.switch_context``): which lines of ``mutants/spec`` and
   ``mutants/impl`` each test executes, and how long it takes. A mutant is
   then run against the tests that execute the statement it changes (the
   smallest statement of the original function enclosing the changed lines,
   all of its lines). Why no kill is lost: a mutant's function runs exactly
   as the original until the changed statement executes, and the selection's
   tests are deterministic (the ``mutation`` Hypothesis profile is
   derandomized; budgets are fixed batches, never seconds), so a test that
   never executes the statement in the clean pass never executes it under
   the mutant and passes alike. For that a test must start from the same
   state in both: before each test a worker clears the functools caches of
   the mutated packages and puts back their module-level dicts, lists and
   sets as collection left them (``_ModuleState``); a value worked out once
   would otherwise keep its clean-pass form and the statement that works
   it out would never run under the mutant. A change on the ``def`` line (a
   default, a decorator argument) takes every test that runs the function.
3. **Killers first.** The tests that killed earlier mutants of the same
   function are tried first, then the rest fastest first; the first failure
   kills (as ``pytest -x``).
4. **Kills confirmed.** A worker keeps its process state from mutant to
   mutant (fork isolation gave each a fresh one), so a mutant that corrupts
   module state could fail a later mutant's test. After a kill, the killing
   test is run again with no mutant active; if it fails there too, the
   worker is replaced and the mutant re-run on the fresh one (a second clean
   failure marks it ``suspicious``).
5. **Time limits.** A test may take ``TIME_FACTOR`` times its clean duration
   plus ``TIME_SLACK_S`` (wall time; SIGALRM inside the worker, then the
   parent kills a worker that does not answer); a mutant that passes the
   limit is ``timeout`` (detected, as in mutmut), and its worker is replaced.

Statuses and exit codes are mutmut's (``mutmut.stats.status_by_exit_code``):
killed 1, survived 0, no tests 33, suspicious 35, timeout 36; they are written
to ``mutants/<file>.meta`` so ``mutmut results``, ``mutmut show`` and
``python -m kvspec.fuzz.commands.mutation_report`` read this runner's results.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import json
import multiprocessing as mp
import os
import sys
import textwrap
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from kvspec.fuzz.commands.mutation_verdict import _changes, sole_verdicts, stale_verdicts

#: mutmut's exit codes (mutmut.stats.status_by_exit_code)
KILLED, SURVIVED, NO_TESTS, SUSPICIOUS, TIMEOUT, SEGFAULT = 1, 0, 33, 35, 36, -11
STATUS = {KILLED: "killed", SURVIVED: "survived", NO_TESTS: "no tests", SUSPICIOUS: "suspicious",
          TIMEOUT: "timeout", SEGFAULT: "segfault"}
#: a test under a mutant may take TIME_FACTOR x its clean duration + TIME_SLACK_S
#: (wall time; ``--time-slack``), the tests of a fresh worker's first mutant 10 x TIME_SLACK_S more
TIME_FACTOR = 4.0
TIME_SLACK_S = 3.0
#: statuses are written to mutants/*.meta this often during a run
SAVE_EVERY_S = 60.0
#: the limit before a worker's first "start" of a mutant
PARENT_SLACK_S = 30.0
#: the packages whose module state a worker puts back before each test
#: (``_ModuleState``): the mutated ones, and the harness and proofs, whose
#: caches keep what a mutated function returned (``kvspec.fuzz.masks._dense_mask``
#: keeps ``kvspec.spec.dense.dense_make_mask``'s masks: a mask worked out in the
#: clean pass hid a mutant of it, one worked out under a mutant failed the
#: next kill confirmation; 7 to 20 ``kvspec.spec.dense`` mutants were suspicious)
RESET_PACKAGES = ("spec", "impl", "fuzz", "proofs")
#: the mutated folders (mutmut's ``source_paths``)
MUTATED = ("spec", "impl")
#: folder -> import package, for the folders pyproject.toml maps under another
#: name (``[tool.setuptools] package-dir``: ``spec`` -> ``kvspec.spec``); set in a
#: worker from its tree (:func:`import_names`). mutmut names a mutant by its
#: file's path (``spec.dense.x_f__mutmut_1``), the trampolines by the module's
#: import name (``kvspec.spec.dense``)
_IMPORT_AS: dict[str, str] = {}
#: a mutant that passed a limit is run again with this many times the limits
RETRY_FACTOR = 5.0
#: seconds a worker may take to collect the selection
COLLECT_S = 600.0


def import_names(root: str | Path) -> dict[str, str]:
    """Folder -> import package for the folders ``root``'s pyproject.toml maps
    under another name (``{"spec": "kvspec.spec", ...}``; empty: none)."""
    try:
        conf = tomllib.loads((Path(root) / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    dirs = conf.get("tool", {}).get("setuptools", {}).get("package-dir", {}) or {}
    out = {str(d).strip("/").replace("/", "."): pkg for pkg, d in dirs.items() if pkg}
    return {d: pkg for d, pkg in out.items() if d and d != pkg}


def _import_name(module: str, names: dict[str, str] | None = None) -> str:
    """A module named from its file's path (``spec/dense.py``) by its import
    name, as the tests import it (``kvspec.spec.dense``)."""
    for folder, pkg in (_IMPORT_AS if names is None else names).items():
        if module == folder or module.startswith(folder + "."):
            return pkg + module[len(folder):]
    return module


def _mutant_prefix(prefix: str, names: dict[str, str]) -> str:
    """A ``--only`` prefix given by import name (``kvspec.spec.dense.``) as
    mutmut names the mutants (from the file's path: ``spec/dense.py``); any
    other unchanged."""
    for folder, pkg in names.items():
        if prefix == pkg or prefix.startswith(pkg + "."):
            return folder + prefix[len(pkg):]
    return prefix


class _MutantsFinder:
    """Finds each mapped package (``kvspec.spec``) in its folder under
    ``mutants/`` (before the editable install's finder, which maps it to the
    original tree); its modules then come from there."""

    def __init__(self, where: dict[str, str]) -> None:
        self.where = where

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.util

        folder = self.where.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


class RunError(Exception):
    """The runner cannot run (no mutants/, a worker that fails to start, clean
    tests failing): exit 2."""


# --------------------------------------------------------------------------- mutants and lines


@dataclass
class MutantInfo:
    """One mutant: ``name`` (mutmut's key, ``module.x_func__mutmut_N`` or
    ``module.xǁClassǁmethod__mutmut_N``), ``path`` (the source file, relative
    to the tree), ``function`` (the key without ``__mutmut_N``) and ``lines``
    (1-based lines of ``mutants/<path>`` inside the original function whose
    execution the mutant's effect needs)."""

    name: str
    path: str
    function: str
    lines: list[int] = field(default_factory=list)


def _spans(mutants: Path, path: str) -> dict[str, tuple[int, int]]:
    data = json.loads((mutants / (path + ".spans")).read_text())
    return {k: (a, b) for k, (a, b) in data["spans"].items()}


def _statement_lines(orig_src: list[str], changed: list[int]) -> list[int]:
    """Lines (offsets into ``orig_src``) of the smallest statement of the
    function that encloses every changed offset; the whole function when the
    change is on its ``def`` line or outside every statement of its body."""
    text = "".join(orig_src)
    try:
        tree = ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return list(range(len(orig_src)))
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None:
        return list(range(len(orig_src)))
    lo, hi = min(changed) + 1, max(changed) + 1  # ast lines are 1-based
    best: ast.stmt | None = None
    for node in ast.walk(func):
        if node is func or not isinstance(node, ast.stmt):
            continue
        end = node.end_lineno or node.lineno
        smaller = best is None or (end - node.lineno) < ((best.end_lineno or best.lineno) - best.lineno)
        if node.lineno <= lo and hi <= end and smaller:
            best = node
    if best is None:
        return list(range(len(orig_src)))
    return list(range(best.lineno - 1, (best.end_lineno or best.lineno)))


def mutant_lines(mutants: Path, path: str, names: list[str]) -> list[MutantInfo]:
    """Where each mutant of ``path`` acts: the lines of ``mutants/<path>``
    (in its original function) a test must execute to see it. From mutmut's
    ``.spans`` index: the mutant's source is compared line by line with the
    original function's (a mutant is the original with one node changed)."""
    spans = _spans(mutants, path)
    file_lines = (mutants / path).read_text().splitlines(keepends=True)
    out = []
    for name in names:
        mangled = name.rpartition(".")[2]
        function = name.rpartition("__mutmut_")[0]
        orig_key = mangled.rpartition("__mutmut_")[0] + "__mutmut_orig"
        info = MutantInfo(name, path, function)
        if mangled not in spans or orig_key not in spans:
            out.append(info)
            continue
        oa, ob = spans[orig_key]
        ma, mb = spans[mangled]
        orig_src, mut_src = file_lines[oa - 1:ob], file_lines[ma - 1:mb]
        # the def lines differ by name only: compare from the body on
        o_def = next((i for i, ln in enumerate(orig_src) if ln.lstrip().startswith(("def ", "async def "))), 0)
        m_def = next((i for i, ln in enumerate(mut_src) if ln.lstrip().startswith(("def ", "async def "))), 0)
        a = [ln.replace(mangled, orig_key) for ln in orig_src[o_def:]]
        b = [ln.replace(mangled, orig_key) for ln in mut_src[m_def:]]
        changed = []
        for tag, i1, i2, _j1, _j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag != "equal":
                changed.extend(range(i1, max(i2, i1 + 1)))
        changed = [min(c, len(a) - 1) for c in changed] or [0]
        if 0 in changed and a and b and a[0] != b[0]:
            offsets = list(range(len(a)))  # the def line itself: every test that runs the function
        else:
            offsets = _statement_lines(a, changed)
        info.lines = sorted({oa + o_def + off for off in offsets})
        out.append(info)
    return out


# --------------------------------------------------------------------------- the worker


_LRU_CACHE = type(functools.lru_cache(lambda: None))  # what functools.cache and lru_cache return


class _ModuleState:
    """The state the mutated packages' modules keep from test to test in a
    worker, put back as collection left it before each test. mutmut ran a
    mutant in a fresh child of a process that had only collected the tests,
    so a value a module works out once (a ``functools.cache``, a module-level
    dict or list filled on first use) was worked out under the mutant; a
    worker would keep the one the clean pass (or an earlier mutant) worked
    out, and the statement that computes it would not run again: the tests
    selected for executing it in the clean pass pass under the mutant
    without executing it (``kvspec.impl.batch.batch_rotating_class`` builds its
    class once: 74 of its 78 mutants survived, 67 are killed with this).
    Cleared: the functools caches of the modules and of their classes; put
    back: a dict, list or set global whose length changed (a cache filled, a
    registry grown; mutmut's ``mutants_*`` tables are not looked at). The
    modules are those of the mutated packages and of the packages that keep
    what they return (the harness's caches of spec masks and rows). State
    kept elsewhere (an attribute of an object, another package's cache)
    stays as it is: kill confirmation catches a mutant that corrupts it."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots
        self.modules = -1  # len(sys.modules) at the last scan
        self.seen: set[str] = set()
        self.caches: list[Any] = []
        self.globals: list[tuple[dict, str, Any, Any]] = []  # (module namespace, name, object, its contents)

    def _scan(self) -> None:
        for name, mod in list(sys.modules.items()):
            if name in self.seen or not str(getattr(mod, "__file__", None) or "").startswith(self.roots):
                continue
            self.seen.add(name)
            namespace = vars(mod)
            for key, v in list(namespace.items()):
                if isinstance(v, _LRU_CACHE):
                    self.caches.append(v)
                elif isinstance(v, type) and v.__module__ == name:
                    members = (getattr(m, "__func__", m) for m in vars(v).values())
                    self.caches.extend(m for m in members if isinstance(m, _LRU_CACHE))
                elif type(v) in (dict, list, set) and not key.startswith("mutants_"):
                    self.globals.append((namespace, key, v, v.copy()))

    def reset(self) -> None:
        if len(sys.modules) != self.modules:  # modules imported since: their state as first seen
            self._scan()
            self.modules = len(sys.modules)
        for c in self.caches:
            c.cache_clear()
        for namespace, key, obj, saved in self.globals:
            if namespace.get(key) is not obj or len(obj) != len(saved):
                if type(obj) is list:
                    obj[:] = saved
                else:
                    obj.clear()
                    obj.update(saved)
                namespace[key] = obj


#: the active mutant of this worker: (its module, its key in that module's
#: mutant table), ("", "") for none; read by the trampolines of _fast_trampolines
_ACTIVE: list[str] = ["", ""]


def _activate(name: str) -> None:
    """Make ``name`` (``module.x_func__mutmut_N``, or "" for none) the active
    mutant: for this process's trampolines and, through mutmut's own setter
    (which mirrors it into ``MUTANT_UNDER_TEST``), for any process a test
    starts."""
    from mutmut.mutation import trampoline

    module, _, key = name.rpartition(".")
    module = _import_name(module)
    _ACTIVE[:] = [module, key]
    trampoline.set_mutant_under_test(f"{module}.{key}" if module else name)


def _fast_trampolines() -> None:
    """Install a cheaper trampoline before the mutated modules are imported.

    mutmut's trampoline, run at every call of every function of ``spec/`` and
    ``impl/``, reads the active mutant from ``os.environ`` (two lookups, each
    encoding the key), copies the arguments into a list and splits the
    mutant's name: the selected tests ran 1.6x slower in ``mutants/`` than in
    the tree (40 s against 25 s for tests/test_machine.py and
    tests/test_spec_rotating.py), and every surviving mutant pays that on
    every test it runs. The one installed here dispatches on ``_ACTIVE``, set
    by :func:`_activate`: the original when the active mutant is of another
    module or none, else the mutant of that key (the original when this
    function has no such mutant), exactly as mutmut's. Generators,
    coroutines, async generators and classmethods keep mutmut's trampoline
    (whose reading of the active mutant is pointed at ``_ACTIVE`` too)."""
    import inspect

    from mutmut.mutation import trampoline

    if getattr(trampoline.wrap_in_trampoline, "_kvspec_fast", False):
        return
    mutmut_wrap = trampoline.wrap_in_trampoline

    def wrap_in_trampoline(mutants_dict: dict, is_classmethod: bool = False) -> Any:
        slow = mutmut_wrap(mutants_dict, is_classmethod)

        def decorate(func: Any) -> Any:
            if (is_classmethod or not inspect.isfunction(func) or inspect.isgeneratorfunction(func)
                    or inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)):
                return slow(func)
            module = func.__module__
            active = _ACTIVE

            @functools.wraps(func)
            def fast_trampoline(*args: Any, **kwargs: Any) -> Any:
                if active[0] == module:
                    return mutants_dict.get(active[1], mutants_dict["_mutmut_orig"])(*args, **kwargs)
                return mutants_dict["_mutmut_orig"](*args, **kwargs)

            return fast_trampoline

        return decorate

    wrap_in_trampoline._kvspec_fast = True  # type: ignore[attr-defined]
    trampoline.wrap_in_trampoline = wrap_in_trampoline
    trampoline.get_mutant_under_test = lambda: f"{_ACTIVE[0]}.{_ACTIVE[1]}" if _ACTIVE[0] else ""


def _mutated(module: str) -> bool:
    """Whether ``module`` is (in) a mutated package, by its import name."""
    return any(module == p or module.startswith(p + ".") for p in map(_import_name, MUTATED))


class _WorkerPlugin:
    """The pytest plugin of a worker: after collection it serves jobs from the
    parent over ``conn`` instead of running the session's tests. Before each
    test it sends ``("start", nodeid)``: the parent holds the time limit and
    kills a worker whose test passes it (a signal raised inside the test would
    land in pytest's or Hypothesis's own hooks and garbage-collector callbacks
    and break the session)."""

    def __init__(self, conn: Any, mutants: str) -> None:
        self.conn = conn
        self.mutants = mutants

    def pytest_runtestloop(self, session: Any) -> bool:
        from _pytest.runner import runtestprotocol

        items = {it.nodeid: it for it in session.items}
        roots = tuple(os.path.join(os.path.realpath(self.mutants), p) + os.sep for p in MUTATED)
        stray = sorted(m for m, mod in list(sys.modules.items())
                       if _mutated(m) and getattr(mod, "__file__", None)
                       and not os.path.realpath(mod.__file__).startswith(roots))
        if stray:  # the tests would run the original code: every mutant would survive
            self.conn.send(("stray", stray[:5]))
            return True
        state = _ModuleState(tuple(os.path.join(self.mutants, p) + os.sep for p in RESET_PACKAGES))

        def run(nodeid: str) -> tuple[bool, float]:
            item = items[nodeid]
            state.reset()  # every test from the modules' state after collection, clean or under a mutant
            if hasattr(item, "_initrequest"):
                item._initrequest()  # a fresh fixture request, as pytest-rerunfailures does
            self.conn.send(("start", nodeid))
            t0 = time.perf_counter()
            reports = runtestprotocol(item, nextitem=None, log=False)
            return all(not r.failed for r in reports), time.perf_counter() - t0

        self.conn.send(("ready", sorted(items)))
        while True:
            job = self.conn.recv()
            if job is None:
                break
            if job[0] == "cover":
                self.conn.send(self._cover(job[1], run))
                continue
            _, name, tests = job
            status, killer, seconds = SURVIVED, None, 0.0
            trail: list[tuple[str, float]] = []  # (test, seconds) in the order run
            _activate(name)
            try:
                for nodeid in tests:
                    passed, dt = run(nodeid)
                    seconds += dt
                    trail.append((nodeid, round(dt, 3)))
                    if not passed:
                        status, killer = KILLED, nodeid
                        break
            finally:
                _activate("")
            self.conn.send(("done", name, status, killer, seconds, trail))
        return True

    def _cover(self, tests: list[str], run: Any) -> tuple[str, dict, dict, list]:
        import coverage

        roots = [os.path.join(self.mutants, p) for p in ("spec", "impl")]
        cov = coverage.Coverage(data_file=None, include=[os.path.join(r, "*") for r in roots], branch=False,
                                config_file=False)
        durations: dict[str, float] = {}
        failed: list[str] = []
        cov.start()
        try:
            for nodeid in tests:
                cov.switch_context(nodeid)
                passed, dt = run(nodeid)
                durations[nodeid] = dt
                if not passed:
                    failed.append(nodeid)
        finally:
            cov.stop()
        data = cov.get_data()
        lines: dict[str, dict[str, list[int]]] = defaultdict(dict)
        for f in data.measured_files():
            rel = os.path.relpath(f, self.mutants)
            for ln, ctxs in data.contexts_by_lineno(f).items():
                for c in ctxs:
                    if c:
                        lines[c].setdefault(rel, []).append(ln)
        return ("covered", durations, dict(lines), failed)


def _worker_main(conn: Any, mutants: str, repo: str, pytest_args: list[str], env: dict[str, str]) -> None:
    """A worker process: pytest in ``mutants/`` with the mutated packages
    first on ``sys.path`` and the original tree off it (as mutmut's runner)."""
    os.environ.update(env)
    os.environ["MUTANT_UNDER_TEST"] = ""
    os.chdir(mutants)
    repo_real = os.path.realpath(repo)
    sys.path[:] = [mutants] + [p for p in sys.path if os.path.realpath(p or ".") not in (repo_real,)]
    _IMPORT_AS.update(import_names(repo))
    for name in [m for m in sys.modules if _mutated(m)]:
        del sys.modules[name]  # imported with the original tree on the path: import them again
    mapped = {_import_name(p): os.path.join(mutants, p) for p in MUTATED if _import_name(p) != p}
    if mapped:  # kvspec.spec is mapped from spec/ by the install: mutants/spec first
        sys.meta_path.insert(0, _MutantsFinder(mapped))
    _fast_trampolines()  # before collection imports the mutated modules
    _activate("")
    import pytest

    code = pytest.main(pytest_args, plugins=[_WorkerPlugin(conn, mutants)])
    try:
        conn.send(("exit", int(code)))
    except (BrokenPipeError, OSError):
        pass


class _Worker:
    def __init__(self, ctx: Any, mutants: Path, repo: Path, pytest_args: list[str], env: dict[str, str]) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, str(mutants), str(repo), pytest_args, env),
                                daemon=True)
        self.proc.start()
        child.close()
        self.job: Any = None
        self.test: str | None = None  # the test it runs now, and since when
        self.started = 0.0
        self.fresh = True  # no test run yet
        self.tests: list[str] = []
        #: since when a replacement worker collects (None: collected, or a
        #: first worker, which ``run`` waits for)
        self.collecting: float | None = None

    def ready(self, timeout: float = COLLECT_S) -> list[str]:
        if not self.conn.poll(timeout):
            self.kill()
            raise RunError(f"a mutation worker did not collect the tests within {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RunError("a mutation worker exited while collecting the tests (run the selection with "
                           "pytest in mutants/ to see why)") from None
        if msg[0] == "stray":
            self.kill()
            raise RunError(f"the tests import the original tree, not mutants/ ({', '.join(msg[1])}): "
                           "no mutant would be seen")
        if msg[0] != "ready":
            raise RunError(f"a mutation worker ended before collecting: pytest exit {msg[1]}")
        self.tests = msg[1]
        return msg[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# --------------------------------------------------------------------------- the parent


def pytest_args(root: Path) -> list[str]:
    """The worker's pytest command line: ``[tool.mutmut]``'s test selection
    and extra arguments (without ``-x``: the runner stops at the first
    failure itself), and no failure reports."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    extra = [a for a in conf.get("pytest_add_cli_args", []) if a != "-x"]
    # --tb=no: a failure's report is never shown, and pytest builds it eagerly:
    # about 1 s per failing test here (the traceback of a state machine with its
    # source lines), which was most of a killed mutant's cost
    return ["--rootdir=.", "-p", "no:randomly", *extra, "--tb=no",
            *conf.get("pytest_add_cli_args_test_selection", [])]


@dataclass
class RunReport:
    """What a run found: ``statuses`` (mutant name -> mutmut's exit code),
    ``killers`` (the test that killed each killed mutant), ``seconds`` and
    ``runs`` (test time, in seconds, and tests run per mutant), ``notes`` (why
    a mutant timed out, died or is suspicious), the number of selected
    ``tests``, the clean pass's and the mutants' wall time (``cover_s``,
    ``mutants_s``, seconds), the workers replaced (``restarts``) and the
    triaged equivalents given their status without a run (``skipped``)."""

    statuses: dict[str, int] = field(default_factory=dict)
    killers: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tests: int = 0
    clean_failures: list[str] = field(default_factory=list)
    cover_s: float = 0.0
    mutants_s: float = 0.0
    restarts: int = 0
    notes: dict[str, str] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)  # tests run on each mutant
    #: per mutant: the tests that execute its statement and their clean time (s)
    selected: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: mutants given their triaged status without a run (``run``'s ``skip``)
    skipped: list[str] = field(default_factory=list)


def load_mutants(mutants: Path, only: set[str] | None = None, unchecked: bool = False) -> list[MutantInfo]:
    """Every mutant in ``mutants/**/*.meta`` (or only the named ones; with
    ``unchecked``, only those without a status yet), with its lines."""
    infos: list[MutantInfo] = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        path = str(meta.relative_to(mutants))[: -len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        names = [n for n, code in codes.items() if (only is None or n in only) and not (unchecked and code is not None)]
        if names:
            infos.extend(mutant_lines(mutants, path, names))
    return infos


def run(root: Path, max_children: int = 2, only: set[str] | None = None, log: Any = None,
        env: dict[str, str] | None = None, slack: float = TIME_SLACK_S, resume: bool = False,
        skip: dict[str, str] | None = None) -> RunReport:
    """Run every mutant under ``root/mutants`` (made by mutmut) and write the
    statuses into its ``.meta`` files; see the module docstring. ``only``:
    these mutant names alone; ``resume``: only the mutants without a status
    (the statuses are written every SAVE_EVERY_S seconds and when the run
    stops, Ctrl-C included, so a stopped run goes on where it was). ``log``:
    a callable taking a line of progress; ``skip``: mutant name -> why it is
    not run (a triaged equivalent of an unchanged module, see
    :func:`triaged_skips`): such a mutant that some test executes is given
    status survived without running a test, and listed in
    ``report.skipped``. Raises RunError when the clean tests cannot run."""
    log = log or (lambda s: None)
    mutants = (root / "mutants").resolve()
    if not mutants.is_dir():
        raise RunError(f"{mutants}: no mutants (mutmut generates them first)")
    infos = load_mutants(mutants, only, unchecked=resume)
    report = RunReport()
    if not infos:
        return report
    env = {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutation"), **(env or {})}
    ctx = mp.get_context("spawn")
    args = pytest_args(root)
    n = max(1, max_children)
    workers = [_Worker(ctx, mutants, root, args, env) for _ in range(n)]
    try:
        tests = workers[0].ready()
        for w in workers[1:]:
            w.ready()
        report.tests = len(tests)
        t0 = time.perf_counter()
        durations, covered, failed = _cover(workers, tests)
        report.cover_s = time.perf_counter() - t0
        report.clean_failures = sorted(failed)
        if failed:
            raise RunError(f"{len(failed)} selected tests fail with no mutant active (first: {failed[0]}); "
                           "mutation needs a green selection")
        log(f"mutation: {len(tests)} tests, clean pass with per-test coverage {report.cover_s:.0f} s; "
            f"{len(infos)} mutants on {n} workers" + (f" ({len(skip)} triaged equivalents not run)" if skip else ""))
        by_line: dict[tuple[str, int], set[str]] = defaultdict(set)
        for nodeid, files in covered.items():
            for path, lns in files.items():
                for ln in lns:
                    by_line[(path, ln)].add(nodeid)
        tests_of: dict[str, set[str]] = {}
        todo = []
        for info in infos:
            tests_of[info.name] = set().union(*(by_line.get((info.path, ln), set()) for ln in info.lines))
            if not tests_of[info.name]:
                report.statuses[info.name] = NO_TESTS
            elif skip and info.name in skip:
                report.statuses[info.name] = SURVIVED
                report.notes[info.name] = skip[info.name]
                report.skipped.append(info.name)
            else:
                todo.append(info)
        report.selected = {name: (len(t), round(sum(durations.get(x, 0.0) for x in t), 3))
                           for name, t in tests_of.items()}
        t1 = time.perf_counter()
        pool = _Pool(ctx, mutants, root, args, env, workers, report, slack, lambda: _write_meta(mutants, infos, report))
        killers: dict[str, list[str]] = defaultdict(list)  # function -> tests that killed its mutants
        timed_out = _run_mutants(pool, todo, tests_of, durations, killers, 1.0, log)
        if timed_out:
            # a limit is wall time, and the machine may be loaded: a mutant that
            # passed one is run again with RETRY_FACTOR times the limits; only a
            # second timeout stands
            log(f"mutation: {len(timed_out)} timeouts, run again with {RETRY_FACTOR}x the limits")
            _run_mutants(pool, timed_out, tests_of, durations, killers, RETRY_FACTOR, log)
        report.mutants_s = time.perf_counter() - t1
    finally:
        for w in workers:
            w.stop()
        _write_meta(mutants, infos, report)
    return report


def _next_message(w: _Worker) -> Any:
    """The worker's next message other than a test's start (which moves its
    clock); EOFError when it died."""
    while True:
        msg = w.conn.recv()
        if msg[0] != "start":
            return msg
        w.test, w.started = msg[1], time.perf_counter()


def _cover(workers: list[_Worker], tests: list[str]) -> tuple[dict, dict, list]:
    """The clean pass, tests dealt out to the workers round robin."""
    shares = [tests[i::len(workers)] for i in range(len(workers))]
    for w, share in zip(workers, shares):
        w.conn.send(("cover", share))
    durations: dict[str, float] = {}
    covered: dict[str, dict[str, list[int]]] = {}
    failed: list[str] = []
    for w in workers:
        try:
            msg = _next_message(w)
        except EOFError:
            raise RunError("a mutation worker died in the clean pass") from None
        durations.update(msg[1])
        covered.update(msg[2])
        failed.extend(msg[3])
    for w in workers:
        w.fresh = False
    return durations, covered, failed


@dataclass
class _Pool:
    ctx: Any
    mutants: Path
    root: Path
    args: list[str]
    env: dict[str, str]
    workers: list[_Worker]
    report: RunReport
    slack: float = 3.0
    save: Any = None  # writes the statuses so far (a stopped run can resume)

    def replace(self, i: int) -> None:
        """Kill worker ``i`` and start a new one in its place. The new one is
        not waited for: it collects the selection (about 20 s for the whole
        tree's) while the others go on, and ``_run_mutants`` gives it its
        first job when its ``ready`` arrives (``_Worker.collecting``)."""
        self.workers[i].kill()
        self.report.restarts += 1
        self.workers[i] = _Worker(self.ctx, self.mutants, self.root, self.args, self.env)
        self.workers[i].collecting = time.perf_counter()

    def collected(self, i: int) -> bool:
        """Whether replacement worker ``i`` is ready for a job (raises
        RunError, as ``_Worker.ready``, when it failed to collect or took
        longer than COLLECT_S)."""
        w = self.workers[i]
        if w.collecting is None:
            return True
        if not w.conn.poll(0):
            if time.perf_counter() - w.collecting < COLLECT_S:
                return False
            w.kill()
            raise RunError(f"a mutation worker did not collect the tests within {COLLECT_S:.0f} s")
        w.ready(timeout=0.0)
        w.collecting = None
        return True


def _limit(durations: dict[str, float], nodeid: str, factor: float, fresh: bool, slack: float) -> float:
    """A test's wall-clock limit under a mutant: ``factor`` x (TIME_FACTOR x its
    clean duration + ``slack``), and 10 x ``slack`` more for the tests of the
    first mutant a worker just started runs (MLX and the test modules warm up
    there)."""
    return factor * (TIME_FACTOR * durations.get(nodeid, 1.0) + slack) + (10 * slack if fresh else 0.0)


#: a worker's kills are confirmed after this many (and at the end): their
#: killing tests are run with no mutant active
CHECK_EVERY = 25
_CHECK = MutantInfo("", "", "")  # the job of a confirmation (no mutant active)


def _run_mutants(pool: _Pool, infos: list[MutantInfo], tests_of: dict[str, set[str]], durations: dict,
                 killers: dict[str, list[str]], factor: float, log: Any) -> list[MutantInfo]:
    """Run ``infos`` on the pool's workers; statuses into the report. Returns
    the mutants that passed a time limit (status timeout for now).

    Kills are confirmed in batches: after CHECK_EVERY kills on a worker, and
    when the queue is empty, the worker runs the distinct killing tests of
    those kills with no mutant active. A failure there means the worker's
    state went bad somewhere in the batch: the worker is replaced and the
    batch's mutants are run again on a fresh one (a mutant whose kill fails
    confirmation twice is ``suspicious``). Kills on a worker that then hangs
    or dies before its confirmation are kept."""
    report, workers = pool.report, pool.workers
    requeued: set[str] = set()
    timed_out: list[MutantInfo] = []
    queue = list(reversed(infos))  # pop() from the end keeps the order: a function's mutants together
    pending: list[list[tuple[MutantInfo, str]]] = [[] for _ in workers]  # kills not confirmed yet
    total, last = len(queue), time.perf_counter()
    saved, finished = last, 0

    def order(info: MutantInfo) -> list[str]:
        tests = tests_of[info.name]
        first = sorted((t for t in killers[info.function] if t in tests), key=lambda t: durations.get(t, 0.0))
        return first + sorted(tests - set(first), key=lambda t: (durations.get(t, 0.0), t))

    def dispatch(i: int) -> None:
        w = workers[i]
        if w.collecting is not None:
            return  # a replacement: its first job when it has collected
        w.test, w.started = None, time.perf_counter()
        if pending[i] and (len(pending[i]) >= CHECK_EVERY or not queue):
            w.job = _CHECK
            w.conn.send(("mutant", "", sorted({k for _, k in pending[i]}, key=lambda t: durations.get(t, 0.0))))
        elif queue:
            info = queue.pop()
            w.job = info
            w.conn.send(("mutant", info.name, order(info)))

    for i in range(len(workers)):
        if pool.collected(i):
            dispatch(i)

    def busy() -> bool:
        # a worker with a job, or a replacement still collecting while
        # there is work it could take
        return any(w.job is not None or (w.collecting is not None and queue) for w in workers)

    while busy():
        wait_conns([w.conn for w in workers if w.job is not None or w.collecting is not None], timeout=1.0)
        for i in range(len(workers)):
            w = workers[i]
            if w.collecting is not None:
                if pool.collected(i):
                    dispatch(i)
                continue
            info = w.job
            if info is None:
                continue
            msg: Any = None
            try:
                while msg is None and w.conn.poll():
                    got = w.conn.recv()
                    if got[0] == "start":
                        w.test, w.started = got[1], time.perf_counter()
                    else:
                        msg = got
            except EOFError:
                msg = ("died",)
            if msg is None:
                limit = _limit(durations, w.test, factor, w.fresh, pool.slack) if w.test else PARENT_SLACK_S
                if time.perf_counter() - w.started <= limit:
                    continue
                msg = ("hung",)
            w.job = None
            w.fresh = False
            if info is _CHECK:
                if msg[0] != "done" or msg[2] != SURVIVED:
                    # a killing test fails (or hangs) with no mutant: this worker's state went bad
                    pool.replace(i)
                    for bad, _ in pending[i]:
                        report.statuses.pop(bad.name, None)
                        report.killers.pop(bad.name, None)
                        if bad.name in requeued:
                            report.statuses[bad.name] = SUSPICIOUS
                            report.notes[bad.name] = "its kill failed confirmation twice"
                        else:
                            requeued.add(bad.name)
                            queue.append(bad)
                            finished -= 1
                pending[i] = []
                dispatch(i)
                continue
            finished += 1
            name = info.name
            if msg[0] == "done":
                _, _, status, killer, seconds, trail = msg
                report.seconds[name] = seconds
                report.runs[name] = len(trail)
                report.statuses[name] = status
                report.notes.pop(name, None)
                if status == KILLED:
                    report.killers[name] = killer
                    pending[i].append((info, killer))
                    if killer not in killers[info.function]:
                        killers[info.function].append(killer)
            elif msg[0] == "hung":
                report.statuses[name] = TIMEOUT
                report.notes[name] = f"{w.test or 'its first test'} passed its limit " \
                                     f"({_limit(durations, w.test, factor, False, pool.slack) if w.test else PARENT_SLACK_S:.1f} s)"
                timed_out.append(info)
                pool.replace(i)
                pending[i] = []
            else:  # the worker died (a segfault, os._exit) or its pytest session ended
                if msg[0] == "died":
                    # its pipe reads EOF before it is reaped, and exitcode is None
                    # until then (most of the time for a segfaulting child here)
                    w.proc.join(5)
                code = w.proc.exitcode if msg[0] == "died" else msg[1]
                pool.replace(i)
                pending[i] = []
                report.statuses[name] = SEGFAULT if isinstance(code, int) and code < 0 else SUSPICIOUS
                report.notes[name] = f"the worker {'died' if msg[0] == 'died' else 'ended'} in {w.test} " \
                                     f"(exit code {code})"
            dispatch(i)
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            alive = sum(s == SURVIVED for s in report.statuses.values())
            log(f"mutation: {finished}/{total} run, {alive} surviving so far")
        if pool.save is not None and time.perf_counter() - saved > SAVE_EVERY_S:
            saved = time.perf_counter()
            pool.save()
    return timed_out


def _write_meta(mutants: Path, infos: list[MutantInfo], report: RunReport) -> None:
    by_path: dict[str, list[MutantInfo]] = defaultdict(list)
    for info in infos:
        by_path[info.path].append(info)
    for path, group in by_path.items():
        meta_path = mutants / (path + ".meta")
        meta = json.loads(meta_path.read_text())
        for info in group:
            if info.name in report.statuses:
                meta["exit_code_by_key"][info.name] = report.statuses[info.name]
                meta["durations_by_key"][info.name] = round(report.seconds.get(info.name, 0.0), 3)
        meta_path.write_text(json.dumps(meta, indent=4))
    # what each mutant cost, for docs/mutation.md's figures and a reader asking
    # why a run is slow: mutants/mutation-run.json
    skipped = set(report.skipped)
    (mutants / "mutation-run.json").write_text(json.dumps({
        "tests": report.tests, "cover_s": round(report.cover_s, 3), "mutants_s": round(report.mutants_s, 3),
        "restarts": report.restarts,
        "mutants": {i.name: {"status": STATUS.get(report.statuses[i.name], "?"),
                             "seconds": round(report.seconds.get(i.name, 0.0), 3),
                             "runs": report.runs.get(i.name, 0), "killer": report.killers.get(i.name),
                             "selected": report.selected.get(i.name, (0, 0.0))[0],
                             "selected_s": report.selected.get(i.name, (0, 0.0))[1],
                             "skipped": i.name in skipped}
                    for i in infos if i.name in report.statuses}}, indent=1))


def generate(root: Path, max_children: int) -> None:
    """mutmut's mutant generation, as ``mutmut run`` does it first: the tree
    copied to ``root/mutants`` with every function of ``source_paths`` turned
    into a trampoline over its mutants (a function whose source did not
    change since the last generation keeps its mutants)."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        import mutmut.__main__ as mm

        mm.set_mutant_under_test("mutant_generation")
        Path("mutants").mkdir(exist_ok=True)
        mm.copy_src_dir()
        mm.copy_also_copy_files()
        mm.setup_source_paths()
        mm.create_mutants(max_children)
    finally:
        os.chdir(cwd)


# --------------------------------------------------------------------------- triaged equivalents

#: per source file (``impl/dense.py``): the SHA-256 of its text when a run
#: last ran every one of its mutants and every survivor had a verdict
#: (``make mutation`` writes it, relative to the tree; docs/mutation.md,
#: "Triaged equivalents are not run again")
STAMPS_IN_TREE = Path("docs") / "mutation-stamps.json"
STAMPS = Path(__file__).resolve().parents[2] / STAMPS_IN_TREE


def source_hash(path: Path) -> str | None:
    """The SHA-256 of the file's bytes (None when there is no such file)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def read_stamps(path: Path = STAMPS) -> dict[str, str]:
    return json.loads(path.read_text()) if path.exists() else {}


def _file_mutants(root: Path, path: str) -> dict[str, Any]:
    """Every mutant of source file ``path`` and its status (its ``.meta``)."""
    meta = (root / "mutants" / (path + ".meta")).resolve()
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}


def triaged_skips(root: Path, infos: list[MutantInfo], stamps: dict[str, str], verdict: Any,
                  functions: set[str] | None = None) -> dict[str, str]:
    """The mutants not worth running again: each in a source file whose text
    is the one stamped (so its mutants are the ones triaged) and named alone
    by a verdict (:func:`sole_verdicts`; ``verdict(name, change)`` is
    :func:`kvspec.fuzz.commands.mutation_report.verdict_for`: an argued or proved
    equivalent, which no test can kill while the code is unchanged).
    ``functions``: the only functions with verdicts (to read fewer diffs;
    None: every function). Mutant name -> the note the run keeps."""
    wanted = {i.name for i in infos}
    out = {}
    for path in sorted({i.path for i in infos}):
        if path not in stamps or stamps[path] != source_hash(root / path):
            continue
        names = [n for n in _file_mutants(root, path)
                 if functions is None or n.rsplit("__mutmut_", 1)[0] in functions]
        for name, v in sole_verdicts(_changes(root, names), verdict).items():
            if name in wanted:
                out[name] = f"not run: triaged equivalent ({v.section}), its file unchanged since its stamp"
    return out


def update_stamps(root: Path, verdict: Any, skipped: set[str], path: Path = STAMPS,
                  functions: set[str] | None = None) -> list[str]:
    """Stamp every source file under ``root/mutants`` all of whose mutants
    have a status, none of them given by a skip, whose every survivor
    (survived or no tests) has a verdict, and none of whose detected
    mutants a verdict names alone (:func:`stale_verdicts`); a file with
    such a stale verdict loses its stamp. Returns the files stamped."""
    stamps = read_stamps(path)
    done: list[str] = []
    changed = False
    mutants = (root / "mutants").resolve()
    for meta in sorted(mutants.rglob("*.py.meta")):
        src = str(meta.relative_to(mutants))[: -len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes or any(c is None for c in codes.values()) or skipped & set(codes):
            continue
        digest = source_hash(root / src)
        if digest is None:
            continue
        if stale_verdicts(root, codes, verdict, functions):
            # a verdict this run contradicts: every mutant of the file runs again until it is fixed
            if stamps.pop(src, None) is not None:
                changed = True
            continue
        if stamps.get(src) == digest:
            continue
        alive = [n for n, c in codes.items() if c in (SURVIVED, NO_TESTS)]
        changes = _changes(root, alive)
        if all(verdict(n, changes[n]) is not None for n in alive):
            stamps[src] = digest
            done.append(src)
    if done or changed:
        path.write_text(json.dumps(dict(sorted(stamps.items())), indent=1) + "\n")
    return done


def summary(report: RunReport) -> str:
    counts: dict[str, int] = defaultdict(int)
    for code in report.statuses.values():
        counts[STATUS[code]] += 1
    detected = sum(counts[s] for s in ("killed", "timeout", "suspicious", "segfault"))
    checked = len(report.statuses)
    score = f"{100.0 * detected / checked:.1f}%" if checked else "-"
    parts = ", ".join(f"{counts[s]} {s}" for s in STATUS.values() if counts[s])
    not_run = f" ({len(report.skipped)} of them triaged equivalents, not run)" if report.skipped else ""
    return (f"mutation: {checked} mutants: {parts}{not_run}; score {score}; {report.tests} tests, clean pass "
            f"{report.cover_s:.0f} s, mutants {report.mutants_s:.0f} s, {report.restarts} worker restarts")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvspec.fuzz.commands.mutation_run",
                                 description="Generate the mutants of spec/ and impl/ with mutmut and run them "
                                             "with the in-process runner (docs/mutation.md).")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2, metavar="N",
                    help="worker processes (default: the number of CPUs)")
    ap.add_argument("--only", nargs="+", metavar="PREFIX",
                    help="run only the mutants whose name starts with one of these (e.g. kvspec.spec.dense.)")
    ap.add_argument("--no-generate", action="store_true", help="use the mutants/ folder as it is")
    ap.add_argument("--resume", action="store_true",
                    help="run only the mutants without a status yet (a stopped run goes on; the statuses are "
                         f"saved every {SAVE_EVERY_S:.0f} s and on Ctrl-C)")
    ap.add_argument("--time-slack", type=float, default=TIME_SLACK_S, metavar="S",
                    help=f"seconds a test may take beyond {TIME_FACTOR:g}x its clean duration before the mutant "
                         f"counts as a timeout (default {TIME_SLACK_S:g}; a fresh worker's first mutant 10x more)")
    ap.add_argument("--recheck", action="store_true",
                    help="run the triaged equivalents too (by default a survivor with a verdict in a file whose "
                         "text is the stamped one is not run again; docs/mutation.md)")
    a = ap.parse_args(argv)
    if a.max_children < 1:
        ap.error(f"--max-children: must be at least 1, got {a.max_children}")
    if not a.time_slack > 0:
        ap.error(f"--time-slack: must be a positive number of seconds, got {a.time_slack}")
    root = Path.cwd()
    t0 = time.perf_counter()
    try:
        if not a.no_generate:
            generate(root, a.max_children)
        gen_s = time.perf_counter() - t0
        only = None
        if a.only:
            only = {i.name for i in load_mutants((root / "mutants").resolve())
                    if i.name.startswith(tuple(_mutant_prefix(p, import_names(root)) for p in a.only))}
            if not only:
                print(f"mutation: --only: no mutant starts with {' or '.join(a.only)}", file=sys.stderr)
                return 2
        from kvspec.fuzz.commands.mutation_report import TRIAGE, verdict_for

        stamps_path = root / STAMPS_IN_TREE
        skip: dict[str, str] = {}
        if not a.recheck:
            skip = triaged_skips(root, load_mutants((root / "mutants").resolve(), only, unchecked=a.resume),
                                 read_stamps(stamps_path), verdict_for, {v.function for v in TRIAGE})
        report = run(root, a.max_children, only=only, log=lambda s: print(s, flush=True), slack=a.time_slack,
                     resume=a.resume, skip=skip)
        # the skips of this sitting and, on --resume, of the sittings before
        record = root / "mutants" / "mutation-skipped.json"
        skipped = set(report.skipped) | (set(json.loads(record.read_text())) if a.resume and record.exists() else set())
        record.write_text(json.dumps(sorted(skipped)))
        stamps_path.parent.mkdir(parents=True, exist_ok=True)
        stamped = update_stamps(root, verdict_for, skipped, stamps_path, {v.function for v in TRIAGE})
        if stamped:
            print(f"mutation: stamped {', '.join(stamped)} in {STAMPS_IN_TREE} (their triaged equivalents are "
                  "not run again until they change; --recheck runs them)", flush=True)
    except RunError as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mutation: stopped; the statuses so far are saved in mutants/ "
              "(python -m kvspec.fuzz.commands.mutation_run --resume goes on)", file=sys.stderr)
        return 130
    print(summary(report) + f"; generation {gen_s:.0f} s, total {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
