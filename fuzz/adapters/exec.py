"""``exec:PATH``: a cache in another process, driven over kvproto/1 or
kvproto/2 (the target scheme ``exec`` of ``kvspec.fuzz.targets.SCHEMES``:
:func:`target`).

The line protocol (docs/targets.md "The line protocol", docs/kvproto.md for
kvproto/2; machine form ``fuzz/kvproto.schema.json``): kvspec starts the
adapter ``PATH`` (with any arguments after it, split as a shell would),
writes one JSON request per line on its stdin and reads one JSON reply per
line from its stdout:

* ``hello``: kvspec names the versions it speaks (``kvproto``, the oldest,
  and ``kvproto_max``, the newest); the adapter answers with the version of
  the session (1: dense caches; 2: dense, rotating and paged, masks and
  block tables included), and declares its name, how it reports windows
  (``bytes``: raw little-endian element bytes, which kvspec names by token
  identity; ``identities``: identities the adapter decoded from its own
  bytes with the portable row function), and per kind the modes, dtypes,
  cache fields, ops and observables it supports;
* ``init``: a fresh cache from the trace's ``cache`` object (always with
  ``"rows": "portable"``) and the ``wide`` flag of the rows;
* ``op``: one trace op, with ``first``, the identity of the first row an
  append writes (rows ``first .. first + n - 1``, portable rows);
* ``bye``.

Every reply to ``init`` and ``op`` carries the state after it: the
observables, the live window, the held window and every snapshot's window.
A refusal carries its category (``invalid_argument``, ``state``,
``unsupported``), compared with the spec's error type, never by message.

What the adapter does not declare is not run: a trace that needs it is
refused with a reason (exit 2), and a campaign never generates it (the
skipped ops are counted). An adapter that crashes, hangs (no reply within
``KVSPEC_EXEC_TIMEOUT`` seconds, default 10) or breaks the protocol during
an op is a divergence at that op (the trace up to it reproduces it); one
that cannot start or answer ``hello`` is a usage error naming the reason.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from kvspec.fuzz import kinds
from kvspec.fuzz.lockstep import Divergence, Lockstep
from kvspec.fuzz.masks import dense_windows, ring_windows
from kvspec.fuzz.targets import (
    CacheClass,
    HarnessFailure,
    Target,
    TargetCapabilityError,
    TargetError,
)
from kvspec.spec import dense as sd
from kvspec.spec import paged as sp
from kvspec.spec import rotating as sr
from kvspec.spec.errors import (
    InvalidArgumentError,
    KVCacheError,
    StateError,
    UnsupportedOperationError,
)

#: The oldest protocol version this client speaks (what a kvproto/1 hello
#: has always carried).
KVPROTO = 1
#: The newest protocol version this client speaks (the hello's ``kvproto_max``).
KVPROTO_MAX = 2
#: Every version this client speaks: an adapter answers hello with one of them.
VERSIONS = (1, 2)
#: The hello request (docs/kvproto.md, "Versions").
HELLO = {"request": "hello", "kvproto": KVPROTO, "kvproto_max": KVPROTO_MAX}
#: Seconds to wait for one reply (environment variable KVSPEC_EXEC_TIMEOUT).
DEFAULT_TIMEOUT = 10.0
#: Longest reply line read (bytes): a window of 2^24 float32 elements in hex.
MAX_LINE = 256 * 2**20

#: refusal category -> the spec's error type (docs/targets.md)
CATEGORIES: dict[str, type[KVCacheError]] = {
    "invalid_argument": InvalidArgumentError,
    "state": StateError,
    "unsupported": UnsupportedOperationError,
}
#: the observables kvspec can compare, as the dense lockstep names them
OBSERVABLES = ("offset", "live_start", "live_len", "capacity")
#: per kind, the observables its state line reports under kvproto/2 (besides
#: ``inplace``, the append's decision, and ``masks``, the append's masks)
KIND_OBSERVABLES: dict[str, tuple[str, ...]] = {
    "dense": OBSERVABLES,
    "rotating": ("offset", "idx", "capacity", "trimmable", "trimmable_rows", "log_saved_rows"),
    # sequences: every sequence's block table, length and logical start;
    # refcounts and free: the pool's (its size is the refcounts' length)
    "paged": ("sequences", "refcounts", "free", "capacity"),
}
#: the kinds each version drives
VERSION_KINDS = {1: ("dense",), 2: ("dense", "rotating", "paged")}
#: the kinds whose appends carry masks under kvproto/2 (``masks`` declared)
MASK_KINDS = ("rotating", "paged")


class ExecTargetError(TargetError):
    """The adapter cannot be used at all (it does not start, does not
    answer ``hello``, speaks another version): a usage error, exit 2."""


class AdapterFailure(Exception):
    """The adapter crashed, hung or broke the protocol while running a
    request; ``what`` is the one-line category."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"{what}: {detail}")
        self.what, self.detail = what, detail


def schema() -> dict[str, Any]:
    """The kvproto JSON Schema shipped with the package (kvproto/1 and
    kvproto/2: ``$defs/reply`` is /1's op reply, ``$defs/reply2`` /2's)."""
    return json.loads(resources.files("kvspec.fuzz").joinpath("kvproto.schema.json").read_text())


