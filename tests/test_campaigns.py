"""Campaigns beyond one process: the Hypothesis example database every
worker shares (docs/campaigns.md). A failure one worker finds is replayed
first by the next, from a local folder or from a real ``redis-server`` on
the loopback address; killing a worker loses nothing it found."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_cli

REPO = Path(__file__).resolve().parent.parent
BUG = "inplace_after_trim"
TIMEOUT = 240
#: for the runs that only ask how soon the bug is caught (examples_to_catch):
#: their failure is not shrunk (the shrink is timed apart and is not what
#: these tests check; the run that saves the failure still shrinks it)
NO_SHRINK = ("--shrink-budget", "0")


def fuzz(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "kvspec.fuzz.commands.cli", "fuzz", "--bug", BUG, "--inplace", "on",
                             *argv], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def warm_fuzz(*argv: str) -> subprocess.CompletedProcess:
    """The same command on a warm worker (tests/warm_cli.py): for the runs
    whose process is not what is checked."""
    return warm_cli.kvspec("fuzz", "--bug", BUG, "--inplace", "on", *argv, timeout=TIMEOUT)


def finish(proc: subprocess.Popen | subprocess.CompletedProcess) -> dict:
    if isinstance(proc, subprocess.Popen):
        out, err = proc.communicate(timeout=TIMEOUT)
    else:
        out, err = proc.stdout, proc.stderr
    assert proc.returncode == 1, out + err  # the bug is caught
    (run,) = json.loads(out)["runs"]
    return run


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    """Seed 7 with no database: it needs more than one example to catch the
    bug by itself (the tests below show a saved failure makes it one)."""
    run = finish(warm_fuzz("--budget", "30", "--seed", "7", "--json", "--db", "none",
                           "--out", str(tmp_path_factory.mktemp("control")), *NO_SHRINK))
    assert run["examples_to_catch"] > 1  # this seed does not catch it at once by itself
    return run


def test_a_failure_saved_in_a_folder_is_replayed_first(tmp_path, control):
    db = str(tmp_path / "db")
    first = finish(warm_fuzz("--budget", "30", "--seed", "3", "--json", "--db", db, "--out", str(tmp_path)))
    assert first["result"] == "FAILED" and any((tmp_path / "db").iterdir())
    # another process replays it
    again = finish(fuzz("--budget", "30", "--seed", "7", "--json", "--db", db, "--out", str(tmp_path), *NO_SHRINK))
    assert again["examples_to_catch"] == 1, again  # the saved failure ran first


def test_a_bad_database_is_refused_before_any_work(tmp_path):
    (tmp_path / "f").write_text("")
    for where, needle in ((str(tmp_path / "f"), "is not a folder"), ("redis://127.0.0.1:1", "cannot reach")):
        proc = warm_fuzz("--budget", "5", "--db", where)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 2 and needle in out + err and "Traceback" not in err


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server on 127.0.0.1 (Debian's package), started and
    stopped here; skipped with the reason when it is not installed."""
    pytest.importorskip("redis", reason="the redis client is missing: pip install 'hypothesis[redis]'")
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; .ci/run installs it with apt-get)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.1)
    try:
        yield f"redis://127.0.0.1:{port}", client
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_two_workers_share_one_redis_database_and_a_killed_worker_loses_nothing(redis_url, tmp_path, control):
    url, client = redis_url
    # worker A finds the bug and is killed (SIGKILL) while it shrinks
    a = fuzz("--budget", "300", "--seed", "3", "--db", url, "--out", str(tmp_path / "a"))
    deadline = time.monotonic() + TIMEOUT
    line = ""
    while "failure found" not in line and time.monotonic() < deadline and a.poll() is None:
        line = a.stderr.readline()
    assert "failure found" in line, "worker A never found the bug"
    while not client.keys(b"kvspec-examples*") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.keys(b"kvspec-examples*"), "worker A saved nothing in Redis"
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=60)
    assert a.returncode == -signal.SIGKILL
    # worker B, another process with the seed that alone needs more examples,
    # replays A's failure first
    b = finish(fuzz("--budget", "30", "--seed", "7", "--json", "--db", url, "--out", str(tmp_path / "b"), *NO_SHRINK))
    assert b["examples_to_catch"] == 1, b
    assert json.loads(Path(b["trace"]).read_text())["ops"]  # and writes its kvtrace as always


PROBE = """
import json, sys
import kvspec.fuzz.hypofuzz_targets as t
from hypothesis import settings
tests = t.build()
s = settings()
print(json.dumps({"db": getattr(s.database, "path", None) and str(s.database.path), "db_type": type(s.database).__name__,
                  "derandomize": s.derandomize, "steps": s.stateful_step_count, "want_steps": t.STEPS,
                  "classes": sorted(tests),
                  "class_settings": [[str(getattr(c.settings.database, "path", None)), c.settings.derandomize]
                                     for c in tests.values()]}))
"""


@pytest.mark.parametrize("ci", [False, True])
def test_the_campaign_targets_use_the_database_and_settings_asked_for(tmp_path, ci):
    """The settings HypoFuzz's workers run under are the campaign's own, with
    or without CI in the environment (Hypothesis's "ci" profile sets
    derandomize=True and no database; a campaign profile inheriting either
    collects nothing or searches without the shared database)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update({"KVSPEC_CAMPAIGN_DB": str(tmp_path / "db"), "KVSPEC_CAMPAIGN_ONLY": "dense/fp16/copy",
                "KVSPEC_CAMPAIGN_OUT": str(tmp_path / "out"), "PYTHONPATH": str(REPO)})
    if ci:
        env["CI"] = "true"
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["db_type"] == "DirectoryBasedExampleDatabase" and got["db"] == str(tmp_path / "db"), got
    assert got["derandomize"] is False and got["steps"] == got["want_steps"], got
    assert got["classes"] == ["Test_dense_fp16_copy"]
    assert got["class_settings"] == [[str(tmp_path / "db"), False]], got
