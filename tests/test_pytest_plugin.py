"""The pytest plugin (fuzz/pytest_plugin.py, docs/targets.md): a user's suite,
in a folder outside this repository, runs kvspec's state machines against a
cache class of its own package, under its own Hypothesis profile and example
database; a planted bug fails with a shrunk kvtrace and its replay command.

The runs whose subject is a user's suite as it starts (the entry point, the
plugin's options and the user's package found from its own folder) are
child pytest processes (pytester's subprocess mode), as a user's suite
would be; the runs that check what a run reports (usage errors of the
plugin's options, the failure report, a replay from the example database,
a second run under the same seed) run in this process (pytester's
in-process mode), which spares each the start of a Python with MLX.

pytester's fixture snapshots sys.modules and, when its test ends, drops every
module first imported during the test; MLX's extension (nanobind) aborts the
process when imported a second time ("refusing to add duplicate key").  So
what the in-process parts below import (the replay, the campaign, MLX under
them) is imported here, at collection, before any snapshot, and stays."""

import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import mlx.core  # noqa: F401  (see the module docstring)
import pytest
from hypothesis import settings

import kvspec.fuzz.campaign
import kvspec.fuzz.replay  # (see the module docstring)
from kvspec.fuzz.commands.cli import main
from tests.target_examples import write_package

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

# parent "default": the same settings whether or not Hypothesis sees a CI
# environment (under CI=true its default profile is "ci", derandomized,
# and its fixed draws missed the planted bug in 50 examples). 150
# examples: the planted bug was caught at every seed tried (13 of 13;
# at 50, seed 3 of 10 missed it); the correct class runs them in about 4 s
settings.register_profile("user", parent=settings.get_profile("default"), max_examples=150, stateful_step_count=50,
                          database=DirectoryBasedExampleDatabase("{db}"))
settings.register_profile("nodb", parent=settings.get_profile("default"), max_examples=50, stateful_step_count=50,
                          database=None)
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
    # an in-process run loads the user's Hypothesis profile: this suite's comes back after the test
    profile = settings.get_current_profile_name()
    yield pytester, db
    settings.load_profile(profile)


def _run(pytester, *args):
    """The user's suite in a child pytest process."""
    plugin = () if _installed() else ("-p", "kvspec.fuzz.pytest_plugin")
    return pytester.runpytest_subprocess(*plugin, "-p", "no:cacheprovider", "--hypothesis-profile=user",
                                         "--kvspec-out=traces", *args, timeout=300)


def _run_here(pytester, *args):
    """The same run in this process (see the module's doc)."""
    plugin = () if _installed() else ("-p", "kvspec.fuzz.pytest_plugin")
    return pytester.runpytest_inprocess(*plugin, "-p", "no:cacheprovider", "--hypothesis-profile=user",
                                        "--kvspec-out=traces", *args)


def test_the_entry_point_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nkvspec = "kvspec.fuzz.pytest_plugin"' in text


