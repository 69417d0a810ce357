"""The mutation runner's pieces (fuzz/commands/mutation_run.py) without a
worker process: the lines a mutant needs, read from a hand-written
``mutants/`` folder in mutmut's layout (the ``.spans`` index); the worker's
pytest arguments; the time limits; the summary; the result files; the
command line's checks; and the parent's scheduling (killers first, kills
confirmed in batches, a timeout's retry, a dead worker) on fake workers.

The fake workers are ``_Worker`` objects built on a fake multiprocessing
context: their ``conn`` answers each job at once from a script (which tests
fail, hang or take how long under which mutant) and stamps every message
with the time it would arrive on a simulated clock, which the patched
``time.perf_counter`` and ``wait`` of the runner read and advance. No test
here depends on the machine's speed or load: a test "takes 10 s" on that
clock, and the limits are decided with margins of seconds of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from mutmut.stats import status_by_exit_code

from kvspec.fuzz.commands import mutation_run as R

# --------------------------------------------------------------------------- a mutants/ folder by hand

F = '''
def NAME(a, b=1):
    if a > 0:
        return a + b
    return b
'''
F_MUTANTS = [
    F.replace("if a > 0", "if a >= 0"),  # 1: the if's test: the whole if statement
    F.replace("return a + b", "return a - b"),  # 2: inside the if: that return alone
    F.replace("b=1", "b=2"),  # 3: the def line: every line of the function
    F.replace("return b", "return None"),  # 4: the last line alone
]
G = '''
def NAME(x):
    y = h(
        x,
        x + 1,
    )
    return y
'''
G_MUTANTS = [G.replace("x + 1", "x - 1")]  # a line inside a statement of four lines
M = '''
    def NAME(self):
        return self.x + 1
'''
M_MUTANTS = [M.replace("+ 1", "- 1")]  # a method (indented in its class)
RARE = '''
def NAME(x):
    if x == 7:
        return "seven"
    return "other"
'''
RARE_MUTANTS = [RARE.replace('"seven"', '"XXsevenXX"')]
K = '''
def NAME(x):
    return x * 2
'''
K_MUTANTS = [K.replace("* 2", "/ 2"), K.replace("* 2", "* 3")]
L = '''
def NAME(n):
    i = 0
    while i < n:
        i += 1
    return i
'''
L_MUTANTS = [L.replace("i += 1", "i = 1"), L.replace("i = 0", "i = None")]

TREE = {
    "spec/a.py": [("x_f", F, F_MUTANTS), ("x_g", G, G_MUTANTS), ("xǁCǁm", M, M_MUTANTS), ("x_rare", RARE, RARE_MUTANTS)],
    "impl/b.py": [("x_k", K, K_MUTANTS), ("x_l", L, L_MUTANTS)],
}


def write_mutants(root: Path, tree: dict = TREE) -> dict[str, int]:
    """``root/mutants/<path>`` laid out as mutmut lays it out (the original of
    each function, then its mutants, each after two blank lines that its
    ``.spans`` entry includes), its ``.spans`` and a ``.meta`` listing every
    mutant unchecked. Returns the line of each original's ``def``, by
    ``module.function``."""
    defs: dict[str, int] = {}
    for path, funcs in tree.items():
        module = path[:-3].replace("/", ".")
        lines = ["import os\n"]
        spans: dict[str, list[int]] = {}
        keys: dict[str, None] = {}
        for mangled, orig, mutants in funcs:
            if orig.strip("\n").startswith(" "):
                lines.append("class C:\n")
            for n, src in [("orig", orig), *((str(i), m) for i, m in enumerate(mutants, 1))]:
                key = f"{mangled}__mutmut_{n}"
                start = len(lines) + 1
                lines += ["\n", "\n"]
                if n == "orig":
                    defs[f"{module}.{mangled}"] = len(lines) + 1
                else:
                    keys[f"{module}.{key}"] = None
                lines += [ln + "\n" for ln in src.strip("\n").replace("NAME", key).splitlines()]
                spans[key] = [start, len(lines)]
        target = root / "mutants" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(lines))
        (root / "mutants" / (path + ".spans")).write_text(json.dumps({"version": 1, "spans": spans}))
        (root / "mutants" / (path + ".meta")).write_text(json.dumps({
            "exit_code_by_key": keys, "hash_by_function_name": {}, "type_check_error_by_key": {},
            "durations_by_key": {}, "estimated_durations_by_key": {}}))
    return defs


def test_mutant_lines_of_each_kind_of_change(tmp_path):
    """The lines a mutant needs, on mutmut's layout: the smallest statement
    around the change (an ``if`` test: the ``if`` statement; a return inside
    it: that line), every line for a change on the ``def`` line (a default
    value), the whole statement of a change inside a statement of several
    lines, and a method's (indented) source."""
    d = write_mutants(tmp_path)
    infos = {i.name: i for i in R.load_mutants(tmp_path / "mutants")}
    f, g, m = d["spec.a.x_f"], d["spec.a.x_g"], d["spec.a.xǁCǁm"]
    assert infos["spec.a.x_f__mutmut_1"].lines == [f + 1, f + 2]
    assert infos["spec.a.x_f__mutmut_2"].lines == [f + 2]
    assert infos["spec.a.x_f__mutmut_3"].lines == [f, f + 1, f + 2, f + 3]
    assert infos["spec.a.x_f__mutmut_4"].lines == [f + 3]
    assert infos["spec.a.x_g__mutmut_1"].lines == [g + 1, g + 2, g + 3, g + 4]
    assert infos["spec.a.xǁCǁm__mutmut_1"].lines == [m + 1]
    text = (tmp_path / "mutants" / "spec" / "a.py").read_text().splitlines()
    assert text[f - 1] == "def x_f__mutmut_orig(a, b=1):" and text[m - 1] == "    def xǁCǁm__mutmut_orig(self):"
    assert {i.path for i in infos.values()} == {"spec/a.py", "impl/b.py"}
    assert infos["impl.b.x_k__mutmut_2"].function == "impl.b.x_k"
    assert len(R.load_mutants(tmp_path / "mutants", only={"impl.b.x_k__mutmut_2"})) == 1