def _strict_integer(checker: object, instance: object) -> bool:
    # as in kvtrace: 1.0 and true are not integers
    return isinstance(instance, int) and not isinstance(instance, bool)


@cache
def validator(part: str) -> Any:
    """A validator of one ``$defs`` entry (``request``, ``hello_reply``,
    ``reply``), with strict integers."""
    doc = schema()
    base = jsonschema.Draft202012Validator
    strict = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _strict_integer))
    return strict({"$defs": doc["$defs"], "$ref": f"#/$defs/{part}"})


# -- a fast check of op replies: the schema's $defs/reply, by hand --------------
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_REPLY_KEYS = frozenset({"id", "ok", "result", "inplace", "error", "state"})
_STATE_KEYS = frozenset({"offset", "live_start", "live_len", "capacity", "cache", "held", "holders"})
_REPLY_KEYS_2 = _REPLY_KEYS | {"masks"}
_STATE_KEYS_2 = _STATE_KEYS | {"idx", "trimmable", "trimmable_rows", "log_saved_rows"}
_COUNTS_2 = ("offset", "live_start", "live_len", "capacity", "idx", "trimmable_rows", "log_saved_rows")
_MASK_ROW = re.compile(r"[01]*")


def _int(x: Any, lo: int | None = None) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo)


def _window_ok(w: Any) -> bool:
    if isinstance(w, list):
        return all(_int(t, 0) or t in ("zero", "?") for t in w)
    return (isinstance(w, dict) and w.keys() == {"rows", "k", "v"} and _int(w["rows"], 0)
            and isinstance(w["k"], str) and isinstance(w["v"], str)
            and _HEX.fullmatch(w["k"]) is not None and _HEX.fullmatch(w["v"]) is not None)


def reply_ok(r: Any, version: int = 1) -> bool:
    """Whether ``r`` satisfies ``$defs/reply`` (``version`` 2:
    ``$defs/reply2`` for the kinds kvspec drives over it), as the validator
    would, in a fraction of its time (tests/test_exec_target.py compares the
    two on drawn replies); only a reply this refuses goes through
    jsonschema, for its message."""
    if version == 2:
        return _reply2_ok(r)
    if not isinstance(r, dict) or not _REPLY_KEYS.issuperset(r) or "id" not in r or "ok" not in r:
        return False
    if not _int(r["id"], 0) or not isinstance(r["ok"], bool):
        return False
    if r["ok"] is False:
        e = r.get("error")
        if not (isinstance(e, dict) and e.keys() == {"category", "message"} and e["category"] in CATEGORIES
                and isinstance(e["message"], str) and len(e["message"]) <= 4096):
            return False
    elif "error" in r:
        return False
    if "result" in r:
        x = r["result"]
        if not (x is None or isinstance(x, (bool, int)) or _window_ok(x)):
            return False
    if "inplace" in r and not isinstance(r["inplace"], bool):
        return False
    if "state" in r:
        st = r["state"]
        if not isinstance(st, dict) or not _STATE_KEYS.issuperset(st) or not {"cache", "held", "holders"} <= st.keys():
            return False
        if not all(_int(st[k]) for k in OBSERVABLES if k in st):
            return False
        if not _window_ok(st["cache"]) or not (st["held"] is None or _window_ok(st["held"])):
            return False
        if not isinstance(st["holders"], dict) or not all(_window_ok(w) for w in st["holders"].values()):
            return False
    return True


def _reply2_ok(r: Any) -> bool:
    """:func:`reply_ok` for kvproto/2 replies of dense and rotating caches
    (a paged pool's state has no fast path: the validator judges it)."""
    if not isinstance(r, dict) or not _REPLY_KEYS_2.issuperset(r):
        return False
    masks = r.get("masks")
    if masks is not None and not (isinstance(masks, list) and all(
            isinstance(m, list) and all(isinstance(x, str) and _MASK_ROW.fullmatch(x) for x in m) for m in masks)):
        return False
    st = r.get("state")
    if isinstance(st, dict):
        if not _STATE_KEYS_2.issuperset(st) or not all(_int(st[k]) for k in _COUNTS_2 if k in st):
            return False
        if "trimmable" in st and not isinstance(st["trimmable"], bool):
            return False
    core = {k: v for k, v in r.items() if k != "masks"}
    if isinstance(st, dict):
        core["state"] = {k: v for k, v in st.items() if k in _STATE_KEYS}
    return reply_ok(core)