def test_one_test_file_catches_a_planted_bug_and_writes_its_trace(suite, capsys):
    pytester, db = suite
    pytester.makepyfile(test_user_cache='''
from kvspec.fuzz.pytest_plugin import kvspec_test

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
    again = _run_here(pytester, "-q", "-k", "negative")
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


# -- a short report, a budget, a seed (issue 47) ---------------------------------------------
NEGATIVE = '''
from kvspec.fuzz.pytest_plugin import kvspec_test

test_negative_trim = kvspec_test("usercache.cache:NegativeTrimCache")
'''


def _failure_section(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "FAILURES" in line)
    end = next(i for i, line in enumerate(lines) if "short test summary" in line or line.startswith("FAILED ")
               or " failed" in line and i > start)
    return lines[start:end]


@pytest.mark.parametrize("how", ["kvspec_test", "--kvspec-target"])
def test_the_failure_report_is_the_divergence_and_its_replay_line(suite, how):
    """No frame of the harness (or of Hypothesis): the divergence, the trace,
    the replay command, in a few lines; the budget keeps it to seconds."""
    pytester, _ = suite
    if how == "kvspec_test":
        pytester.makepyfile(test_user_cache=NEGATIVE)
        args = ["-q"]
    else:
        args = ["-q", "--kvspec-target=usercache.cache:NegativeTrimCache"]
    result = _run_here(pytester, *args, "--hypothesis-profile=nodb", "--kvspec-budget=30", "--kvspec-seed=5")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    section = _failure_section(out)
    assert len(section) < 30, "\n".join(section)
    text = "\n".join(section)
    assert "usercache.cache:NegativeTrimCache dense/fp16 diverges from the spec" in text
    assert re.search(r"^replay it: kvspec replay \S+ --target usercache.cache:NegativeTrimCache$", text, re.MULTILINE), text
    for harness in ("pytest_plugin.py", "run_state_machine", "hypothesis", "Traceback", "def run_target"):
        assert harness not in text, (harness, text)


def test_the_seed_makes_two_runs_identical(suite):
    """The same --kvspec-seed, no example database and no shrinking: the same
    first failing example, byte for byte, in a child process and in this
    one; another seed draws another."""
    pytester, _ = suite
    pytester.makepyfile(test_user_cache=NEGATIVE)
    trace = pytester.path / "traces" / "usercache.cache_NegativeTrimCache-dense-fp16.json"
    got = []
    for run, seed in ((_run, 11), (_run_here, 11), (_run_here, 12)):
        result = run(pytester, "-q", "--hypothesis-profile=nodb", "--kvspec-budget=50", f"--kvspec-seed={seed}",
                     "--kvspec-shrinks=0")
        result.assert_outcomes(failed=1)
        got.append((trace.read_text(), "\n".join(_failure_section(result.stdout.str()))))
        trace.unlink()
    assert got[0] == got[1]
    assert got[0][0] != got[2][0]


@pytest.mark.parametrize("option", ["--kvspec-budget=0", "--kvspec-budget=many", "--kvspec-seed=-1",
                                    "--kvspec-shrinks=-2"])
def test_a_bad_budget_seed_or_shrinks_is_a_usage_error(suite, option):
    pytester, _ = suite
    result = _run_here(pytester, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert option.split("=")[0] in result.stderr.str() and "Traceback" not in result.stderr.str()


def test_the_budget_is_the_number_of_examples_run(tmp_path, monkeypatch):
    """--kvspec-budget N runs N examples of a correct class (in process:
    the machine counts its runs), whatever the profile's max_examples."""
    from kvspec.fuzz.pytest_plugin import RunOptions, run_target

    write_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "usercache" or m.startswith("usercache.")]:
        monkeypatch.delitem(sys.modules, mod)
    machines = []
    real = kvspec.fuzz.campaign.machine_for

    def spy(*args, **kwargs):
        machines.append(real(*args, **kwargs))
        return machines[-1]

    monkeypatch.setattr(kvspec.fuzz.campaign, "machine_for", spy)
    for budget in (3, 7):
        run_target("usercache.cache:ListCache", "dense", "fp16", tmp_path / "out", RunOptions(budget=budget, seed=1))
        assert machines[-1].runs == budget


def test_a_capability_gap_skips_and_a_harness_crash_is_not_a_divergence(tmp_path, monkeypatch):
    """What is not a divergence is never reported as one: the target that
    cannot run the machine is a skip with its reason; the harness's own
    exception propagates as itself (its traceback), not as KvspecFailure."""
    import hypothesis.stateful

    from kvspec.fuzz.pytest_plugin import KvspecFailure, RunOptions, run_target
    from kvspec.fuzz.targets import TargetCapabilityError

    def gap(*args, **kwargs):
        raise TargetCapabilityError("target x cannot run op fork")

    def crash(*args, **kwargs):
        raise RuntimeError("the harness fell over")

    monkeypatch.setattr(hypothesis.stateful, "run_state_machine_as_test", gap)
    with pytest.raises(pytest.skip.Exception, match="not applicable: target x cannot run op fork"):
        run_target("impl", "dense", "fp16", tmp_path, RunOptions(budget=1))
    monkeypatch.setattr(hypothesis.stateful, "run_state_machine_as_test", crash)
    with pytest.raises(RuntimeError, match="the harness fell over") as info:
        run_target("impl", "dense", "fp16", tmp_path, RunOptions(budget=1))
    assert not isinstance(info.value, KvspecFailure)
    assert not list(tmp_path.iterdir())  # no trace written for what is not a divergence
