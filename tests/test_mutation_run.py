"""The in-process mutation runner (fuzz/commands/mutation_run.py) on a toy
project: mutmut generates its mutants, the runner runs them, and each status
it gives is checked against what the toy's tests can and cannot see.

The toy (made in a temporary folder, with its own ``[tool.mutmut]``):

* ``sign``: every line executed and checked: each mutant killed;
* ``label``: the rare branch (``x == 7``) is executed by no test, so its
  mutants are "no tests", and a mutation of its string on the executed line
  is killed;
* ``count_to``: ``i += 1`` mutated into ``i = 1`` or ``i -= 1`` loops: timeout;
* ``half``: its test exits the process on a wrong answer: the worker dies
  (detected, as mutmut counts a dead test process);
* ``unchecked``: executed by a test that checks nothing: survived;
* ``scale`` (reached through the cached ``table``) and ``lookup`` (a
  module-level dict filled on first use): every mutant killed, as mutmut's
  fresh process per mutant kills them. Two tests of each, dealt to the two
  workers in the clean pass, leave both workers' caches filled by the
  original; the functions come first in the file so that their mutants run
  before any worker is replaced (a fresh one has empty caches). Without the
  workers putting the modules' state back before each test every one of
  them survived.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from kvspec.fuzz.commands import mutation_run as R

ROOT = Path(__file__).resolve().parent.parent
#: the runner of this checkout: run in the toy's folder, ``-m fuzz...`` would
#: import the installed copy (the editable install's tree, which is another
#: checkout when a worktree shares its virtual environment)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

TOY = {
    "pyproject.toml": """
        [project]
        name = "toy"
        version = "0"
        [tool.mutmut]
        source_paths = ["spec"]
        pytest_add_cli_args_test_selection = ["toytests/test_toy.py"]
        pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]
        also_copy = ["toytests"]
    """,
    "spec/__init__.py": "",
    "spec/toy.py": '''
        import os
        from functools import cache


        @cache
        def table(n):
            return scale(n)


        def scale(n):
            return n * 10


        _FOUND = {}


        def lookup(n):
            if n not in _FOUND:
                _FOUND[n] = n + 100
            return _FOUND[n]


        def sign(x):
            if x > 0:
                return 1
            if x < 0:
                return -1
            return 0


        def label(x):
            if x == 7:
                return "seven"
            return "other"


        def count_to(n):
            i = 0
            while i < n:
                i += 1
            return i


        def half(x):
            return x // 2


        def unchecked(x):
            return x * 3
    ''',
    "toytests/test_toy.py": '''
        import os

        from spec.toy import count_to, half, label, lookup, sign, table, unchecked


        def test_table_a():
            assert table(2) == 20


        def test_table_b():
            assert table(2) == 20


        def test_lookup_a():
            assert lookup(1) == 101


        def test_lookup_b():
            assert lookup(1) == 101


        def test_sign():
            assert (sign(5), sign(1), sign(-5), sign(-1), sign(0)) == (1, 1, -1, -1, 0)


        def test_label():
            assert label(3) == "other"


        def test_count_to():
            assert (count_to(3), count_to(0)) == (3, 0)


        def test_half():
            if half(9) != 4:
                os._exit(3)


        def test_unchecked():
            unchecked(2)
    ''',
}


def _toy(tmp: Path) -> Path:
    for rel, text in TOY.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip())
    return tmp


def _statuses(root: Path) -> dict[str, str]:
    meta = json.loads((root / "mutants" / "spec" / "toy.py.meta").read_text())
    return {k.split(".")[-1]: R.STATUS.get(v, str(v)) for k, v in meta["exit_code_by_key"].items()}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = _toy(tmp_path_factory.mktemp("toy"))
    p = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.mutation_run", "--max-children", "2",
                        "--time-slack", "0.5"], cwd=root, capture_output=True, text=True, timeout=600, check=False,
                       env=ENV)
    return root, p


def test_each_status_is_the_one_the_toys_tests_allow(toy_run):
    root, p = toy_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = _statuses(root)
    by_function: dict[str, Counter] = {}
    for name, status in st.items():
        by_function.setdefault(name.split("__mutmut_")[0], Counter())[status] += 1
    assert set(by_function["x_sign"]) == {"killed"}, by_function["x_sign"]
    assert by_function["x_label"]["no tests"] >= 1  # the mutants of `return "seven"`
    assert by_function["x_label"]["killed"] >= 1  # `== 7` -> `!= 7` returns "seven" for 3
    assert by_function["x_count_to"]["timeout"] >= 1  # `i += 1` -> `i = 1`: loops
    assert "survived" not in by_function["x_count_to"]
    assert set(by_function["x_half"]) <= {"segfault", "suspicious", "killed"} and by_function["x_half"]
    assert set(by_function["x_unchecked"]) == {"survived"}
    assert set(by_function["x_scale"]) == {"killed"} and set(by_function["x_lookup"]) == {"killed"}, by_function
    assert "score" in p.stdout and "generation" in p.stdout


def test_no_test_is_run_on_a_mutant_whose_line_it_never_executes(toy_run):
    """Line-level selection: the rare branch's mutants get no test at all,
    the executed line's mutants get test_label and no other test."""
    root, _ = toy_run
    infos = {i.name.split(".")[-1]: i for i in R.load_mutants(root / "mutants")}
    st = _statuses(root)
    rare = [i for n, i in infos.items() if n.startswith("x_label") and st[n] == "no tests"]
    text = (root / "mutants" / "spec" / "toy.py").read_text().splitlines()
    assert rare and all(any('"seven"' in text[ln - 1] for ln in i.lines) for i in rare)
    # and, from the mutants' own source (not from the lines the runner gave
    # them): "no tests" exactly for the mutants of the line no test executes
    spans = json.loads((root / "mutants" / "spec" / "toy.py.spans").read_text())["spans"]

    def body(key: str) -> list[str]:
        lines = text[spans[key][0] - 1:spans[key][1]]
        return lines[next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ")) + 1:]

    orig = body("x_label__mutmut_orig")
    for name, status in st.items():
        if name.startswith("x_label"):
            changed = [o for o, m in zip(orig, body(name), strict=True) if o != m]
            assert changed and (status == "no tests") == any('"seven"' in o for o in changed), (name, status, changed)


def test_no_generate_and_only_run_the_named_mutants_of_the_folder_as_it_is(toy_run, tmp_path):
    """``--no-generate --only A B``: a copy of the toy's mutants/, with the
    statuses of two functions cleared, run again without generation (so the
    worker alone puts mutants/ first on sys.path: mutmut's generation in the
    parent is what also did it), on both prefixes' mutants and no others."""
    root, _ = toy_run
    copy = tmp_path / "toy"
    shutil.copytree(root, copy)
    before = _statuses(copy)
    meta_path = copy / "mutants" / "spec" / "toy.py.meta"
    meta = json.loads(meta_path.read_text())
    for k in meta["exit_code_by_key"]:
        if ".x_sign_" in k or ".x_unchecked_" in k:
            meta["exit_code_by_key"][k] = None
    meta_path.write_text(json.dumps(meta))
    p = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.mutation_run", "--no-generate", "--max-children", "1",
                        "--only", "spec.toy.x_sign_", "spec.toy.x_unchecked_"], cwd=copy, capture_output=True,
                       text=True, timeout=300, check=False, env=ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    after = _statuses(copy)
    assert after == before, {n: (before[n], after[n]) for n in before if before[n] != after[n]}
    assert "mutation: 10 mutants" in p.stdout, p.stdout