def test_statement_lines_enclose_every_changed_line():
    """Offsets into the function (0: the ``def`` line): a change over two
    statements of an ``if`` body takes the ``if``, not the first one's line."""
    src = ["def f(a):\n", "    if a:\n", "        x = 1\n", "        y = 2\n", "    return a\n"]
    assert R._statement_lines(src, [2]) == [2]
    assert R._statement_lines(src, [2, 3]) == [1, 2, 3]
    assert R._statement_lines(src, [4]) == [4]


# --------------------------------------------------------------------------- pure pieces


def test_pytest_args_keep_the_deselection_and_drop_x(tmp_path):
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent('''
        [tool.mutmut]
        pytest_add_cli_args_test_selection = ["tests/test_a.py", "tests/test_b.py"]
        pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q", "-k", "not slow and not other"]
    '''))
    assert R.pytest_args(tmp_path) == ["--rootdir=.", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-k",
                                       "not slow and not other", "--tb=no", "tests/test_a.py", "tests/test_b.py"]


def test_limit_factor_and_fresh_worker_slack():
    d = {"t": 0.5}
    assert R._limit(d, "t", 1.0, False, 2.0) == pytest.approx(4 * 0.5 + 2.0)
    assert R._limit(d, "t", 5.0, False, 2.0) == pytest.approx(5 * (4 * 0.5 + 2.0))
    assert R._limit(d, "t", 1.0, True, 2.0) == pytest.approx(4 * 0.5 + 2.0 + 10 * 2.0)
    assert R._limit(d, "unknown", 1.0, False, 2.0) == pytest.approx(4 * 1.0 + 2.0)


def test_status_codes_are_mutmuts():
    """The codes written to the ``.meta`` files mean, to mutmut, the statuses
    the runner means."""
    for code, name in R.STATUS.items():
        assert status_by_exit_code[code] == name, (code, name)


def test_summary_counts_and_score():
    codes = [R.KILLED, R.KILLED, R.SURVIVED, R.NO_TESTS, R.TIMEOUT, R.SEGFAULT, R.SUSPICIOUS]
    report = R.RunReport(statuses={f"m{i}": c for i, c in enumerate(codes)}, tests=9, restarts=3)
    s = R.summary(report)
    assert s.startswith("mutation: 7 mutants: 2 killed, 1 survived, 1 no tests, 1 suspicious, 1 timeout, "
                        "1 segfault; score 71.4%; 9 tests"), s
    assert "3 worker restarts" in s
    assert "score -" in R.summary(R.RunReport())


def test_write_meta_writes_every_file_code_and_duration(tmp_path):
    write_mutants(tmp_path)
    mutants = tmp_path / "mutants"
    infos = R.load_mutants(mutants)
    run = [i for i in infos if not i.name.endswith("x_f__mutmut_2")]  # one left unchecked
    report = R.RunReport(statuses={i.name: R.KILLED if "x_k" in i.name else R.TIMEOUT for i in run},
                         seconds={i.name: 0.25 for i in run})
    R._write_meta(mutants, infos, report)
    for path in ("spec/a.py", "impl/b.py"):
        meta = json.loads((mutants / (path + ".meta")).read_text())
        for name, code in meta["exit_code_by_key"].items():
            if name.endswith("x_f__mutmut_2"):
                assert code is None and name not in meta["durations_by_key"]
            else:
                assert code == report.statuses[name] and meta["durations_by_key"][name] == 0.25, (path, name)