def timeout_seconds() -> float:
    """KVSPEC_EXEC_TIMEOUT, or the default. Raises ExecTargetError naming the
    variable when it is not a positive number."""
    raw = os.environ.get("KVSPEC_EXEC_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ExecTargetError(f"KVSPEC_EXEC_TIMEOUT must be a positive number of seconds, got {raw!r}")
    return value


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Session:
    """One running adapter process: requests out, replies in, with a
    timeout per reply; stderr goes to a temporary file whose tail is shown
    when the adapter fails."""

    def __init__(self, argv: list[str], timeout: float):
        self.argv, self.timeout = argv, timeout
        self.next_id = 0
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                         start_new_session=True)
        except OSError as exc:
            raise TargetCapabilityError(f"cannot start adapter {shlex.join(argv)}: {exc.strerror or exc}") from None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buffer = b""
        self.dead: str | None = None
        #: the session's protocol version (its hello reply's; 1 until then)
        self.version = 1

    def stderr_tail(self, limit: int = 600) -> str:
        try:
            self.stderr.seek(0)
            text = self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""
        return text[-limit:]

    def _failure(self, what: str, detail: str) -> AdapterFailure:
        self.close(kill=True)
        tail = self.stderr_tail()
        self.dead = f"{what}: {detail}"
        return AdapterFailure(what, detail + (f"; its stderr ends: {tail}" if tail else ""))

    def request(self, body: dict[str, Any], part: str = "reply") -> dict[str, Any]:
        """Send one request (an ``id`` is added) and return its validated
        reply. Raises AdapterFailure when the adapter exits, hangs or
        answers something the schema refuses or with another id."""
        if self.dead is not None:
            raise AdapterFailure("adapter is not running", self.dead)
        req = {"id": self.next_id, **body}
        self.next_id += 1
        line = (json.dumps(req, separators=(",", ":")) + "\n").encode()
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.proc.wait(timeout=self.timeout)
            raise self._failure("adapter crashed", f"it exited ({_signal_name(code)}) before reading request "
                                                   f"{req['request']!r}") from None
        raw = self._read_line(req)
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            raise self._failure("adapter broke the protocol", f"its reply to {req['request']!r} is not JSON "
                                                              f"({exc}): {raw[:200]!r}") from None
        version = reply.get("kvproto", 1) if part == "hello_reply" and isinstance(reply, dict) else self.version
        if part == "reply" and version == 2:
            part = "reply2"
        errors = [] if part in ("reply", "reply2") and reply_ok(reply, version) else sorted(
            validator(part).iter_errors(reply), key=lambda e: list(e.absolute_path))
        if errors:
            where = "/".join(str(p) for p in errors[0].absolute_path) or "reply"
            named = f"kvproto/{version}" if version in VERSIONS else "kvproto"
            raise self._failure("adapter broke the protocol",
                                f"its reply to {req['request']!r} fails {named} at {where}: {errors[0].message[:300]}")
        if reply["id"] != req["id"]:
            raise self._failure("adapter broke the protocol", f"reply id {reply['id']} to request id {req['id']}")
        if part == "hello_reply":
            self.version = reply["kvproto"]
        return reply

    def _read_line(self, req: dict[str, Any]) -> bytes:
        deadline = time.monotonic() + self.timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._failure("adapter hung", f"no reply to request {req['request']!r} within "
                                                        f"{self.timeout:g} s (KVSPEC_EXEC_TIMEOUT)")
                chunk = self.proc.stdout.read(1 << 16)
                if not chunk:  # EOF: the adapter exited
                    try:
                        code = self.proc.wait(timeout=self.timeout)
                    except subprocess.TimeoutExpired:
                        raise self._failure("adapter hung", "it closed its stdout but did not exit") from None
                    raise self._failure("adapter crashed", f"it exited ({_signal_name(code)}) without replying to "
                                                           f"request {req['request']!r}")
                self.buffer += chunk
                if len(self.buffer) > MAX_LINE:
                    raise self._failure("adapter broke the protocol", f"a reply line longer than {MAX_LINE} bytes")
        finally:
            sel.close()
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if not kill:
                try:
                    self.proc.stdin.write(b'{"id":%d,"request":"bye"}\n' % self.next_id)
                    self.proc.stdin.flush()
                    self.proc.stdin.close()
                    self.proc.wait(timeout=1)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


@dataclass(frozen=True)
class Declared:
    """What an adapter's ``hello`` declares for one kind."""

    modes: frozenset[str]
    dtypes: frozenset[str]
    fields: frozenset[str]
    ops: frozenset[str]
    observables: frozenset[str]


def _not_built(cache: dict[str, Any]) -> Any:
    raise TypeError("an exec target's cache lives in the adapter process (ExecTarget.make_lockstep)")


