"""``kvspec mutants --changed BASE`` on a sample PR in a temp clone of this
repository (never in the worktree): a planted weak test leaves a survivor,
reported with its file:line and its mutation; a change whose mutants are all
killed reports none (exit 0). The clone's ``[tool.mutmut]`` test selection
is narrowed to the planted test file so that each run is a handful of
mutants and a few seconds; everything else (source paths, fork-server
isolation) is the repository's own configuration."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest

from kvspec.fuzz.commands import mutation_changed as mc
from tests import warm_cli

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "fuzz" / "schemas" / "mutants-changed.schema.json").read_text())

STRONG = '''

def sample_blocks_needed(length: int, block_size: int) -> int:
    """Blocks of ``block_size`` rows that hold ``length`` rows."""
    return -(-length // block_size)
'''
STRONG_TEST = '''
from kvspec.spec.paged import sample_blocks_needed


def test_sample_blocks_needed_every_small_case():
    for bs in range(1, 5):
        for n in range(0, 13):
            assert sample_blocks_needed(n, bs) == (n + bs - 1) // bs
'''
WEAK = '''

def sample_clamp_offset(offset: int, capacity: int) -> int:
    """``offset`` clamped to ``[0, capacity]``."""
    return max(0, min(offset, capacity))
'''


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return _make_clone(tmp_path_factory)


def _make_clone(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("pr") / "kvspec"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(repo)], check=True)
    _git(repo, "config", "user.email", "t@example.invalid")
    _git(repo, "config", "user.name", "test")
    _git(repo, "checkout", "--quiet", "-b", "sample-pr")
    py = repo / "pyproject.toml"
    text = py.read_text()
    text = re.sub(r"pytest_add_cli_args_test_selection = \[.*?\]\n",
                  'pytest_add_cli_args_test_selection = ["tests/test_sample_pr.py"]\n', text, flags=re.DOTALL)
    py.write_text(text)
    # commit 1: the strong change
    (repo / "spec" / "paged.py").write_text((repo / "spec" / "paged.py").read_text() + STRONG)
    (repo / "tests" / "test_sample_pr.py").write_text(STRONG_TEST)
    _git(repo, "add", "-A")
    _git(repo, "commit", "--quiet", "-m", "sample: a change its tests pin down")
    return repo


def test_all_killed_reports_none(clone: Path) -> None:
    report = mc.run_changed(clone, "HEAD~1", max_children=2)
    assert set(report.changed) == {"spec/paged.py"}
    assert report.mutants, "the change must breed mutants, or this test checks nothing"
    assert report.survivors == [], [m.to_json() for m in report.survivors]
    assert all(m.file == "spec/paged.py" and m.line in report.changed["spec/paged.py"] for m in report.mutants)
    doc = report.to_json()
    jsonschema.validate(doc, SCHEMA)
    assert doc["ok"] and doc["exit"] == 0 and doc["survived"] == 0


SLOW_WEAK_TEST = '''
import time
from kvspec.spec.paged import sample_clamp_offset

def test_sample_clamp_offset_slowly():  # planted weak test that takes 2 s of wall time
    time.sleep(2.0)
    assert sample_clamp_offset(3, 8) == 3
'''


def test_planted_weak_test_survivor_reported(clone: Path) -> None:
    """The survivor of a planted weak test is reported with its line and
    diff. The weak test is a slow one (2 s of wall time): mutmut's runner
    stopped a mutant on wall time ((its tests' time + 1 s) x
    ``timeout_multiplier``), so on a busy machine a survivor became a
    "timeout" (detected) and the planted weak test reported nothing. The
    runner's limit is per test, 4 x that test's own clean duration + 3 s, so
    a test that sleeps 2 s gives its survivor 11 s; a timeout is retried at
    5x before it stands (tests/test_mutation_run_units.py checks the retry on
    a simulated clock)."""
    # uncommitted, on top of the strong commit: only the weak change is new
    paged = clone / "spec" / "paged.py"
    paged.write_text(paged.read_text() + WEAK)
    (clone / "tests" / "test_sample_pr.py").write_text(STRONG_TEST + SLOW_WEAK_TEST)
    line = paged.read_text().splitlines().index("    return max(0, min(offset, capacity))") + 1
    report = mc.run_changed(clone, "HEAD", max_children=2)
    assert report.changed == {"spec/paged.py": set(range(line - 4, line + 1))}
    assert report.survivors, "the planted weak test must leave a survivor"
    for m in report.mutants:
        assert m.line == line and m.source == "return max(0, min(offset, capacity))"
    for m in report.survivors:
        assert "-    return max(0, min(offset, capacity))" in m.diff
        assert re.search(r"^\+    return .*$", m.diff, re.MULTILINE)
    doc = report.to_json()
    jsonschema.validate(doc, SCHEMA)
    assert not doc["ok"] and doc["exit"] == 1
    assert {s["line"] for s in doc["survivors"]} == {line}


def test_cli_exit_status_and_bad_revision(clone: Path) -> None:
    # this tree's CLI (not the clone's committed copy), run in the clone (on a warm worker: tests/warm_cli.py)
    p = warm_cli.kvspec("mutants", "--changed", "no-such-rev", "--json", cwd=clone)
    assert p.returncode == 2, p.stderr
    doc = json.loads(p.stdout)
    assert "no-such-rev" in doc["error"] and "--changed" in doc["error"]
    jsonschema.validate(doc, SCHEMA)


def test_parse_diff_hunks() -> None:
    diff = ("diff --git a/spec/x.py b/spec/x.py\n--- a/spec/x.py\n+++ b/spec/x.py\n"
            "@@ -3,0 +4,2 @@\n+a\n+b\n@@ -10 +12 @@\n-c\n+d\n@@ -20,3 +22,0 @@\n-e\n"
            "--- a/impl/gone.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-f\n"
            "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-g\n+h\n")
    assert mc.parse_diff(diff) == {"spec/x.py": {4, 5, 12}}


def test_a_new_file_and_a_changed_first_line_count(clone: Path) -> None:
    """Every line of a new file of a mutated package counts once it is
    tracked (``git add -N`` is enough; an untracked file is not part of the
    change), and a change to a function's ``def`` line alone counts that
    line (a default value is a mutable node there). A diff restricted to
    modified files (``--diff-filter=M``) passed every other test here."""
    new = clone / "spec" / "sample_new.py"
    body = "def twice(x: int) -> int:\n    return 2 * x\n\n\ndef half(x: int = 2) -> int:\n    return x // 2\n"
    new.write_text(body)
    paged = clone / "spec" / "paged.py"
    before = paged.read_text()
    lines = before.splitlines(keepends=True)
    at = lines.index("def sample_blocks_needed(length: int, block_size: int) -> int:\n")
    lines[at] = "def sample_blocks_needed(length: int, block_size: int = 4) -> int:\n"
    paged.write_text("".join(lines))
    try:
        assert "spec/sample_new.py" not in mc.changed_lines(clone, "HEAD")
        _git(clone, "add", "-N", "spec/sample_new.py")
        changed = mc.changed_lines(clone, "HEAD")
        assert changed["spec/sample_new.py"] == set(range(1, 7)), changed
        assert at + 1 in changed["spec/paged.py"], changed
    finally:
        _git(clone, "rm", "--cached", "--quiet", "spec/sample_new.py")
        new.unlink()
        paged.write_text(before)
