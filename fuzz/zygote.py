"""A zygote: a process that imports once and forks one fresh child per call.

Some work must start from the same process state whatever ran before it:
Z3's search is not a function of its input and seed alone, and a search
that ends in a second in a fresh interpreter ran for minutes inside a warm
worker that had run other jobs. A fresh ``python -c`` per call gives that,
at the price of an interpreter start and the imports (about a quarter of a
second of CPU each time, often more than the work). A :class:`Zygote`
pays it once::

    z = Zygote(("kvspec.fuzz.commands.verify", "kvspec.proofs.cli:obligations"))
    done = z.run("kvspec.fuzz.commands.verify:print_obligation_checks", (5,))
    done.returncode, done.stdout, done.stderr  # as subprocess.run(..., capture_output=True, text=True)

* **The zygote** is a new interpreter (started with ``sys.executable``, in
  this process's working folder and environment), never a fork of the
  caller: the caller may have evaluated MLX arrays, and MLX hangs in a
  forked child once its parent did. It imports ``preload`` (a
  ``"module:function"`` entry is called with no argument, to import what
  the function imports) and runs nothing else; it refuses to start when its
  preload loaded ``mlx.core``.
* **Each call** forks one child from the zygote's state after the preload,
  runs ``func(*args)`` in it, and the child exits: no child runs two calls,
  so a module global one call sets is gone for the next. The child's
  standard input is ``/dev/null``; its standard output and error are
  returned whole, with its exit code (negative: killed by that signal),
  as a :class:`subprocess.CompletedProcess`. A call whose function raises
  exits 1 with the traceback on its standard error, as ``python -c`` does.
* **A zygote that dies** gives the call it was serving a result with no
  standard output, its exit code and what it wrote; the next call starts a
  new one. :func:`shared` also starts a new one when this process's
  environment or working folder changed since the last one started (a
  fresh process would have seen the change).
* **Nothing is left running.** The zygote exits when this process closes
  its end of the pipe (or dies: a killed worker); a child still running
  then is killed first.
* **CPU seconds.** The zygote's children are its own, not this process's,
  so ``getrusage(RUSAGE_CHILDREN)`` here does not count them until the
  zygote is reaped: :func:`cpu` gives the CPU seconds of the live zygotes
  and their finished children, as of their last reply, for a caller that
  measures a task's CPU (``kvspec.fuzz.workers``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

#: the zygote of each preload this process started and that still runs
#: (:func:`shared`)
_ZYGOTES: dict[tuple[str, ...], Zygote] = {}


class Zygote:
    """One zygote process (see the module's doc). ``preload``: module names
    and ``"module:function"`` entries, imported (and called) once. Not
    thread-safe: one call at a time."""

    def __init__(self, preload: tuple[str, ...] | list[str]):
        self.preload = tuple(preload)
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        #: CPU seconds of the zygote itself and of its finished children, as
        #: of its last reply
        self.cpu = 0.0
        #: what the zygote process itself wrote (its preload's warnings, its
        #: own crash); the children's output comes back with each call
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        code = f"from kvspec.fuzz.zygote import serve; serve({list(self.preload)!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log)
        self.failed: str | None = None
        reply = self._reply()
        if reply is None:
            self.failed = f"the zygote exited (code {self.proc.returncode}) while importing its preload: {self._tail()}"
        elif "failed" in reply:
            self.failed = reply["failed"]
            self.close()
        else:
            self.cpu = reply["cpu"]

    # -- life cycle
    def alive(self) -> bool:
        return self.failed is None and self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (and a child it still runs) and reap it: from then
        on its CPU seconds are in this process's ``RUSAGE_CHILDREN``."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        self.cpu = 0.0
        if _ZYGOTES.get(self.preload) is self:
            del _ZYGOTES[self.preload]

    def _reply(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        try:
            line = self.proc.stdout.readline()
        except (OSError, ValueError):
            line = b""
        if not line:
            self.proc.wait()
            self.cpu = 0.0  # reaped: its CPU seconds are in this process's RUSAGE_CHILDREN now
            return None
        return json.loads(line)

    def _tail(self) -> str:
        try:
            self._log.seek(0)
            return self._log.read().decode(errors="replace").strip()[-400:]
        except (OSError, ValueError):
            return ""

    # -- calls
    def run(self, func: str, args: tuple | list = ()) -> subprocess.CompletedProcess:
        """``func(*args)`` (``"module:function"``; ``args`` JSON values) in a
        new child of the zygote. A zygote that failed to start, or dies
        during the call, gives a result with no standard output and its own
        exit code and message."""
        argv = [func, *args]
        if self.failed is not None:
            return subprocess.CompletedProcess(argv, 1, "", self.failed)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"func": func, "args": list(args)}) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it died: the reply says how
        reply = self._reply()
        if reply is None:
            self.failed = f"the zygote died (exit {self.proc.returncode}) during the call: {self._tail()}"
            return subprocess.CompletedProcess(argv, self.proc.returncode, "", self.failed)
        self.cpu = reply["cpu"]
        return subprocess.CompletedProcess(argv, reply["returncode"], reply["stdout"], reply["stderr"])


def shared(preload: tuple[str, ...]) -> Zygote:
    """This process's zygote for ``preload``, started on first use and
    again after it died or after this process's environment or working
    folder changed."""
    z = _ZYGOTES.get(preload)
    if z is not None and z.alive() and z.environ == dict(os.environ) and z.cwd == os.getcwd():
        return z
    if z is not None:
        z.close()
    z = _ZYGOTES[preload] = Zygote(preload)
    return z


def cpu() -> float:
    """CPU seconds of this process's live zygotes and their finished
    children, as of their last reply (a reaped zygote's are in
    ``getrusage(RUSAGE_CHILDREN)``)."""
    return sum(z.cpu for z in list(_ZYGOTES.values()))


@atexit.register
def _close_all() -> None:
    for z in list(_ZYGOTES.values()):
        z.close()


# -- the zygote's side ---------------------------------------------------------------
def own_cpu() -> float:
    """User and system CPU seconds of this process and of the children it
    waited for."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def resolve_name(func: str) -> Any:
    """``"package.module:attr.attr"`` (or a bare module) -> the object."""
    import importlib

    module, _, name = func.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split(".") if name else []:
        obj = getattr(obj, part)
    return obj


def _child(func: str, args: list, out: int, err: int, reply: int, sigint: Any) -> None:
    """The forked child: ``func(*args)`` with fresh standard streams, then
    exit (never returns). It keeps the write end of the zygote's ``done``
    pipe open until it exits: its closing tells the zygote the child is gone."""
    import signal
    import traceback

    code = 1
    try:
        os.close(reply)  # the protocol is the zygote's alone
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)
        signal.signal(signal.SIGINT, sigint)  # what a fresh process started by the caller would have
        try:
            resolve_name(func)(*args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as python -c prints it
            traceback.print_exc()
        with contextlib.suppress(Exception):  # a closed stream: nothing more to say
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(code)


def _call(request: dict[str, Any], reply: int, sigint: Any) -> dict[str, Any]:
    """Fork a child for one request, wait for it (or for this zygote's
    caller to go away: then kill it and exit), and say what it did."""
    import select
    import signal

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        done_r, done_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(done_r)
            _child(request["func"], request["args"], os.dup(out.fileno()), os.dup(err.fileno()), reply, sigint)
        os.close(done_w)
        while True:
            ready, _, _ = select.select([0, done_r], [], [])
            if done_r in ready:
                break
            # readable standard input while a child runs: the caller closed it (or died)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)
        os.close(done_r)
        _, status = os.waitpid(pid, 0)  # its CPU seconds now in this zygote's RUSAGE_CHILDREN
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}


