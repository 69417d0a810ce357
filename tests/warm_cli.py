"""``kvspec`` commands on a warm worker instead of a fresh process each.

Most command-line tests ask what a command prints and which exit status it
gives, not what a new process does. Started one process each, every such
test paid for a Python start and for importing MLX, the spec, Hypothesis
and the fuzz machinery, often several times what the command then did.
:func:`kvspec` runs ``kvspec ARGV`` as ``kvspec.fuzz.commands.cli.main(ARGV)`` on a
worker of :class:`kvspec.fuzz.workers.WarmPool` (one per test process, started on
first use) and gives back what a child process would: its exit status
(``main``'s return, argparse's ``SystemExit``, or 1 with the traceback on
stderr for an exception that escapes ``main``, as ``python -m`` would
print it), and its stdout and stderr read at the file descriptors, so
output written past ``sys.stdout`` (a C library, ``os.write``) is kept.

What a fresh process gave for free is kept:

* **isolation**: the environment and the working directory are the ones
  the call names, restored afterwards; the pool's isolation guard compares
  the worker's module state after each call: a call that changed it fails
  its test, naming what changed (and the worker is replaced before the
  next call);
* **a hang guard**: a call past ``timeout`` seconds is stopped (its worker
  killed and replaced) and the test fails naming it.

Tests where the process boundary is what is checked (a signal, ``sys.path``
at start, an install, the exit of ``python -m``) keep starting a real child
process; so do commands that start processes of their own
(``multiprocessing`` refuses children of a pool's daemonic worker).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from kvspec.fuzz.workers import DEFAULT_PRELOAD, WarmPool

        _POOL = WarmPool(1, preload=(*DEFAULT_PRELOAD, "kvspec.fuzz.commands.cli"))
        _POOL.__enter__()
    return _POOL


def _set_environ(env: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``env``, touching only the names whose value
    differs (an entry set again to the value it had would still be a new
    object in the environment's own mapping, which the isolation guard
    compares)."""
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def run_main(argv: list[str], env: dict[str, str], cwd: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``kvspec ARGV`` run in this process
    with environment ``env`` in folder ``cwd`` (both restored after). A task
    of the warm worker; not for the test process itself."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_raw = dict(getattr(os.environ, "_data", {}))
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        try:
            _set_environ(env)
            os.chdir(cwd)
            from kvspec.fuzz.commands.cli import main

            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse: usage errors, --help, --version
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what `python -m` prints, and its exit status
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.chdir(saved_cwd)
            _set_environ(saved_env)
            raw = getattr(os.environ, "_data", None)
            if raw is not None:  # the very objects it held, which the isolation guard compares
                raw.clear()
                raw.update(saved_raw)
        out.seek(0)
        err.seek(0)
        return int(code or 0), out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")


def kvspec(*argv: str, cwd: Path | str = REPO, env: dict[str, str] | None = None,
           timeout: float = 240.0) -> subprocess.CompletedProcess:
    """``kvspec ARGV`` on the warm worker, as a CompletedProcess (see the
    module's doc). ``env``: the whole environment (default: this
    process's)."""
    from kvspec.fuzz.workers import Task

    task = Task("tests.warm_cli:run_main", (list(argv), dict(os.environ if env is None else env), str(cwd)),
                limit=timeout, name="kvspec " + " ".join(argv))
    (result,) = _pool().map([task])
    if result.status == "leaked":  # the worker was replaced, but the command changed what it should not
        raise AssertionError(f"kvspec {' '.join(argv)}: left its worker changed: {result.leaked}")
    if result.status != "ok":
        raise AssertionError(f"kvspec {' '.join(argv)}: {result.status}: {result.error}")
    code, out, err = result.value
    return subprocess.CompletedProcess(["kvspec", *argv], code, out, err)