def test_module_state_put_back_before_each_test(tmp_path, monkeypatch):
    """A worker's ``_ModuleState``: the functools caches of a mutated
    module (and of its classes) cleared, a module-level dict or list that
    grew (or was rebound) put back as it was collected; one that kept its
    length, mutmut's ``mutants_*`` tables and other packages' modules left
    alone."""
    roots = (str(tmp_path / "mutants" / "spec") + os.sep,)
    source = textwrap.dedent('''
        from functools import cache, lru_cache
        calls = []
        FOUND = {}
        WORDS = {"a": 1}
        mutants_x_f__mutmut = {}


        @cache
        def table(n):
            calls.append(n)
            return n


        class C:
            @staticmethod
            @lru_cache(maxsize=8)
            def m(n):
                return n
    ''')
    mods = {}
    for name, where in (("spec.fake_state", tmp_path / "mutants" / "spec"), ("other_state", tmp_path)):
        where.mkdir(parents=True, exist_ok=True)
        path = where / (name.rpartition(".")[2] + ".py")
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        monkeypatch.setitem(sys.modules, name, mod)
        mods[name] = mod
    state = R._ModuleState(roots)
    state.reset()  # as after collection
    for mod in mods.values():
        mod.table(1), mod.C.m(3), mod.FOUND.update(x=2), mod.mutants_x_f__mutmut.update(k=1)
        mod.WORDS["a"] = 5
    state.reset()
    mod, other = mods["spec.fake_state"], mods["other_state"]
    assert mod.table.cache_info().currsize == 0 and mod.C.m.cache_info().currsize == 0
    assert mod.FOUND == {} and mod.calls == []
    assert mod.WORDS == {"a": 5} and mod.mutants_x_f__mutmut == {"k": 1}
    assert other.table.cache_info().currsize == 1 and other.FOUND == {"x": 2} and other.calls == [1]
    found = mod.FOUND
    mod.FOUND = {"y": 3}
    state.reset()
    assert mod.FOUND is found and found == {}


# --------------------------------------------------------------------------- the command line