@dataclass(frozen=True)
class ExecTarget(Target):
    """``exec:PATH [ARGS]``: an adapter process speaking kvproto/1 or /2, as a
    ``kvspec.fuzz.targets.Target`` whose classes are what the adapter's ``hello``
    declares (one per kind and mode: the ops it lacks skipped, the
    observables it lacks not compared)."""

    argv: tuple[str, ...] = ()
    adapter: str = ""
    windows: str = "bytes"
    #: the protocol version of its sessions (its hello's)
    version: int = 1
    declared: dict[str, Declared] = field(default_factory=dict, compare=False, hash=False)

    #: a campaign draws our implementation's shapes and dtypes (what the
    #: adapter declares), not the plain shapes of mlx-lm's findings
    full_shapes = True

    @property
    def takes_inplace(self) -> bool:
        """Whether the adapter takes the ``inplace`` switch (then a campaign
        runs both settings, as for our caches)."""
        return any("inplace" in d.fields for d in self.declared.values())

    def cache_reason(self, cache: dict[str, Any]) -> str | None:
        """Why the adapter cannot build this trace's cache (None: it can)."""
        kind, mode = cache["kind"], cache.get("mode", "fp16")
        d = self.declared.get(kind)
        if d is None:
            return f"it declares no kind {kind} (it has {', '.join(sorted(self.declared))})"
        if mode not in d.modes:
            return f"it declares no mode {mode} for kind {kind} (it has {', '.join(sorted(d.modes))})"
        if cache.get("dtype", "float16") not in d.dtypes:
            return f"it declares no dtype {cache.get('dtype')} (it has {', '.join(sorted(d.dtypes))})"
        defaults = kinds.get(kind, mode).defaults()
        for name, value in cache.items():
            if name in d.fields or name == "rows":
                continue
            # an undeclared field is the adapter's at its default (never sent):
            # a trace that sets it to another value is refused
            if name in defaults and value == defaults[name]:
                continue
            return f"it declares no cache field {name!r} (it has {', '.join(sorted(d.fields))})"
        return None

    def require_class(self, cache: dict[str, Any]) -> CacheClass:
        reason = self.cache_reason(cache)
        if reason is not None:
            raise TargetCapabilityError(f"field cache: target {self.label} cannot run this trace: {reason}")
        return super().require_class(cache)

    def make_lockstep(self, cache: dict[str, Any]) -> Any:
        """The kind's lockstep driver with the adapter as its implementation."""
        c = self.require_class(cache)
        base = kinds.get(cache["kind"], cache.get("mode")).lockstep_class()
        base.check_cache(cache)
        # the adapter computes its rows from identities: portable rows,
        # whatever the trace's own scheme (docs/targets.md says why a
        # verdict on an unquantized cache does not depend on it)
        return exec_lockstep(base)({**cache, "rows": "portable"}, self, self.declared[c.kind])

    def machine_base(self, kind: str, mode: str, base: type) -> type:
        return _exec_machine(base, self)

    def session(self) -> Session:
        """A fresh adapter process for one lockstep (one trace, one fuzz
        example), after its ``hello``; the previous one is stopped. A
        process per example keeps examples independent, so Hypothesis can
        shrink a failure that depends on what the adapter did before (a
        leak from one cache into the next shows within one example).
        Raises TargetCapabilityError when the adapter does not answer
        ``hello`` as it first did."""
        old = _SESSIONS.pop(self.argv, None)
        if old is not None:
            old.close()
        s = _SESSIONS[self.argv] = Session(list(self.argv), timeout_seconds())
        try:
            reply = s.request(dict(HELLO), "hello_reply")
        except AdapterFailure as exc:
            raise TargetCapabilityError(f"adapter {shlex.join(self.argv)} did not answer hello: {exc}") from None
        if _declared(reply) != self.declared or reply["windows"] != self.windows or reply["kvproto"] != self.version:
            raise TargetCapabilityError(f"adapter {shlex.join(self.argv)} declared other kinds, ops or windows "
                                        "than in its first hello")
        return s


def _classes(adapter: str, declared: dict[str, Declared]) -> tuple[CacheClass, ...]:
    """One CacheClass per declared (kind, mode): the kind's ops it does not
    declare are skipped, the observables it does not declare not compared."""
    out = []
    for kind, d in declared.items():
        entry_ops = {op for m in d.modes for op in kinds.get(kind, m).all_ops} - {"expect"}
        skipped = {op: "not among the ops its hello declares" for op in sorted(entry_ops - d.ops)}
        not_compared = {o: "not among the observables its hello declares"
                        for o in (*KIND_OBSERVABLES.get(kind, OBSERVABLES), *(("masks",) if kind in MASK_KINDS else ()))
                        if o not in d.observables}
        for mode in sorted(d.modes):
            out.append(CacheClass(adapter, kind, mode, _not_built, skipped=skipped, not_compared=not_compared))
    return tuple(out)


_SESSIONS: dict[tuple[str, ...], Session] = {}


def close_sessions() -> None:
    """Stop every adapter process this process started (``bye``, then kill)."""
    while _SESSIONS:
        _, s = _SESSIONS.popitem()
        s.close()


def _declared(reply: dict[str, Any]) -> dict[str, Declared]:
    out = {}
    for kind, d in reply["kinds"].items():
        out[kind] = Declared(frozenset(d["modes"]), frozenset(d["dtypes"]), frozenset(d["fields"]),
                             frozenset(d["ops"]), frozenset(d["observables"]))
    return out


def target(rest: str) -> ExecTarget:
    """The ``exec`` scheme (``--target exec:PATH [ARGS]``): an ExecTarget
    after the adapter's ``hello``. Raises ExecTargetError (a TargetError:
    usage error, exit 2) naming the reason: an empty path, a program that
    does not start, a hello that is missing, malformed or of another
    protocol version."""
    try:
        argv = tuple(shlex.split(rest))
    except ValueError as exc:
        raise ExecTargetError(f"--target exec:{rest}: cannot split the command line: {exc}") from None
    if not argv:
        raise ExecTargetError("--target exec:PATH: PATH is empty (give the adapter program, e.g. exec:./adapter)")
    try:
        session = Session(list(argv), timeout_seconds())
    except TargetCapabilityError as exc:
        raise ExecTargetError(str(exc)) from None
    try:
        reply = session.request(dict(HELLO), "hello_reply")
    except AdapterFailure as exc:
        raise ExecTargetError(f"--target exec:{rest}: adapter {shlex.join(argv)} did not answer hello: "
                              f"{exc}") from None
    finally:
        session.close()
    problems = hello_problems(reply)
    if problems:
        raise ExecTargetError(f"--target exec:{rest}: adapter {reply['adapter']}'s hello: {problems[0]}")
    declared = _declared(reply)
    version = reply["kvproto"]
    return ExecTarget(f"exec:{rest.strip()}", f"{reply['adapter']} over kvproto/{version} ({shlex.join(argv)})",
                      _classes(reply["adapter"], declared), argv=argv, adapter=reply["adapter"],
                      windows=reply["windows"], declared=declared, spec=f"exec:{rest}", version=version)