def test_results_are_read_by_mutmut_itself(toy_run):
    """The statuses go to mutmut's result files: ``mutmut results`` lists the
    survivor and not the killed mutants."""
    root, _ = toy_run
    mutmut = str(Path(sys.executable).parent / "mutmut")
    out = subprocess.run([mutmut, "results"], cwd=root, capture_output=True, text=True, timeout=120, check=False).stdout
    assert "x_unchecked__mutmut_1: survived" in out
    assert "x_sign" not in out


def test_mutant_lines_of_a_statement_spanning_lines(tmp_path):
    """A change inside a statement that spans lines selects the tests that run
    any of its lines (the smallest enclosing statement)."""
    src = ["def f(a, b):\n", "    return g(\n", "        a,\n", "        b + 1,\n", "    )\n"]
    assert R._statement_lines(src, [3]) == [1, 2, 3, 4]
    assert R._statement_lines(src, [0]) == [0, 1, 2, 3, 4]  # the def line: the whole function


def test_bad_max_children_is_refused_with_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.mutation_run", "--max-children", "0"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False, env=ENV)
    assert p.returncode == 2 and "--max-children" in p.stderr and "Traceback" not in p.stderr


def test_the_run_record_gives_each_mutant_its_status_cost_and_tests(toy_run):
    """mutants/mutation-run.json: per mutant its status (as in the .meta
    files), its test time, the tests run, the killing test, and the tests
    that execute its statement with their clean time (what it would cost
    as a survivor)."""
    root, _ = toy_run
    rec = json.loads((root / "mutants" / "mutation-run.json").read_text())
    st = _statuses(root)
    assert {k.split(".")[-1]: m["status"] for k, m in rec["mutants"].items()} == st
    assert rec["tests"] >= 8 and rec["cover_s"] > 0
    for name, m in rec["mutants"].items():
        short = name.split(".")[-1]
        if m["status"] == "no tests":
            assert m["selected"] == 0 and m["runs"] == 0 and m["killer"] is None
        else:
            assert m["selected"] >= 1 and m["selected_s"] >= 0
        if m["status"] == "killed":
            assert m["killer"].startswith("toytests/test_toy.py::") and 1 <= m["runs"] <= m["selected"], (short, m)
        if m["status"] == "survived":
            assert m["runs"] == m["selected"] and m["killer"] is None, (short, m)