def serve(preload: list[str]) -> None:
    """The zygote's life (``python -c``): import ``preload``, say ready,
    then one child per request line on standard input until it closes."""
    import signal
    import traceback

    # what a process started by the caller would inherit, for each child;
    # the zygote itself ends when its standard input closes, never on Ctrl-C
    sigint = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    protocol = os.fdopen(os.dup(1), "wb")
    reply = protocol.fileno()
    os.dup2(2, 1)  # a stray print of the preload goes with the zygote's own messages, not into the protocol

    def send(msg: dict[str, Any]) -> None:
        protocol.write((json.dumps(msg) + "\n").encode())
        protocol.flush()

    try:
        for entry in preload:
            module, _, func = entry.partition(":")
            resolve_name(module)
            if func:
                resolve_name(entry)()
        if "mlx.core" in sys.modules:
            raise RuntimeError("the preload imported mlx.core: a forked child of a process that evaluated an MLX "
                               "array hangs, so a zygote never holds MLX (import it in the call)")
    except BaseException:  # noqa: BLE001 - sent to the caller
        send({"failed": traceback.format_exc()})
        return
    send({"ready": True, "cpu": own_cpu()})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        result = _call(json.loads(line), reply, sigint)
        result["cpu"] = own_cpu()
        send(result)


__all__ = ["Zygote", "cpu", "shared"]