def hello_problems(reply: dict[str, Any]) -> list[str]:
    """What a hello reply that the schema accepts (``$defs/hello_reply``)
    still gets wrong against the registry, one sentence each (empty: none):
    a mode the kind does not have; under kvproto/2 also a kind this client
    does not drive yet, a cache field that is not the kind's, an op that is
    neither the kind's nor one its spec refuses, ``masks`` declared for a
    kind whose masks kvproto/2 does not carry."""
    out = []
    version = reply["kvproto"]
    for kind, d in reply["kinds"].items():
        bad = sorted(set(d["modes"]) - set(kinds.modes_of(kind)))
        if bad:
            out.append(f"it declares modes {bad} of kind {kind}, which the registry does not have")
        if version < 2:
            continue
        if kind not in VERSION_KINDS[version]:
            out.append(f"kind {kind}: its kvproto/2 messages are specified (docs/kvproto.md) but this client does "
                       f"not drive it yet (it drives {', '.join(VERSION_KINDS[version])})")
            continue
        entry = kinds.get(kind)
        fields = sorted(set(d["fields"]) - set(entry.cache_fields))
        if fields:
            out.append(f"kind {kind}: fields {fields} are no cache fields of the kind (docs/kvtrace.md; it has "
                       f"{', '.join(entry.cache_fields)})")
        ops = sorted(set(d["ops"]) - set(entry.all_ops) - set(entry.refuses))
        if ops:
            out.append(f"kind {kind}: ops {ops} are no ops of the kind (docs/kvtrace.md; it has "
                       f"{', '.join(o for o in entry.all_ops if o != 'expect')})")
        if "masks" in d["observables"] and kind not in MASK_KINDS:
            out.append(f"kind {kind}: masks are not carried for this kind over kvproto/2 (only for "
                       f"{', '.join(MASK_KINDS)})")
    return out


# -- the lockstep side ------------------------------------------------------------


class IdWindow(list):
    """A window the adapter reported as token identities (``windows:
    identities``): compared as a list."""


def _decode(w: Any, dtype: str, shape: tuple[int, int, int, int]) -> Any:
    """A reply's window as the kind's drivers read windows: a pair of
    ``mx.array`` ``[B, H, n, D]`` in the trace's dtype (bytes), or an
    IdWindow. Raises AdapterFailure when the bytes do not fit the shape."""
    if w is None:
        return None
    if isinstance(w, list):
        return IdWindow(w)
    b, h, dk, dv = shape
    n = w["rows"]
    bits = np.uint32 if dtype == "float32" else np.uint16
    out = []
    for side, d in (("k", dk), ("v", dv)):
        raw = bytes.fromhex(w[side])
        want = b * h * n * d * np.dtype(bits).itemsize
        if len(raw) != want:
            raise AdapterFailure("adapter broke the protocol",
                                 f"a {side.upper()} window of {n} rows of [B={b}, H={h}, D={d}] {dtype} needs "
                                 f"{want} bytes, got {len(raw)}")
        a = np.frombuffer(raw, dtype=np.dtype(bits).newbyteorder("<")).astype(bits).reshape(b, h, n, d)
        if dtype == "bfloat16":
            out.append(mx.array(a).view(mx.bfloat16))
        else:
            out.append(mx.array(a.view(np.float16 if dtype == "float16" else np.float32)))
    return tuple(out)


class _Remote:
    """The adapter's cache as the kind's driver sees ``self.cache``: the
    observables of the last reply. One the adapter does not declare is no
    attribute at all (AttributeError), so nothing reads it by accident: an
    invariant that needs it is skipped, as for a class that lacks it."""

    def __init__(self, declared: frozenset[str] = frozenset(OBSERVABLES),
                 observables: tuple[str, ...] = OBSERVABLES) -> None:
        self.state: dict[str, Any] = {}
        self.last_write_inplace: bool | None = None
        #: a paged append's blocks (fresh, copied), as its reply gave them
        self.last_blocks: tuple[Any, Any] = (None, None)
        self.inplace = True
        self.declared = declared
        self.observables = observables

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("observables", ()) and name in self.__dict__.get("declared", ()):
            return self.__dict__["state"].get(name)
        raise AttributeError(f"{name}: not among the observables the adapter declares")