def _argued(name: str, change: str):
    """A toy triage: every mutant of ``unchecked`` and of ``label``'s rare
    branch (its test never asks for 7 or 8) is 'equivalent'."""
    from kvspec.fuzz.commands.mutation_verdict import Verdict

    if ".x_unchecked_" in name or change in ('return "XXsevenXX"', 'return "SEVEN"', "if x == 8:"):
        return Verdict(name.rsplit("__mutmut_", 1)[0], change, "toy")
    return None


def test_a_triaged_equivalent_of_an_unchanged_file_is_not_run_again(toy_run, tmp_path):
    """The stamp: written for a file all of whose mutants have a status and
    whose every survivor has a verdict; with it, the verdicts' mutants are
    skipped (survived, no test run, listed as skipped) until the file's text
    changes. A file with a survivor no verdict covers is not stamped."""
    root, _ = toy_run
    copy = tmp_path / "toy"
    shutil.copytree(root, copy)
    stamps = copy / "docs" / "mutation-stamps.json"
    assert not stamps.exists()  # the toy's own run: survivors without a verdict, so no stamp
    assert R.update_stamps(copy, lambda n, c: None, set(), stamps) == []  # survivors without a verdict
    assert R.update_stamps(copy, _argued, {"spec.toy.x_sign__mutmut_1"}, stamps) == []  # a skip is no evidence
    assert R.update_stamps(copy, _argued, set(), stamps) == ["spec/toy.py"]
    assert json.loads(stamps.read_text()) == {"spec/toy.py": R.source_hash(copy / "spec" / "toy.py")}
    infos = R.load_mutants(copy / "mutants")
    skip = R.triaged_skips(copy, infos, R.read_stamps(stamps), _argued)
    st = _statuses(copy)
    unchecked = {i.name for i in infos if ".x_unchecked_" in i.name}
    assert unchecked and unchecked <= set(skip)
    assert all(st[n.split(".")[-1]] in ("survived", "no tests") for n in skip), skip
    # the file's text changes: nothing is skipped
    src = copy / "spec" / "toy.py"
    src.write_text(src.read_text() + "\n")
    assert R.triaged_skips(copy, infos, R.read_stamps(stamps), _argued) == {}
    src.write_text(src.read_text()[:-1])
    # a run given the skips runs no test on them and keeps them listed
    driver = textwrap.dedent("""
        import json, sys
        from pathlib import Path
        from kvspec.fuzz.commands import mutation_run as R
        skip = json.loads(sys.argv[1])
        rep = R.run(Path.cwd(), 1, only=set(skip), skip=skip)
        print(json.dumps({"skipped": rep.skipped, "statuses": rep.statuses, "runs": rep.runs}))
    """)
    only = {n: skip[n] for n in unchecked}
    p = subprocess.run([sys.executable, "-c", driver, json.dumps(only)], cwd=copy, capture_output=True, text=True,
                       timeout=300, check=False, env=ENV)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert sorted(out["skipped"]) == sorted(unchecked)
    assert all(out["statuses"][n] == R.SURVIVED for n in unchecked) and not out["runs"], out