def test_main_refuses_a_slack_of_zero_and_an_only_that_matches_nothing(tmp_path, monkeypatch, capsys):
    write_mutants(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        R.main(["--no-generate", "--time-slack", "0"])
    assert e.value.code == 2 and "--time-slack" in capsys.readouterr().err
    assert R.main(["--no-generate", "--only", "spec.nowhere."]) == 2
    assert "--only" in capsys.readouterr().err


def test_main_only_takes_every_prefix(tmp_path, monkeypatch):
    write_mutants(tmp_path)
    monkeypatch.chdir(tmp_path)
    seen = {}

    def fake_run(root, max_children, only=None, log=None, slack=None, resume=False, skip=None):
        seen.update(only=only, slack=slack, max_children=max_children, resume=resume, skip=skip)
        return R.RunReport()

    monkeypatch.setattr(R, "run", fake_run)
    assert R.main(["--no-generate", "--max-children", "3", "--time-slack", "1.5", "--only", "spec.a.x_g", "impl.b."]) == 0
    assert seen["only"] == {"spec.a.x_g__mutmut_1", "impl.b.x_k__mutmut_1", "impl.b.x_k__mutmut_2",
                            "impl.b.x_l__mutmut_1", "impl.b.x_l__mutmut_2"}
    assert seen["slack"] == 1.5 and seen["max_children"] == 3 and seen["resume"] is False
    assert seen["skip"] == {}  # no stamps in this tree: every mutant runs


# --------------------------------------------------------------------------- fake workers


class Clock:
    """The simulated time: ``perf_counter`` for the runner, advanced by its
    ``wait`` (0.05 s a call) and by a blocking ``recv``."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t

    def wait(self, conns, timeout=None):
        self.t += 0.05
        return []


class World:
    """What the fake workers' tests do. ``rules[(mutant, test)]``: the
    outcomes of its successive runs (the last one repeats): ``("pass", s)``,
    ``("fail", s)``, ``("hang", 0)``, ``("die", 0)`` (a segfault: the pipe
    closes, exit code -11) or ``("exit", code)`` (its pytest session ends);
    by default a test passes in its clean time. A mutant in ``poison``
    leaves its worker's state bad: every later test on it fails, with or
    without a mutant (what kill confirmation is for)."""

    def __init__(self, clock: Clock, tests: list[str], covered: dict, clean: dict | None = None) -> None:
        self.clock, self.tests, self.covered = clock, tests, covered
        self.clean = {t: (clean or {}).get(t, 0.01) for t in tests}
        self.rules: dict[tuple[str, str], list[tuple[str, float]]] = {}
        self.poison: set[str] = set()
        self.jobs: list[tuple[int, str, list[str]]] = []  # (worker, mutant, tests) as sent; mutant "" = a check
        self.shares: list[list[str]] = []
        self.started = 0
        self.collect_s = 0.0  # how long a worker takes to collect the tests
        self.sent: list[tuple[int, float]] = []  # (worker, simulated time) of each job sent

    def outcome(self, w: FakeWorker, mutant: str, test: str) -> tuple[str, float]:
        if w.bad:
            return ("fail", 0.01)
        rule = self.rules.get((mutant, test))
        if rule:
            return rule.pop(0) if len(rule) > 1 else rule[0]
        return ("pass", self.clean[test])


WORLD: World | None = None


class _End:
    """The parent's end of a fake worker's pipe."""

    def __init__(self, w: FakeWorker) -> None:
        self.w = w

    def send(self, job) -> None:
        if self.w.closed:
            raise OSError("handle is closed")
        self.w.handle(job)

    def poll(self, timeout: float = 0.0) -> bool:
        w = self.w
        clock = w.world.clock
        if w.inbox:
            at = w.inbox[0][0]
            if at <= clock.t + (timeout or 0.0):  # a blocking poll waits for it
                clock.t = max(clock.t, at)
                return True
            return False
        return w.dead

    def recv(self):
        w = self.w
        if w.inbox:
            at, msg = w.inbox.popleft()
            w.world.clock.t = max(w.world.clock.t, at)  # a blocking recv waits for it
            return msg
        if w.dead:
            raise EOFError
        raise AssertionError("recv on a worker that will never answer")

    def close(self) -> None:
        self.w.closed = True


class _Proc:
    def __init__(self, w: FakeWorker) -> None:
        self.w = w

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return not self.w.dead

    def kill(self) -> None:
        self.w.dead, self.w.exitcode = True, self.w.exitcode if self.w.exitcode is not None else -9

    def join(self, timeout=None) -> None:
        self.w.reaped = self.w.dead

    @property
    def exitcode(self):
        # as a process's: None until it is reaped (a dead worker's pipe reads
        # EOF before that; 26 of 30 real segfaulting children read None then)
        return self.w.exitcode if self.w.reaped else None


class FakeWorker(R._Worker):
    """A ``_Worker`` (its own ``__init__``, ``ready``, ``kill``, ``stop``) on
    a fake context: the process is the World's script."""

    def __init__(self, ctx, mutants, repo, pytest_args, env) -> None:
        assert WORLD is not None
        self.world, self.number = WORLD, WORLD.started
        WORLD.started += 1
        self.inbox: deque = deque()
        self.dead = self.closed = self.bad = self.reaped = False
        self.exitcode: int | None = None
        fake_ctx = SimpleNamespace(Pipe=lambda: (_End(self), SimpleNamespace(close=lambda: None)),
                                   Process=lambda **kw: _Proc(self))
        super().__init__(fake_ctx, mutants, repo, pytest_args, env)
        self.inbox.append((self.world.clock.t + self.world.collect_s, ("ready", list(self.world.tests))))

    def handle(self, job) -> None:
        world = self.world
        t = world.clock.t
        if job is None:
            self.dead, self.exitcode = True, 0
            return
        if job[0] == "cover":
            world.shares.append(list(job[1]))
            self.inbox.append((t, ("covered", {x: world.clean[x] for x in job[1]},
                                   {x: world.covered[x] for x in job[1] if x in world.covered}, [])))
            return
        _, name, tests = job
        world.jobs.append((self.number, name, list(tests)))
        world.sent.append((self.number, t))
        status, killer, seconds, trail = R.SURVIVED, None, 0.0, []
        for test in tests:
            self.inbox.append((t, ("start", test)))
            what, dt = world.outcome(self, name, test)
            if what == "hang":
                return
            if what == "die":
                self.dead, self.exitcode = True, -11
                return
            if what == "exit":
                self.inbox.append((t, ("exit", int(dt))))
                self.dead, self.exitcode = True, int(dt)
                return
            t += dt
            seconds += dt
            trail.append((test, dt))
            if what == "fail":
                status, killer = R.KILLED, test
                break
        if name in world.poison:
            self.bad = True
        self.inbox.append((t, ("done", name, status, killer, seconds, trail)))


@pytest.fixture
def fake(monkeypatch):
    """Install a World (returned by the fixture's ``world(...)``) whose
    workers replace the runner's processes, on a simulated clock."""
    clock = Clock()
    monkeypatch.setattr(R, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(R, "wait_conns", clock.wait)
    monkeypatch.setattr(R, "_Worker", FakeWorker)

    def world(tests, covered, clean=None) -> World:
        global WORLD
        WORLD = World(clock, tests, covered, clean)
        return WORLD

    yield world
    global WORLD
    WORLD = None


def _pool(n: int, slack: float = 0.5) -> R._Pool:
    workers = [R._Worker(None, Path("mutants"), Path("."), [], {}) for _ in range(n)]
    for w in workers:
        w.ready()
        w.fresh = False  # as after the clean pass
    return R._Pool(None, Path("mutants"), Path("."), [], {}, workers, R.RunReport(), slack)


def _info(name: str, function: str = "spec.a.x_f") -> R.MutantInfo:
    return R.MutantInfo(name, "spec/a.py", function)


def _run(pool, infos, tests_of, durations, factor=1.0):
    return R._run_mutants(pool, infos, tests_of, durations, defaultdict(list), factor, lambda s: None)


def _tests_sent(world: World, mutant: str) -> list[list[str]]:
    return [tests for _, name, tests in world.jobs if name == mutant]


def test_run_on_fake_workers_gives_each_status_and_writes_it(tmp_path, fake):
    """``run`` end to end on two fake workers and the hand-written tree of
    two files: the clean pass deals each test to one worker; each mutant is
    sent the tests that execute its lines; killed, survived, no tests, a
    segfault (the worker died), suspicious (its pytest session ended), a
    timeout that stands and one that its retry at RETRY_FACTOR x the limits
    turns into a survivor; every status and duration lands in both files'
    ``.meta`` with mutmut's meaning."""
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\npytest_add_cli_args_test_selection = ["t.py"]\n')
    d = write_mutants(tmp_path)
    f, g, k, lp = d["spec.a.x_f"], d["spec.a.x_g"], d["impl.b.x_k"], d["impl.b.x_l"]
    tests = ["t.py::test_pos", "t.py::test_neg", "t.py::test_g", "t.py::test_k", "t.py::test_l"]
    world = fake(tests, {
        "t.py::test_pos": {"spec/a.py": [f + 1, f + 2]},
        "t.py::test_neg": {"spec/a.py": [f + 1, f + 3]},
        "t.py::test_g": {"spec/a.py": [g + 1, g + 5]},  # `y = h(` and `return y`
        "t.py::test_k": {"impl/b.py": [k + 1]},
        "t.py::test_l": {"impl/b.py": [lp + 1, lp + 2, lp + 3, lp + 4]},
    }, clean={"t.py::test_l": 2.0})
    fail, m = [("fail", 0.01)], "spec.a.x_f__mutmut_"
    world.rules.update({(m + "1", "t.py::test_pos"): fail, (m + "3", "t.py::test_pos"): fail,
                        (m + "4", "t.py::test_neg"): fail,
                        ("impl.b.x_k__mutmut_1", "t.py::test_k"): [("die", 0)],
                        ("impl.b.x_k__mutmut_2", "t.py::test_k"): [("exit", 3)],
                        ("impl.b.x_l__mutmut_1", "t.py::test_l"): [("hang", 0)],
                        # 14 s: past 4 x 2 + 0.5 s (and a fresh worker's 5 s more), within 5 x that
                        ("impl.b.x_l__mutmut_2", "t.py::test_l"): [("pass", 14.0)]})
    report = R.run(tmp_path, max_children=2, slack=0.5)
    assert sorted(t for share in world.shares for t in share) == sorted(tests) and len(world.shares) == 2
    assert report.tests == 5 and report.clean_failures == []
    st = {}
    for path in ("spec/a.py", "impl/b.py"):
        meta = json.loads((tmp_path / "mutants" / (path + ".meta")).read_text())
        for name, code in meta["exit_code_by_key"].items():
            st[name.rpartition(".")[2]] = status_by_exit_code[code]
            assert isinstance(meta["durations_by_key"][name], float), name
    assert st == {"x_f__mutmut_1": "killed", "x_f__mutmut_2": "survived", "x_f__mutmut_3": "killed",
                  "x_f__mutmut_4": "killed", "x_g__mutmut_1": "survived", "xǁCǁm__mutmut_1": "no tests",
                  "x_rare__mutmut_1": "no tests", "x_k__mutmut_1": "segfault", "x_k__mutmut_2": "suspicious",
                  "x_l__mutmut_1": "timeout", "x_l__mutmut_2": "survived"}, st
    assert [t for sent in _tests_sent(world, m + "2") for t in sent] == ["t.py::test_pos"]
    assert sorted(_tests_sent(world, m + "3")[0]) == ["t.py::test_neg", "t.py::test_pos"]  # the def line
    assert _tests_sent(world, "spec.a.x_g__mutmut_1") == [["t.py::test_g"]]
    assert len(_tests_sent(world, "impl.b.x_l__mutmut_1")) == 2  # the first pass and its retry
    assert "passed its limit" in report.notes["impl.b.x_l__mutmut_1"]
    assert "exit code -11" in report.notes["impl.b.x_k__mutmut_1"], report.notes
    assert "exit code 3" in report.notes["impl.b.x_k__mutmut_2"], report.notes


def test_killers_first_then_every_other_test(fake):
    """A mutant first gets the tests that killed earlier mutants of its
    function, then all the others fastest first: mutant 2 is killed by the
    slow test alone, after the fast killer of mutant 1 passed."""
    tests = ["t::fast", "t::slow"]
    world = fake(tests, {}, clean={"t::fast": 0.01, "t::slow": 0.5})
    pool = _pool(1)
    a, b, c = _info("spec.a.x_f__mutmut_1"), _info("spec.a.x_f__mutmut_2"), _info("spec.a.x_f__mutmut_3")
    world.rules[(a.name, "t::slow")] = [("fail", 0.01)]
    world.rules[(b.name, "t::fast")] = [("fail", 0.01)]
    both = set(tests)
    assert _run(pool, [a, b, c], {a.name: both, b.name: both, c.name: both}, world.clean) == []
    assert pool.report.statuses == {a.name: R.KILLED, b.name: R.KILLED, c.name: R.SURVIVED}
    assert _tests_sent(world, a.name) == [["t::fast", "t::slow"]]  # fastest first
    assert _tests_sent(world, b.name) == [["t::slow", "t::fast"]]  # a's killer first
    assert _tests_sent(world, c.name) == [["t::fast", "t::slow"]]  # both killers, fastest first


def test_a_kill_by_a_corrupted_worker_is_run_again_and_survives(fake):
    """A surviving mutant that corrupts its worker's state makes the next
    mutant fail: the confirmation of that kill (its killing test, no mutant
    active) fails too, so the worker is replaced and the mutant run again
    on the fresh one, where it survives."""
    world = fake(["t::a"], {})
    pool = _pool(1)
    p, q = _info("spec.a.x_f__mutmut_1"), _info("spec.a.x_f__mutmut_2")
    world.poison.add(p.name)
    assert _run(pool, [p, q], {p.name: {"t::a"}, q.name: {"t::a"}}, world.clean) == []
    assert pool.report.statuses == {p.name: R.SURVIVED, q.name: R.SURVIVED}
    assert [name for _, name, _ in world.jobs] == [p.name, q.name, "", q.name]
    assert pool.report.restarts == 1


def test_a_kill_that_fails_confirmation_twice_is_suspicious(fake):
    """A mutant that is killed and corrupts its worker, on both runs, is
    suspicious; the mutant its corruption killed in the same batch is run
    again on a fresh worker and survives."""
    world = fake(["t::a", "t::b"], {})
    pool = _pool(1)
    q, r = _info("spec.a.x_f__mutmut_1"), _info("spec.a.x_g__mutmut_1", "spec.a.x_g")
    world.poison.add(r.name)
    world.rules[(r.name, "t::b")] = [("fail", 0.01)]
    assert _run(pool, [r, q], {q.name: {"t::a"}, r.name: {"t::b"}}, world.clean) == []
    assert pool.report.statuses == {q.name: R.SURVIVED, r.name: R.SUSPICIOUS}, pool.report.statuses
    assert "confirmation twice" in pool.report.notes[r.name]


def test_a_check_batch_runs_after_check_every_kills(fake, monkeypatch):
    """Kills are confirmed every CHECK_EVERY kills on a worker (not only at
    the end), with each killing test once."""
    monkeypatch.setattr(R, "CHECK_EVERY", 2)
    world = fake(["t::a", "t::b"], {})
    pool = _pool(1)
    infos = [_info(f"spec.a.x_f__mutmut_{i}") for i in range(1, 6)]
    for i in infos:
        world.rules[(i.name, "t::a")] = [("fail", 0.01)]
    assert _run(pool, infos, {i.name: {"t::a", "t::b"} for i in infos}, world.clean) == []
    assert set(pool.report.statuses.values()) == {R.KILLED}
    assert [name or tests for _, name, tests in world.jobs] == [
        infos[0].name, infos[1].name, ["t::a"], infos[2].name, infos[3].name, ["t::a"], infos[4].name, ["t::a"]]


def test_each_test_has_its_own_limit_and_a_fresh_worker_its_slack(fake):
    """Limits on the simulated clock (slack 0.5): a mutant whose slow test
    (clean 3 s) takes 10 s survives (its limit is 12.5 s, not its fast first
    test's 0.54 s); a hang is a timeout and its worker replaced; on the
    fresh worker a test of 3 s passes (0.54 + 10 x 0.5 s), on the same
    worker afterwards it is a timeout (0.54 s)."""
    world = fake(["t::fast", "t::slow"], {}, clean={"t::fast": 0.01, "t::slow": 3.0})
    pool = _pool(1)
    u, h, v1, v2 = (_info(f"spec.a.x_f__mutmut_{i}") for i in range(1, 5))
    world.rules[(u.name, "t::slow")] = [("pass", 10.0)]
    world.rules[(h.name, "t::fast")] = [("hang", 0)]
    world.rules[(v1.name, "t::fast")] = [("pass", 3.0)]
    world.rules[(v2.name, "t::fast")] = [("pass", 3.0)]
    tests_of = {u.name: {"t::fast", "t::slow"}, h.name: {"t::fast"}, v1.name: {"t::fast"}, v2.name: {"t::fast"}}
    timed_out = _run(pool, [u, h, v1, v2], tests_of, world.clean)
    st = pool.report.statuses
    assert (st[u.name], st[h.name], st[v1.name], st[v2.name]) == (R.SURVIVED, R.TIMEOUT, R.SURVIVED, R.TIMEOUT), st
    assert [i.name for i in timed_out] == [h.name, v2.name]
    assert pool.report.restarts == 2


def test_a_replaced_worker_collects_while_the_others_go_on(fake):
    """Workers take 20 s to collect. A hang on worker 0 replaces it; worker
    1 goes on with the queue meanwhile (the run is not held up by the
    collection), and the replacement's first job is sent only after its
    ``ready`` arrived, with a fresh worker's slack."""
    world = fake(["t::a"], {}, clean={"t::a": 1.0})
    pool = _pool(2)
    world.collect_s = 20.0  # for the replacement
    t0 = world.clock.t
    h = _info("spec.a.x_f__mutmut_1")
    rest = [_info(f"spec.a.x_f__mutmut_{i}") for i in range(2, 40)]
    world.rules[(h.name, "t::a")] = [("hang", 0)]
    timed_out = _run(pool, [h, *rest], {i.name: {"t::a"} for i in [h, *rest]}, world.clean)
    assert [i.name for i in timed_out] == [h.name] and pool.report.restarts == 1
    assert all(pool.report.statuses[i.name] == R.SURVIVED for i in rest)
    hung_at = next(t for (n, t), (_, name, _) in zip(world.sent, world.jobs) if name == h.name)
    by_worker1 = [t for n, t in world.sent if n == 1]
    by_new = [t for n, t in world.sent if n == 2]
    # the hang is seen at about 4 x 1 + 0.5 s; worker 1 is sent jobs during the 20 s of collection
    assert sum(hung_at + 4.5 < t < hung_at + 4.5 + 20.0 for t in by_worker1) >= 15, by_worker1
    assert by_new and min(by_new) >= hung_at + 4.5 + 20.0, (hung_at, by_new)
    assert world.clock.t - t0 < 38 * 1.0 / 2 + 30  # the 39 mutants shared, not one worker idle for 20 s


def test_the_fast_trampoline_dispatches_as_mutmuts_does(monkeypatch):
    """Whatever mutant is active (none, another module's, one of this
    function, one this function lacks), the trampoline a worker installs
    calls what mutmut's would: the original or that mutant; a generator keeps
    mutmut's trampoline, which then reads the active mutant the worker set."""
    from mutmut.mutation import trampoline

    monkeypatch.setattr(trampoline, "wrap_in_trampoline", trampoline.wrap_in_trampoline)
    monkeypatch.setattr(trampoline, "get_mutant_under_test", trampoline.get_mutant_under_test)
    monkeypatch.setattr(trampoline, "_mutant_under_test", trampoline._mutant_under_test)
    monkeypatch.setenv("MUTANT_UNDER_TEST", "")
    monkeypatch.setattr(R, "_ACTIVE", ["", ""])
    mutmut_wrap = trampoline.wrap_in_trampoline

    def table(kind: str) -> dict:
        if kind == "gen":
            def orig(n):
                yield from range(n)

            def m1(n):
                yield from range(n + 1)
        else:
            def orig(n, k=1):
                return n + k

            def m1(n, k=1):
                return n - k
        return {"_mutmut_orig": orig, "x_f__mutmut_1": m1}

    def wrapped(wrap, kind):
        d = table(kind)

        def f(n, k=1):
            """doc"""
        f.__module__ = "pkg.mod"
        if kind == "gen":
            def f(n):
                yield n
            f.__module__ = "pkg.mod"
        return wrap(d)(f)

    expected = {"": 3, "other.mod.x_f__mutmut_1": 3, "pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_9": 3,
                "pkg.mod.x_g__mutmut_1": 3}
    theirs = wrapped(mutmut_wrap, "fn")
    for name, want in expected.items():
        monkeypatch.setenv("MUTANT_UNDER_TEST", name)
        assert theirs(2) == want, name
    monkeypatch.setenv("MUTANT_UNDER_TEST", "")
    R._fast_trampolines()
    assert trampoline.wrap_in_trampoline is not mutmut_wrap
    ours, gen = wrapped(trampoline.wrap_in_trampoline, "fn"), wrapped(trampoline.wrap_in_trampoline, "gen")
    assert ours.__name__ == "f" and ours.__doc__ == "doc" and ours.__code__.co_name == "fast_trampoline"
    assert gen.__code__.co_name != "fast_trampoline"
    for name, want in expected.items():
        R._activate(name)
        assert ours(2) == want, name
        assert ours(2, k=2) == (0 if want == 1 else 4), name
        assert list(gen(2)) == ([0, 1, 2] if want == 1 else [0, 1]), name
        assert os.environ["MUTANT_UNDER_TEST"] == name  # what a process a test starts reads
    R._activate("")


def test_the_harness_caches_of_spec_results_are_cleared_before_each_test():
    """``kvspec.fuzz.masks`` keeps ``kvspec.spec.dense.dense_make_mask``'s masks in an
    lru_cache: a worker clears it before each test (it is under
    RESET_PACKAGES), or a mask worked out in the clean pass would hide a
    mutant of the spec's mask function."""
    import kvspec.fuzz.masks as fm

    fm._dense_mask(3, 1, None)
    assert fm._dense_mask.cache_info().currsize >= 1
    root = Path(fm.__file__).resolve().parents[1]
    roots = tuple(str(root / p) + os.sep for p in R.RESET_PACKAGES)
    R._ModuleState(roots).reset()
    assert fm._dense_mask.cache_info().currsize == 0


def test_a_replacement_that_never_collects_stops_the_run_after_collect_s(fake):
    """A replacement worker that sends no ``ready`` is waited for COLLECT_S
    at most: before that it is not ready, after it RunError is raised (and
    the worker killed), never an endless wait."""
    world = fake(["t::a"], {})
    pool = _pool(1)
    world.collect_s = 10 * R.COLLECT_S  # never within the limit
    pool.replace(0)
    assert pool.collected(0) is False
    world.clock.t += R.COLLECT_S / 2
    assert pool.collected(0) is False
    world.clock.t += R.COLLECT_S / 2 + 1.0
    with pytest.raises(R.RunError, match="did not collect"):
        pool.collected(0)
    assert pool.workers[0].dead


def test_a_replacement_collecting_after_the_queue_emptied_does_not_hold_up_the_run(fake):
    """The last mutant hangs: its worker is replaced, and with nothing left
    to run the run ends at once, without waiting for the replacement's
    collection (busy() counts a collecting worker only while there is work)."""
    world = fake(["t::a"], {}, clean={"t::a": 1.0})
    pool = _pool(1)
    world.collect_s = R.COLLECT_S - 100.0
    a, h = _info("spec.a.x_f__mutmut_1"), _info("spec.a.x_f__mutmut_2")
    world.rules[(h.name, "t::a")] = [("hang", 0)]
    t0 = world.clock.t
    timed_out = _run(pool, [a, h], {a.name: {"t::a"}, h.name: {"t::a"}}, world.clean)
    assert [i.name for i in timed_out] == [h.name] and pool.report.restarts == 1
    assert pool.workers[0].collecting is not None  # still collecting when the run ended
    assert world.clock.t - t0 < 30.0, world.clock.t - t0


def test_a_skip_gives_survived_without_a_run_only_to_a_mutant_some_test_executes(tmp_path, fake):
    """``run(..., skip=...)``: a skipped mutant that a test executes is
    survived with no job sent and listed in ``report.skipped``; a skipped
    mutant that no test executes stays "no tests" (its status is the clean
    pass's, not the triage's) and is not listed."""
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\npytest_add_cli_args_test_selection = ["t.py"]\n')
    d = write_mutants(tmp_path)
    g = d["spec.a.x_g"]
    world = fake(["t.py::test_g"], {"t.py::test_g": {"spec/a.py": [g + 1, g + 5]}})
    skip = {"spec.a.x_g__mutmut_1": "not run: triaged", "spec.a.x_rare__mutmut_1": "not run: triaged"}
    report = R.run(tmp_path, max_children=1, slack=0.5, only=set(skip), skip=skip)
    assert report.statuses == {"spec.a.x_g__mutmut_1": R.SURVIVED, "spec.a.x_rare__mutmut_1": R.NO_TESTS}
    assert report.skipped == ["spec.a.x_g__mutmut_1"] and world.jobs == []
    assert report.notes["spec.a.x_g__mutmut_1"] == "not run: triaged"


def test_main_skips_unless_recheck_and_a_resume_keeps_the_earlier_skips(tmp_path, monkeypatch):
    """``main``: the triaged skips go to ``run`` unless ``--recheck``; the
    skips are recorded in mutants/mutation-skipped.json and passed to
    ``update_stamps`` (a skipped mutant is no evidence for a stamp), with,
    on ``--resume``, those of the sittings before; a fresh run forgets them."""
    write_mutants(tmp_path)
    monkeypatch.chdir(tmp_path)
    name = "spec.a.x_f__mutmut_2"
    triaged = {name: "not run: triaged equivalent"}
    seen: dict = {}

    def fake_skips(root, infos, stamps, verdict, functions=None):
        seen["asked"] = True
        return dict(triaged)

    def fake_run(root, max_children, only=None, log=None, slack=None, resume=False, skip=None):
        seen["skip"] = skip
        return R.RunReport(skipped=sorted(skip or {}))

    def fake_stamps(root, verdict, skipped, path=R.STAMPS, functions=None):
        seen["stamped_with"] = set(skipped)
        return []

    monkeypatch.setattr(R, "triaged_skips", fake_skips)
    monkeypatch.setattr(R, "run", fake_run)
    monkeypatch.setattr(R, "update_stamps", fake_stamps)
    record = tmp_path / "mutants" / "mutation-skipped.json"
    assert R.main(["--no-generate"]) == 0
    assert seen == {"asked": True, "skip": triaged, "stamped_with": {name}}
    assert json.loads(record.read_text()) == [name]
    seen.clear()
    assert R.main(["--no-generate", "--recheck"]) == 0
    assert seen == {"skip": {}, "stamped_with": set()}  # triaged_skips not even asked
    assert json.loads(record.read_text()) == []
    record.write_text(json.dumps([name]))  # an earlier sitting skipped it
    triaged.clear()
    seen.clear()
    assert R.main(["--no-generate", "--resume"]) == 0
    assert seen["stamped_with"] == {name} and json.loads(record.read_text()) == [name]
    seen.clear()
    assert R.main(["--no-generate"]) == 0  # not a resume: the earlier sitting's skips are gone
    assert seen["stamped_with"] == set() and json.loads(record.read_text()) == []