class _Exec:
    """Mixin over a kind's lockstep driver (``exec_lockstep``): every op goes
    to the adapter; what it declares is compared, the rest (memory sharing,
    the save/load fixpoint, masks: Python-side contracts) is not."""

    check_sharing = False
    compare_messages = False
    check_dense_masks = False
    check_stored_int8 = False
    narrow_masks = False
    check_mask_form = False
    impl_name = "adapter"

    def __init__(self, cache: dict[str, Any], target: ExecTarget, declared: Declared):
        self.target, self.declared = target, declared
        self.observables = KIND_OBSERVABLES.get(cache["kind"], OBSERVABLES)
        remote = (_RemotePool if cache["kind"] == "paged" else _Remote)(frozenset(declared.observables),
                                                                         self.observables)
        if cache["kind"] == "rotating":  # configuration, not state: the ring invariant reads them
            remote.keep, remote.max_size = cache["keep"], cache["max_size"]
        #: whether appends carry masks (kvproto/2, declared, not waived)
        self.compare_masks = (cache["kind"] in MASK_KINDS and "masks" in declared.observables
                              and "masks" not in target.waived and target.version >= 2)
        super().__init__(cache, lambda **_: remote)  # type: ignore[call-arg]
        self.cache = remote
        # the switch an adapter reads from inplace_env is not reported: its
        # in-place decisions (compared where declared) show what it read
        remote.inplace = self.spec_inplace()
        self.impl_name = target.label
        self.check_inplace = "inplace" in declared.observables and "inplace" not in target.waived
        # what the kind's spec side predicts (a ring has idx, a dense cache not)
        predicted = set(super().spec_observables())  # type: ignore[misc]
        have = set(declared.observables) | ({"pool size"} if "refcounts" in declared.observables else set())
        self.not_compared = (predicted - have) | (set(target.waived) & predicted)
        self.current_index = -1
        self.session = target.session()
        self.remote_views: dict[str, Any] = {"cache": None}
        try:
            # only the fields it declares (the rest are at their defaults: ExecTarget.cache_reason)
            sent = {k: v for k, v in cache.items() if k in declared.fields or k in ("kind", "rows")}
            reply = self.session.request({"request": "init", "cache": sent, "wide": bool(self.wide_rows())})
        except AdapterFailure as exc:
            raise TargetCapabilityError(f"field cache: target {target.label} failed building the cache: "
                                        f"{exc}") from None
        if not reply["ok"]:
            e = reply["error"]
            raise TargetCapabilityError(f"field cache: target {target.label} refused the cache "
                                        f"({e['category']}): {e['message']}")
        try:
            self._absorb(reply)
        except AdapterFailure as exc:  # a state whose windows do not fit the cache's shape
            raise TargetCapabilityError(f"field cache: target {target.label} failed building the cache: "
                                        f"{exc}") from None

    def reload_class(self) -> None:
        return None

    def before_append(self, op: dict[str, Any]) -> None:
        pass

    def step(self, index: int, op: dict[str, Any]) -> None:
        self.current_index = index
        super().step(index, op)  # type: ignore[misc]

    def _absorb(self, reply: dict[str, Any]) -> None:
        state = reply.get("state")
        if state is None:
            raise AdapterFailure("adapter broke the protocol", "a reply to init or op without its state")
        missing = sorted(o for o in self.declared.observables if o in self.observables and o not in state)
        if missing:
            raise AdapterFailure("adapter broke the protocol",
                                 f"its state lacks {', '.join(missing)}, which its hello declares among its "
                                 "observables")
        if "cache" not in state or "holders" not in state:
            raise AdapterFailure("adapter broke the protocol", "its state lacks the live window (cache) or the "
                                                               "holders")
        self.cache.state = state
        views = {"cache": _decode(state["cache"], self.dtype, self.shape)}
        for name, w in state["holders"].items():
            views["holder:" + name] = _decode(w, self.dtype, self.shape)
        if state["held"] is not None:
            views["held"] = _decode(state["held"], self.dtype, self.shape)
        self.remote_views = views

    def mask_windows(self, op: dict[str, Any]) -> list[int | None] | None:
        """The windows whose masks an append asks for (None: no masks): a
        ring's own (None) and :func:`kvspec.fuzz.masks.ring_windows`'s narrower and
        wider ones, for an append of at least one row."""
        if not self.compare_masks or op["op"] != "append" or not _int(op.get("n"), 1):
            return None
        c = self.world.cache
        return ring_windows(c.max_size, c.keep)

    def spec_masks(self, op: dict[str, Any], windows: list[int | None]) -> list[Any]:
        """The spec's masks for ``windows``, on the world before the op
        (kvspec.spec.rotating.make_masks_spec): rows of booleans per window."""
        return list(sr.make_masks_spec(self.world.cache, op["n"], tuple(windows)))

    def compare_remote_masks(self, op: dict[str, Any], windows: list[int | None], reply: dict[str, Any]) -> None:
        """The masks the adapter answered (made before the append) against
        :meth:`spec_masks` on the spec's cache before the op, each as a
        whole ``[n, L]`` matrix. Raises Divergence at the first that
        differs; AdapterFailure when they are missing or of another count."""
        got = reply.get("masks")
        if not isinstance(got, list) or len(got) != len(windows):
            raise AdapterFailure("adapter broke the protocol",
                                 f"its reply to an append carries {'no' if got is None else len(got)} masks, "
                                 f"asked for {len(windows)} (windows {windows}; its hello declares masks)")
        n = op["n"]
        wants = self.spec_masks(op, windows)
        for window, want, rows in zip(windows, wants, got):
            want_rows = ["".join("1" if x else "0" for x in r) for r in want]
            if rows != want_rows:
                call = f"make_mask({n}" + ("" if window is None else f", window_size={window}") + ")"
                raise Divergence(self.current_index, op, f"{call} differs", " / ".join(want_rows),
                                 " / ".join(map(str, rows)))
        self.reached("masks checked")

    def impl_apply(self, op: dict[str, Any]) -> Any:
        body: dict[str, Any] = {"request": "op", "op": op}
        if op["op"] in ("append", "state_assign"):
            body["first"] = self.world.next_token  # the spec world before this op
        windows = self.mask_windows(op)
        if windows is not None:
            body["masks"] = windows
        try:
            reply = self.session.request(body)
            if windows is not None and reply["ok"]:
                self.compare_remote_masks(op, windows, reply)
            self._absorb(reply)
            result = reply.get("result")
            if op["op"] == "append" and reply["ok"]:
                self.cache.last_write_inplace = reply.get("inplace")
                self.cache.last_blocks = (reply.get("fresh"), reply.get("copied"))
                result = _decode(result, self.dtype, self.shape)
        except AdapterFailure as exc:
            raise Divergence(self.current_index, op, exc.what, "a reply (the spec's outcome of this op)",
                             exc.detail) from None
        except Divergence:
            raise
        except Exception as exc:
            # the adapter's refusals arrive as a category in its reply (raised
            # below as the spec's type); an exception here, whatever its
            # type, is this client's: a tool failure (exit 2), not a verdict
            raise HarnessFailure(self.current_index, op, exc, "the kvproto client, fuzz/adapters/exec.py") from exc
        if not reply["ok"]:
            e = reply["error"]
            raise CATEGORIES[e["category"]](f"[{e['category']}] {e['message']}")
        return result

    def impl_last_inplace(self) -> bool | None:
        return self.cache.last_write_inplace

    def spec_observables(self) -> dict[str, Any]:
        full = super().spec_observables()  # type: ignore[misc]
        return {k: v for k, v in full.items() if k not in self.not_compared}

    def impl_observables(self) -> dict[str, Any]:
        return {k: self.cache.state.get(k) for k in self.observables if k not in self.not_compared}

    def impl_views(self) -> dict[str, Any]:
        return dict(self.remote_views)

    def check_op_checks(self, index: int, op: dict[str, Any], spec_out: Any) -> None:
        if "capacity" in op and "capacity" in self.not_compared:
            op = {k: v for k, v in op.items() if k != "capacity"}
        super().check_op_checks(index, op, spec_out)  # type: ignore[misc]

    # -- windows reported as identities ------------------------------------------
    def window_matches(self, tokens: tuple[int, ...], arrays: Any, mode: str | None = None) -> bool:
        if isinstance(arrays, IdWindow):
            return list(arrays) == list(tokens)
        return super().window_matches(tokens, arrays, mode)  # type: ignore[misc]

    def identify(self, arrays: Any, mode: str | None = None) -> list[Any]:
        if isinstance(arrays, IdWindow):
            return list(arrays)
        return super().identify(arrays, mode)  # type: ignore[misc]

    def view_matches(self, name: str, tokens: tuple[int, ...], arrays: Any) -> bool:
        if isinstance(arrays, IdWindow):
            return list(arrays) == list(tokens)
        return super().view_matches(name, tokens, arrays)  # type: ignore[misc]