def test_a_verdict_a_run_contradicts_is_stale_and_the_file_loses_its_stamp(toy_run, tmp_path):
    """A verdict that names a killed mutant alone is stale: listed, and the
    file is not stamped (a stamp it had is taken back), so its mutants all
    run until the verdict goes."""
    root, _ = toy_run
    copy = tmp_path / "toy"
    shutil.copytree(root, copy)
    stamps = copy / "docs" / "mutation-stamps.json"
    st = _statuses(copy)
    killed = next(n for n, s in sorted(st.items()) if n.startswith("x_sign") and s == "killed")

    def wrong(name: str, change: str):
        return _argued(name, change) or (_argued("spec.toy.x_unchecked_", change) if name.endswith(killed) else None)

    codes = json.loads((copy / "mutants" / "spec" / "toy.py.meta").read_text())["exit_code_by_key"]
    assert R.stale_verdicts(copy, codes, wrong) == [f"spec.toy.{killed}"]
    assert R.stale_verdicts(copy, codes, _argued) == []
    assert R.update_stamps(copy, _argued, set(), stamps) == ["spec/toy.py"]
    assert R.update_stamps(copy, wrong, set(), stamps) == [] and R.read_stamps(stamps) == {}


def test_a_verdict_matching_two_mutants_of_one_function_lets_neither_go_unrun():
    """Verdicts match on the function and the mutated line: the same line
    mutated the same way at two places is two mutants under one verdict,
    and only the named-alone ones may be skipped or called stale."""
    changes = {"m.x_f__mutmut_1": "cold = None", "m.x_f__mutmut_2": "cold = None", "m.x_f__mutmut_3": "n = 0",
               "m.x_g__mutmut_1": "cold = None"}
    assert set(R.sole_verdicts(changes, lambda n, c: c)) == {"m.x_f__mutmut_3", "m.x_g__mutmut_1"}


def test_a_file_whose_survivors_a_verdict_covers_only_in_part_is_not_stamped(toy_run, tmp_path):
    """Every survivor needs a verdict, the "no tests" ones too: the toy's
    triage less its verdicts on "no tests" mutants (label's rare branch)
    stamps nothing, nor does a triage of ``unchecked`` alone; the whole
    triage stamps the file."""
    root, _ = toy_run
    copy = tmp_path / "toy"
    shutil.copytree(root, copy)
    stamps = copy / "docs" / "mutation-stamps.json"
    st = _statuses(copy)
    assert any(s == "no tests" and n.startswith("x_label") for n, s in st.items())

    def partial(name: str, change: str):
        return _argued(name, change) if ".x_unchecked_" in name else None

    def survived_only(name: str, change: str):
        return _argued(name, change) if st[name.split(".")[-1]] != "no tests" else None

    assert R.update_stamps(copy, partial, set(), stamps) == [] and not stamps.exists()
    assert R.update_stamps(copy, survived_only, set(), stamps) == [] and not stamps.exists()
    assert R.update_stamps(copy, _argued, set(), stamps) == ["spec/toy.py"]


def test_a_file_with_an_unrun_mutant_or_no_source_is_not_stamped(toy_run, tmp_path):
    """A stamp needs every mutant of the file run: one without a status
    (a stopped run) stamps nothing; and a source that is gone is never
    stamped (its old stamp is kept, never replaced by a hash of nothing)."""
    root, _ = toy_run
    copy = tmp_path / "toy"
    shutil.copytree(root, copy)
    stamps = copy / "docs" / "mutation-stamps.json"
    meta_path = copy / "mutants" / "spec" / "toy.py.meta"
    meta = json.loads(meta_path.read_text())
    full = dict(meta["exit_code_by_key"])
    meta["exit_code_by_key"][next(k for k in full if ".x_sign_" in k)] = None
    meta_path.write_text(json.dumps(meta))
    assert R.update_stamps(copy, _argued, set(), stamps) == [] and not stamps.exists()
    meta["exit_code_by_key"] = full
    meta_path.write_text(json.dumps(meta))
    assert R.update_stamps(copy, _argued, set(), stamps) == ["spec/toy.py"]
    digest = R.source_hash(copy / "spec" / "toy.py")
    (copy / "spec" / "toy.py").unlink()
    assert R.update_stamps(copy, _argued, set(), stamps) == []
    assert R.read_stamps(stamps) == {"spec/toy.py": digest}
