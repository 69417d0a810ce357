"""The pytest plugin (fuzz/pytest_plugin.py, docs/targets.md): a user's suite,
in a folder outside this repository, runs kvspec's state machines against a
cache class of its own package, under its own Hypothesis profile and example
database; a planted bug fails with a shrunk kvtrace and its replay command.

Each run is a child pytest process (pytester's subprocess mode), as a
user's suite would be."""

import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from fuzz.commands.cli import main
from tests.target_examples import write_package

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

settings.register_profile("user", max_examples=50, stateful_step_count=50,
                          database=DirectoryBasedExampleDatabase("{db}"))
'''


def _installed() -> bool:
    return any(ep.name == "kvspec" for ep in entry_points(group="pytest11"))


@pytest.fixture
def suite(pytester, tmp_path, monkeypatch):
    """A user's project: the package ``usercache`` and a conftest with a
    Hypothesis profile ``user`` whose example database is a folder."""
    write_package(pytester.path)
    db = tmp_path / "hypothesis-db"
    pytester.makeconftest(CONFTEST.format(db=db))
    # for this test only (a later test in the same worker must not inherit it)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return pytester, db


def _run(pytester, *args):
    plugin = () if _installed() else ("-p", "fuzz.pytest_plugin")
    return pytester.runpytest_subprocess(*plugin, "-p", "no:cacheprovider", "--hypothesis-profile=user",
                                         "--kvspec-out=traces", *args, timeout=300)


def test_the_entry_point_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nkvspec = "fuzz.pytest_plugin"' in text


def test_one_test_file_catches_a_planted_bug_and_writes_its_trace(suite, capsys):
    pytester, db = suite
    pytester.makepyfile(test_user_cache='''
from fuzz.pytest_plugin import kvspec_test

test_list_cache = kvspec_test("usercache.cache:ListCache")
test_negative_trim = kvspec_test("usercache.cache:NegativeTrimCache")
''')
    result = _run(pytester, "-q")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "usercache.cache:NegativeTrimCache dense/fp16 diverges from the spec" in out
    m = re.search(r"replay it: kvspec replay (\S+) --target usercache.cache:NegativeTrimCache", out)
    assert m, out[-3000:]
    trace = m.group(1)
    assert Path(trace).is_file() and Path(trace).parent == pytester.path / "traces"
    # the shrunk trace replays: diverges on the class, passes on the correct one and on ours
    sys.path.insert(0, str(pytester.path))
    try:
        assert main(["replay", trace, "--target", "usercache.cache:NegativeTrimCache"]) == 1
        assert main(["replay", trace, "--target", "usercache.cache:ListCache"]) == 0
        assert main(["replay", trace]) == 0
    finally:
        sys.path.remove(str(pytester.path))
        for mod in [m for m in sys.modules if m.startswith("usercache")]:
            del sys.modules[mod]
    capsys.readouterr()
    # the failure went into the profile's example database, so the next run replays it first
    assert db.is_dir() and any(db.rglob("*"))
    again = _run(pytester, "-q", "-k", "negative")
    again.assert_outcomes(failed=1)


def test_kvspec_target_option_adds_the_tests(suite):
    pytester, _ = suite
    result = _run(pytester, "-q", "-rf", "--kvspec-target=usercache.cache:ListCache",
                  "--kvspec-target=usercache.cache:NegativeTrimCache")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "kvspec[usercache.cache:NegativeTrimCache][dense/fp16]" in out and "replay it: kvspec replay" in out
    assert "FAILED kvspec[usercache.cache:ListCache]" not in out
    assert list((pytester.path / "traces").glob("usercache.cache_NegativeTrimCache-dense-fp16.json"))


def test_a_bad_target_is_a_usage_error(suite):
    pytester, _ = suite
    result = _run(pytester, "--kvspec-target=usercache.cache:Nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "Nope" in result.stderr.str()
