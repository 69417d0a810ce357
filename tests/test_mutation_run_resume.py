"""``python -m kvspec.fuzz.commands.mutation_run --resume``: a stopped run goes on
where it was. The toy project of tests/test_mutation_run.py is run once; one
mutant's status is then cleared, as a run stopped before it would leave it,
and the resumed run checks that mutant alone and gives it its status again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvspec.fuzz.commands.mutation_report import _diff, change_of
from tests.test_mutation_run import ENV, _toy


def _run(root, *args):
    return subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.mutation_run", "--max-children", "1",
                           "--time-slack", "0.5", *args], cwd=root, capture_output=True, text=True,
                          timeout=600, check=False, env=ENV)


def test_resume_runs_only_the_mutants_without_a_status(tmp_path, monkeypatch):
    root = _toy(tmp_path)
    first = _run(root, "--only", "spec.toy.x_sign", "spec.toy.x_unchecked")
    assert first.returncode == 0, first.stdout + first.stderr
    meta_path = root / "mutants" / "spec" / "toy.py.meta"
    meta = json.loads(meta_path.read_text())
    codes = meta["exit_code_by_key"]
    assert codes["spec.toy.x_sign__mutmut_1"] == 1 and codes["spec.toy.x_unchecked__mutmut_1"] == 0
    assert codes["spec.toy.x_label__mutmut_1"] is None  # not in --only: not checked
    # the report's diff of a survivor, made in process, is mutmut show's
    mutmut = str(Path(sys.executable).parent / "mutmut")
    shown = subprocess.run([mutmut, "show", "spec.toy.x_unchecked__mutmut_1"], cwd=root, capture_output=True,
                           text=True, timeout=120, check=False).stdout
    monkeypatch.chdir(root)
    assert change_of("x", _diff(mutmut, "spec.toy.x_unchecked__mutmut_1")) == change_of("x", shown) != "(no diff)"
    codes["spec.toy.x_sign__mutmut_1"] = None
    meta_path.write_text(json.dumps(meta))
    again = _run(root, "--no-generate", "--resume", "--only", "spec.toy.x_sign", "spec.toy.x_unchecked")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "mutation: 1 mutants: 1 killed" in again.stdout
    assert json.loads(meta_path.read_text())["exit_code_by_key"]["spec.toy.x_sign__mutmut_1"] == 1
    nothing = _run(root, "--no-generate", "--resume", "--only", "spec.toy.x_sign")
    assert nothing.returncode == 0 and "mutation: 0 mutants" in nothing.stdout


def test_a_worker_that_would_run_the_original_code_is_refused(tmp_path):
    """If the tests import the original tree instead of mutants/ (a conftest
    that puts it first on sys.path), every mutant would survive: the runner
    stops with exit 2 and names the module instead."""
    root = _toy(tmp_path)
    (root / "toytests" / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(root)!r})\nfor m in [m for m in sys.modules if m.startswith('spec')]:\n"
        "    del sys.modules[m]\nimport spec.toy\n")
    p = _run(root, "--only", "spec.toy.x_sign")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "import the original tree" in p.stderr and "spec.toy" in p.stderr and "Traceback" not in p.stderr