class _RemotePool(_Remote):
    """A paged pool in the adapter: what the paged driver asks of the pool
    object it builds (a handle's sequence) is nobody's here."""

    def _require(self, op: str, seq: str) -> None:
        return None


class _ExecPaged:
    """The paged driver's pool-side checks over the protocol (before
    :class:`_Exec` in the MRO): every sequence's block table, length,
    start and window, the refcounts and the free list from the state line;
    the blocks an append allocated and copied on write from its reply; the
    pool invariants checked on the adapter's reported pool; the dense mask
    rule over the sequence's visible rows. Windows fetched and read later
    (MLX's laziness) and mlx-lm's accessors are Python-side, not compared."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the paged machine's invariant asks the pool object (here: the adapter's reported pool)
        self.pool.broken_invariants = lambda: tuple(self.remote_pool_invariants())

    def _absorb(self, reply: dict[str, Any]) -> None:
        state = reply.get("state")
        if state is None or not isinstance(state.get("sequences"), dict):
            raise AdapterFailure("adapter broke the protocol",
                                 "a reply to init or op without its state's sequences (kvproto/2, kind paged)")
        missing = sorted(o for o in self.declared.observables if o in ("refcounts", "free") and o not in state)
        if missing:
            raise AdapterFailure("adapter broke the protocol",
                                 f"its state lacks {', '.join(missing)}, which its hello declares among its "
                                 "observables")
        self.cache.state = state
        views = {"seq:" + name: _decode(s["window"], self.dtype, self.shape) for name, s in state["sequences"].items()}
        if state["held"] is not None:
            views["held"] = _decode(state["held"], self.dtype, self.shape)
        self.remote_views = views

    def impl_observables(self) -> dict[str, Any]:
        st = self.cache.state
        seqs = {k: (list(s["table"]), s["length"], s["start"]) for k, s in sorted(st["sequences"].items())}
        cur = st["sequences"].get(self.current_seq)
        cap = 0 if cur is None else sp.capacity_of(len(cur["table"]), self.world.pool.block_size)
        refcounts = st.get("refcounts")
        out = self._observables(seqs, refcounts, st.get("free"), cap)
        if refcounts is not None and "pool size" in out:
            out["pool size"] = len(refcounts)
        return {k: v for k, v in out.items() if k not in self.not_compared}

    def impl_last_inplace(self) -> bool | None:
        return self.cache.last_write_inplace

    def compare_append(self, index: int, op: dict[str, Any], s: Any, i: Any) -> None:
        Lockstep.compare_append(self, index, op, s, i)  # type: ignore[arg-type]
        if self.check_inplace:
            fresh, copied = self.cache.last_blocks
            got = (list(fresh or ()), [list(c) for c in copied or ()])
            if got != (list(s.fresh), [list(c) for c in s.copied]):
                raise Divergence(index, op, "blocks allocated / copied on write differ",
                                 f"fresh={list(s.fresh)} copied={[list(c) for c in s.copied]}",
                                 f"fresh={got[0]} copied={got[1]}")
        self.note_append(op, s)  # type: ignore[attr-defined]

    def compare_state(self, index: int, op: dict[str, Any]) -> None:
        broken = sp.broken_invariants(self.world)
        if broken:
            raise Divergence(index, op, "the spec breaks its own invariants", broken, "-")
        Lockstep.compare_state(self, index, op)  # type: ignore[arg-type]
        broken = self.remote_pool_invariants()
        if broken:
            raise Divergence(index, op, "pool invariants broken on the adapter", "none", broken)

    def remote_pool_invariants(self) -> list[str]:
        """kvspec.spec.paged's pool invariants on the pool the adapter reports
        (where it reports refcounts and free list): refcount = tables
        holding the block, the free list the blocks of refcount 0 once
        each, tables of ``ceil(length / block_size)`` entries, ``null``
        exactly at the blocks wholly before the start."""
        st, bs = self.cache.state, self.world.pool.block_size
        out = []
        seqs = st["sequences"].values()
        for s in seqs:
            table = s["table"]
            if not 0 <= s["start"] <= s["length"] or len(table) != sp.table_len(s["length"], bs) or any(
                    (b is None) != sp.wholly_before(j, s["start"], bs) for j, b in enumerate(table)):
                out.append("tables_well_formed")
                break
        refcounts, free = st.get("refcounts"), st.get("free")
        if refcounts is None or free is None:
            return out
        counts = [0] * len(refcounts)
        for s in seqs:
            for b in s["table"]:
                if b is not None and 0 <= b < len(counts):
                    counts[b] += 1
                elif b is not None:
                    out.append("refcounts_match_tables")
        if counts != refcounts:
            out.append("refcounts_match_tables")
        if len(set(free)) != len(free) or set(free) != {j for j, r in enumerate(refcounts) if r == 0}:
            out.append("free_blocks_unheld")
        return sorted(set(out))

    def mask_windows(self, op: dict[str, Any]) -> list[int | None] | None:
        """The dense windows (kvspec.fuzz.masks.dense_windows) over the visible
        rows of the sequence the append writes (none when it does not
        exist: the append is refused)."""
        if not self.compare_masks or op["op"] != "append" or not _int(op.get("n"), 1):
            return None
        s = self.world.seqs.get(op.get("seq", sp.MAIN))
        return None if s is None else list(dict.fromkeys(dense_windows(s.visible)))

    def spec_masks(self, op: dict[str, Any], windows: list[int | None]) -> list[Any]:
        visible = self.world.seqs[op.get("seq", sp.MAIN)].visible
        return [sd.dense_make_mask(visible, op["n"], w) for w in windows]


_EXEC: dict[type, type] = {}


def exec_lockstep(base: type) -> type:
    """``base`` (a kind's lockstep driver) run over an adapter process."""
    if base not in _EXEC:
        mixins = (_ExecPaged, _Exec) if getattr(base, "spec_module", None) is sp else (_Exec,)
        _EXEC[base] = type(f"Exec{base.__name__}", (*mixins, base), {})
    return _EXEC[base]


def _exec_machine(base: type, target: ExecTarget) -> type:
    """The kind's machine drawing what the adapter declares: our shapes
    (batch, heads, K and V head dims), its dtypes, portable rows; no
    ``inplace_env`` unless declared."""

    class ExecMachine(base):  # type: ignore[misc, valid-type]
        def draw_shape(self, data: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            saved, self.target = self.target, None
            try:
                shape = super().draw_shape(data, *args, **kwargs)
            finally:
                self.target = saved
            d = target.declared.get(self.kind)
            if d is not None:
                if shape.get("dtype", "float16") not in d.dtypes:
                    shape["dtype"] = min(d.dtypes)
                for name in list(shape):
                    if name not in d.fields:
                        del shape[name]
                if self.kind == "rotating" and "undo" in d.fields:
                    # a ring that declares its undo log is fuzzed at every depth
                    # (the machine draws it for this project's ring only)
                    from kvspec.fuzz.rotating import UNDO_DEPTHS

                    shape["undo"] = data.draw(st.sampled_from(UNDO_DEPTHS), label="undo")
            return shape

        def setup(self, **cfg: Any) -> None:
            d = target.declared.get(self.kind)
            if d is not None:
                # a field the adapter does not declare is held at its default
                # (never sent: ExecTarget.cache_reason), so a ring without
                # sinks (no keep) is fuzzed at keep 0, not refused
                defaults = kinds.get(self.kind, self.mode).defaults()
                cfg = {k: defaults[k] if k not in d.fields and k in defaults else v for k, v in cfg.items()}
            super().setup(**cfg, rows="portable")

    ExecMachine.__name__ = f"Exec{base.__name__}"
    return ExecMachine
