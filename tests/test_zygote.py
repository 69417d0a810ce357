"""The zygote (kvspec.fuzz.zygote) behind kvspec verify's proof obligations:
each call runs in a child forked for it alone, so nothing one call leaves
behind reaches the next (the reason each obligation used to start a fresh
interpreter); a child or a zygote that gives no result is a tool failure;
a zygote whose caller goes away leaves nothing running; its children's CPU
seconds are counted; it never holds MLX."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvspec.fuzz import zygote
from kvspec.fuzz.commands import verify

#: a probe run in a zygote's child (runpy.run_path): prints the state an
#: earlier call could have left (the proofs' fresh-name counter, Z3's main
#: context, a module global of the project), then changes all three
PROBE = """\
import json, z3
from kvspec.proofs import domain
from kvspec.fuzz import kinds
print(json.dumps({"counter": repr(domain._counter), "z3_context": z3.z3._main_ctx is not None,
                  "global": getattr(kinds, "LEFT_BY_A_CALL", None)}))
next(domain._counter); z3.Int("x"); kinds.LEFT_BY_A_CALL = 1
"""
FRESH = {"counter": "count(0)", "z3_context": False, "global": None}


def _probe(z: zygote.Zygote, path: str) -> dict:
    import json

    done = z.run("runpy:run_path", (path,))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_no_obligation_sees_what_an_earlier_one_left(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (check,) = verify.check_obligation(5)  # the obligation's child names variables and builds a Z3 context
    assert check.ok, check.detail
    z = zygote.shared(verify.PROOF_PRELOAD)  # the zygote check_obligation forked it from
    assert _probe(z, str(probe)) == FRESH
    assert _probe(z, str(probe)) == FRESH  # the first probe's changes are gone too
    (again,) = verify.check_obligation(5)
    assert (again.ok, again.detail) == (check.ok, check.detail)  # the same verdict from the same Z3 units


def test_an_obligation_whose_process_dies_is_a_tool_failure_and_the_next_zygote_works(tmp_path, monkeypatch):
    # a real death: every child of a zygote started with this site hook exits 7 at once, with no output
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.register_at_fork(after_in_child=lambda: os._exit(7))\n")
    monkeypatch.setenv("PYTHONPATH", str(site), prepend=os.pathsep)
    (check,) = verify.check_obligation(5)
    assert not check.ok and check.tool_failure and "gave no result (exit 7)" in check.detail
    # a zygote that itself dies during the call: no result either, and its exit code said
    (site / "sitecustomize.py").write_text("import os\nos.register_at_fork(after_in_parent=lambda: os._exit(9))\n")
    monkeypatch.setenv("KVSPEC_TEST_ZYGOTE", "dies")  # a changed environment: a new zygote, with the new hook
    (check,) = verify.check_obligation(5)
    assert not check.ok and check.tool_failure and "gave no result (exit 9)" in check.detail
    monkeypatch.undo()  # this process's environment as it was: a new zygote without the hook
    (check,) = verify.check_obligation(5)
    assert check.ok, check.detail


def test_a_zygote_whose_caller_goes_away_kills_the_child_it_runs(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    pid_file = tmp_path / "pid"
    sleeper.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    z = zygote.Zygote(("os",))
    got: list = []
    caller = threading.Thread(target=lambda: got.append(z.run("runpy:run_path", (str(sleeper),))))
    caller.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert z.proc.stdin is not None
    z.proc.stdin.close()  # what a worker killed by the hang guard does to its end of the pipe
    caller.join(30)
    assert not caller.is_alive() and got[0].returncode == 0 and got[0].stdout == ""
    assert z.proc.wait(10) == 0
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # killed and reaped by the zygote before it exited
            os.kill(child, 0)
            time.sleep(0.05)
    z.close()


def test_a_child_runs_like_python_c_and_its_cpu_seconds_are_counted(tmp_path):
    burn = tmp_path / "burn.py"
    burn.write_text("import time\nwhile time.process_time() < 0.3:\n    pass\nprint(time.process_time())\n")
    z = zygote.Zygote(("os",))
    try:
        before = z.cpu
        done = z.run("runpy:run_path", (str(burn),))
        assert done.returncode == 0 and z.cpu - before >= float(done.stdout)
        assert z.run("os:_exit", (3,)).returncode == 3
        assert z.run("os:abort").returncode == -6  # killed by SIGABRT, as subprocess says it
        failed = z.run("kvspec.no_such_module:f")
        assert failed.returncode == 1 and "ModuleNotFoundError" in failed.stderr and failed.stdout == ""
        assert z.run("builtins:print", ("after all that",)).stdout == "after all that\n"
    finally:
        z.close()


def test_a_zygote_never_holds_mlx():
    z = zygote.Zygote(("mlx.core",))
    assert z.failed and "mlx.core" in z.failed and not z.alive()
    done = z.run("builtins:print", ("never",))
    assert done.returncode != 0 and done.stdout == "" and "mlx.core" in done.stderr
