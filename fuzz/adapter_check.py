"""``kvspec adapter check``: a self-check of a cache adapter before any fuzzing.

For an adapter program (``kvspec adapter check CMD [ARGS]``, the program an
``exec:`` target names; docs/targets.md "The line protocol") it starts the
program, validates its ``hello`` against the kvproto schema
(``fuzz/kvproto.schema.json``), then sends a few canned sessions, each to a
fresh process so that one crash does not hide the problems after it:

* **basic**: ``init``, ``append`` (3 rows), ``fetch``, ``trim`` (1),
  ``append`` (2 rows), ``trim_to`` (1): every reply's shape, ``id``,
  ``result`` and ``state`` (observables, live window) against the contract;
* **holders**: ``append``, ``hold``, ``snapshot``, ``append``, ``restore``,
  ``release_hold``, ``drop`` (the ops it declares);
* **refusals**: ``trim_to`` past the offset (invalid argument), ``restore``
  of an unknown name, a second ``snapshot`` of a name in use, ``hold``
  before any append (state), each changing nothing; an op no adapter has
  (unsupported), after which it must still answer; ``bye``, after which it
  must exit with status 0.

Every problem is one sentence: what was sent, what came back, the rule of
the protocol or the contract, and how to fix it; all of them are reported,
not only the first. A reply is waited for at most ``timeout`` seconds (a
bounded wait, only a hang guard: no verdict depends on the clock otherwise).

For a cache class (``--target module:Class``, docs/targets.md "A cache class
as a target") it checks the members the target API needs and replays a
small canned trace against the spec.

:func:`check_command` and :func:`check_class` return a :class:`Report`;
exit 0 when it holds no problem, 1 when it does (2, bad usage, is the
CLI's)."""

from __future__ import annotations

import json
import os
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

from kvspec.spec.rows import element_bits, identify

#: seconds waited for one reply line (a hang guard, not a verdict)
DEFAULT_TIMEOUT = 10.0
#: the versions kvspec speaks, as its hello names them (fuzz/adapters/exec.py HELLO):
#: the oldest and the newest; the canned sessions drive the dense kind of either
KVPROTO, KVPROTO_MAX = 1, 2
HELLO = {"request": "hello", "kvproto": KVPROTO, "kvproto_max": KVPROTO_MAX}
#: the canned cache (fields sent only where the hello declares them)
CACHE = {"kind": "dense", "mode": "fp16", "step": 4, "batch": 1, "kv_heads": 2, "head_dim": 4, "k_head_dim": 4,
         "v_head_dim": 6, "dtype": "float16", "inplace": True, "rows": "portable"}
#: fields the adapter must take: without them init cannot tell it the shape
SHAPE_FIELDS = ("kv_heads", "head_dim")
#: what a dense adapter may declare (the kvtrace cache fields, the dense ops, the observables)
DENSE_FIELDS = ("kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim", "v_head_dim", "dtype",
                "inplace", "inplace_env", "rows")
OBSERVABLES = ("offset", "live_start", "live_len", "capacity")
#: the longest reply line read (bytes)
MAX_LINE = 16 * 2**20


@dataclass
class Problem:
    """One thing the adapter does wrong: ``step`` (``hello``, ``init``, ``op
    append``...) and one sentence saying what was sent, what came back, the
    rule and the fix."""

    step: str
    sentence: str

    def to_json(self) -> dict[str, str]:
        return {"step": self.step, "problem": self.sentence}


@dataclass
class Report:
    """What ``adapter check`` found: ``problems`` (none: the adapter is
    clean), ``passed`` (the steps that held), ``notes`` (what was not
    checked and why: ops or observables the adapter does not declare)."""

    adapter: str
    problems: list[Problem] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, step: str, sentence: str) -> None:
        self.problems.append(Problem(step, sentence))

    def to_json(self) -> dict[str, Any]:
        return {"adapter": self.adapter, "ok": self.ok, "problems": [p.to_json() for p in self.problems],
                "passed": self.passed, "notes": self.notes, "exit": 0 if self.ok else 1}


# -- the schema --------------------------------------------------------------------


@cache
def _validator(part: str) -> Any:
    """A validator of one ``$defs`` entry of the kvproto schema (versions 1 and 2) with strict
    integers (as the exec client's). A later protocol version's schema
    plugs in here, keyed by the hello's ``kvproto``."""
    import jsonschema

    doc = json.loads(resources.files("kvspec.fuzz").joinpath("kvproto.schema.json").read_text())
    base = jsonschema.Draft202012Validator
    strict = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine(
        "integer", lambda _c, x: isinstance(x, int) and not isinstance(x, bool)))
    return strict({"$defs": doc["$defs"], "$ref": f"#/$defs/{part}"})


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def schema_sentences(reply: Any, part: str) -> list[str]:
    """Every way ``reply`` fails ``$defs/<part>``, one clause each ("omits
    the required field 'windows'", "has field 'colour', which the protocol
    does not define at kinds/dense"...), deepest first."""
    errors = sorted(_validator(part).iter_errors(reply), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    out: list[str] = []
    for e in errors:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at {where}" if where else ""
        v = e.validator
        if v == "required":
            missing = [k for k in e.validator_value if isinstance(e.instance, dict) and k not in e.instance]
            for k in missing:
                out.append(f"omits the required field {k!r}{at}")
        elif v == "additionalProperties" and isinstance(e.instance, dict):
            allowed = set(e.schema.get("properties", {}))
            for k in sorted(set(e.instance) - allowed):
                out.append(f"has field {k!r}{at}, which the protocol does not define there (it allows "
                           f"{', '.join(sorted(allowed))})")
        elif v == "type":
            out.append(f"has {where or 'the reply'} = {_short(e.instance)}, {_json_type(e.instance)}, where "
                       f"the protocol wants {e.validator_value if isinstance(e.validator_value, str) else 'one of ' + str(e.validator_value)}")
        elif v in ("enum", "const"):
            values = e.validator_value if v == "enum" else [e.validator_value]
            out.append(f"has {where or 'the reply'} = {_short(e.instance)}, where the protocol allows only "
                       f"{', '.join(json.dumps(a) for a in values)}")
        elif v == "propertyNames":
            out.append(f"names {_short(e.instance)}{at}, which the protocol does not have there ({e.message[:120]})")
        elif v in ("anyOf", "oneOf") and "window" in json.dumps(e.schema):
            out.append(f"has {where or 'the reply'} = {_short(e.instance)}, which is neither a bytes window "
                       '{"rows": n, "k": HEX, "v": HEX} nor a list of token identities')
        elif v == "not" and where == "" and isinstance(e.instance, dict) and e.instance.get("ok") is True:
            out.append("carries an error although ok is true (a reply has an error only when ok is false)")
        elif v == "pattern":
            out.append(f"has {where} = {_short(e.instance)}, which is not lowercase hex of whole bytes")
        else:
            out.append(f"fails the schema{at}: {e.message[:160]}")
    # a property error reported both at the root and below is said once
    return list(dict.fromkeys(out))


# -- the adapter process -------------------------------------------------------------


class _Dead(Exception):
    """The adapter process is gone (or hung and was stopped): the rest of
    this session cannot run."""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _Process:
    """One adapter process: raw lines in and out, each reply waited for at
    most ``timeout`` seconds."""

    def __init__(self, argv: list[str], timeout: float):
        self.argv, self.timeout = argv, timeout
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     start_new_session=True)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buffer = b""

    def stderr_tail(self, limit: int = 300) -> str:
        try:
            self.stderr.seek(0)
            text = self.stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""
        return " ".join(text[-limit:].split())

    def send(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def read(self) -> tuple[str, Any]:
        """``("line", bytes)``, ``("eof", exit status or None)`` or ``("timeout", None)``."""
        deadline = time.monotonic() + self.timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return "timeout", None
                chunk = self.proc.stdout.read(1 << 16)
                if not chunk:
                    try:
                        return "eof", self.proc.wait(timeout=self.timeout)
                    except subprocess.TimeoutExpired:
                        return "eof", None
                self.buffer += chunk
                if len(self.buffer) > MAX_LINE:
                    return "line", self.buffer
        finally:
            sel.close()
        line, _, self.buffer = self.buffer.partition(b"\n")
        return "line", line

    def stop(self) -> None:
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
        self.stderr.close()


# -- the expected windows --------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    batch: int
    heads: int
    dk: int
    dv: int
    dtype: str
    windows: str
    wide: bool = False

    @property
    def width(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def side_bytes(self, n: int, kv: int) -> int:
        return self.batch * self.heads * n * (self.dv if kv else self.dk) * self.width

    def window(self, tokens: list[int]) -> Any:
        """The window of these rows as the adapter must report it."""
        if self.windows == "identities":
            return list(tokens)
        out: dict[str, Any] = {"rows": len(tokens)}
        for side, kv, d in (("k", 0, self.dk), ("v", 1, self.dv)):
            out[side] = b"".join(
                element_bits(t, kv, b, h, c, self.dtype, self.wide).to_bytes(self.width, "little")
                for b in range(self.batch) for h in range(self.heads) for t in tokens for c in range(d)).hex()
        return out

    def name_rows(self, w: Any) -> tuple[list[Any] | None, str]:
        """The token identities of a reported window (``"?"``: no token's
        row, ``"zero"``: all zero), or None and why it cannot be read."""
        if isinstance(w, list):
            return w, ""
        if not isinstance(w, dict) or not all(k in w for k in ("rows", "k", "v")):
            return None, "it is not a window"
        n = w["rows"]
        if not isinstance(n, int) or n < 0:
            return None, f"its rows is {_short(n)}"
        raw = {}
        for side, kv in (("k", 0), ("v", 1)):
            try:
                raw[side] = bytes.fromhex(w[side])
            except (TypeError, ValueError):
                return None, f"its {side} is not hex"
            want = self.side_bytes(n, kv)
            if len(raw[side]) != want:
                elems = self.side_bytes(n, kv) // self.width
                hint = ""
                if elems and len(raw[side]) % elems == 0 and len(raw[side]) // elems in (2, 4):
                    hint = (f" (that is {len(raw[side]) // elems} bytes an element: the dtype is "
                            f"{self.dtype}, {self.width} bytes an element)")
                return None, (f"its {side.upper()} holds {len(raw[side])} bytes where {n} rows of [B={self.batch}, "
                              f"H={self.heads}, D={self.dv if kv else self.dk}] {self.dtype} take {want}{hint}")
        names: list[Any] = []
        for i in range(n):
            def elem(side: str, kv: int, b: int, h: int, c: int, i: int = i) -> int:
                d = self.dv if kv else self.dk
                at = (((b * self.heads + h) * n + i) * d + c) * self.width
                return int.from_bytes(raw[side][at: at + self.width], "little")
            k0, v0 = elem("k", 0, 0, 0, 0), elem("v", 1, 0, 0, 0)
            t = identify(k0, v0, self.dtype, self.wide)
            if t is not None and all(elem(s, kv, b, h, c) == element_bits(t, kv, b, h, c, self.dtype, self.wide)
                                     for s, kv, d in (("k", 0, self.dk), ("v", 1, self.dv))
                                     for b in range(self.batch) for h in range(self.heads) for c in range(d)):
                names.append(t)
            elif not any(raw["k"]) and not any(raw["v"]):
                names.append("zero")
            else:
                names.append("?")
        return names, ""


# -- a session with the adapter ----------------------------------------------------------


_UNKNOWN_ROWS = (" ('?': bytes that are no token's row: check the layout [B, H, n, D] in C order, the "
                 "dtype's width and the row function)")
FIX_JSON = ("write exactly one JSON object per line on stdout and flush it (print(..., flush=True), "
            "fflush(stdout)); log anything else to stderr")


class _Session:
    """One adapter process and the report it writes to."""

    def __init__(self, argv: list[str], timeout: float, report: Report, label: str):
        self.report, self.label = report, label
        self.next_id = 0
        self.proc = _Process(argv, timeout)
        self.timeout = timeout
        self.dead = False

    def _gone(self, step: str, sent: str, how: tuple[str, Any]) -> _Dead:
        kind, value = how
        tail = self.proc.stderr_tail()
        tail = f" (its stderr ends: {tail})" if tail else ""
        if kind == "timeout":
            self.report.problem(step, f"sent {sent}; no reply line came within {self.timeout:g} s (a bounded "
                                      f"wait, the hang guard; --timeout sets it){tail}; the protocol wants one "
                                      "reply line to every request: answer it, and flush stdout after each line")
        else:
            status = "it exited" if value is None else f"it exited ({_exit_text(value)})"
            self.report.problem(step, f"sent {sent}; {status} without replying{tail}; the protocol wants one "
                                      "reply line to every request and the process alive until bye or the end of "
                                      "stdin: refuse what the adapter cannot do with an error category instead "
                                      "of exiting")
        self.dead = True
        self.proc.stop()
        return _Dead()

    def ask(self, step: str, body: dict[str, Any], part: str = "reply", raw: str | None = None) -> dict[str, Any]:
        """Send one request; return its reply (a dict) once its problems are
        recorded. Raises _Dead when the process is gone or hung."""
        if self.dead:
            raise _Dead()
        req = {"id": self.next_id, **body}
        self.next_id += 1
        line = raw if raw is not None else json.dumps(req, separators=(",", ":"))
        sent = _short(json.loads(line), 160)
        if not self.proc.send(line):
            code = self.proc.proc.poll()
            raise self._gone(step, sent, ("eof", code))
        garbage = False
        for _ in range(5):  # lines that are not JSON: each said, then the next is read
            got = self.proc.read()
            if got[0] == "timeout" and garbage:
                # the line that was not JSON was its reply: said above, no hang to add
                self.dead = True
                self.proc.stop()
                raise _Dead()
            if got[0] != "line":
                raise self._gone(step, sent, got)
            text = got[1]
            try:
                reply = json.loads(text)
            except ValueError:
                shown = text[:120].decode("utf-8", "replace")
                self.report.problem(step, f"sent {sent}; got a line that is not JSON, {shown!r}; every line on "
                                          f"stdout must be one reply: {FIX_JSON}")
                garbage = True
                continue
            break
        else:
            self.dead = True
            self.proc.stop()
            raise _Dead()
        for clause in schema_sentences(reply, part):
            self.report.problem(step, f"sent {sent}; the reply {clause}; kvproto's $defs/{part} "
                                      "(fuzz/kvproto.schema.json) is the rule: make the reply match it")
        if isinstance(reply, dict) and reply.get("id") != req["id"]:
            self.report.problem(step, f"sent {sent} (id {req['id']}); the reply carries id {_short(reply.get('id'))}; "
                                      "every reply must carry its request's id: copy the id from the request")
        return reply if isinstance(reply, dict) else {}

    def bye(self) -> None:
        """``bye``: the adapter must exit with status 0."""
        if self.dead:
            return
        if any(p.step == "bye" for p in self.report.problems):
            # said once, after the first session: the later ones are stopped without waiting
            self.proc.stop()
            self.dead = True
            return
        self.proc.send(json.dumps({"id": self.next_id, "request": "bye"}))
        try:
            self.proc.proc.stdin.close()
        except OSError:
            pass
        try:
            code = self.proc.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.report.problem("bye", f"sent bye and closed stdin; the process was still running {self.timeout:g} s "
                                       "later (a bounded wait, the hang guard); the protocol wants an exit with "
                                       "status 0 on bye or at the end of stdin: leave the read loop on both")
        else:
            if code != 0:
                self.report.problem("bye", f"sent bye; the process ended with {_exit_text(code)}; the protocol wants "
                                           "exit status 0 on bye: return 0 from the read loop")
        self.proc.stop()
        self.dead = True


# -- the checks --------------------------------------------------------------------------


def _hello_problems(reply: dict[str, Any], report: Report) -> dict[str, Any] | None:
    """What the hello declares for kind dense (None: nothing to go on)."""
    kinds = reply.get("kinds")
    if not isinstance(kinds, dict):
        return None  # the schema's sentence says so
    others = sorted(k for k in kinds if k != "dense")
    if others and reply.get("kvproto") == 2:
        report.notes.append(f"kinds {', '.join(others)}: only their hello is checked here (the canned sessions "
                            "drive dense caches); kvspec replay of their traces in tests/traces/ and kvspec fuzz "
                            "check the rest")
    if reply.get("kvproto") == 2:
        _v2_kind_problems(kinds, others, report)
    if not isinstance(kinds.get("dense"), dict):
        if not others:
            report.problem("hello", "the hello declares no kind dense (kinds.dense: its modes, dtypes, fields, ops "
                                    "and observables), nor any other kind: declare the kinds your cache is (kvproto/1: "
                                    "dense; kvproto/2: also rotating and paged), or nothing can run")
        return None
    d = kinds["dense"]
    lists = {k: d.get(k) if isinstance(d.get(k), list) else [] for k in ("modes", "dtypes", "fields", "ops",
                                                                        "observables")}
    from kvspec.fuzz import kinds as registry

    known_ops = [op for op in registry.get("dense").all_ops if op != "expect"]
    for op in lists["ops"]:
        if op not in known_ops:
            report.problem("hello", f"the hello declares op {op!r} for kind dense, which the dense kind does not "
                                    f"have (docs/kvtrace.md: {', '.join(known_ops)}); kvspec never sends it: "
                                    "drop it or spell it as the trace format does")
    for f in lists["fields"]:
        if f not in DENSE_FIELDS:
            report.problem("hello", f"the hello declares cache field {f!r}, which a dense cache does not have "
                                    f"(docs/kvtrace.md: {', '.join(DENSE_FIELDS)}); drop it or spell it as the "
                                    "trace format does")
    for m in lists["modes"]:
        if m not in registry.modes_of("dense"):
            report.problem("hello", f"the hello declares mode {m!r}, which kind dense does not have "
                                    f"({', '.join(registry.modes_of('dense'))}); kvspec refuses such a hello: "
                                    "declare the modes your cache implements")
    if lists["modes"] and "fp16" not in lists["modes"]:
        report.notes.append("no mode fp16 declared: the canned sessions use fp16 and were not run")
        return None
    for f in SHAPE_FIELDS:
        if f not in lists["fields"]:
            report.problem("hello", f"the hello does not declare cache field {f!r}; an undeclared field is never "
                                    "sent in init (the adapter is held to its default), so the adapter cannot "
                                    "learn the cache's shape: declare it among fields")
    for op in ("append", "fetch"):
        if op not in lists["ops"]:
            report.problem("hello", f"the hello does not declare op {op!r}; without it no trace runs: implement "
                                    "and declare it")
    missing_obs = [o for o in OBSERVABLES if o not in lists["observables"]]
    if missing_obs:
        report.notes.append(f"not compared (not among the observables the hello declares): {', '.join(missing_obs)}")
    if "inplace" not in lists["fields"]:
        report.notes.append("no 'inplace' field: the adapter has no in-place switch and is fuzzed once, at "
                            "the default")
    return lists


def _v2_kind_problems(kinds: dict[str, Any], others: list[str], report: Report) -> None:
    """A kvproto/2 hello's rings and pools held to the registry as ``kvspec
    fuzz --target exec:`` holds them (fuzz/adapters/exec.py hello_problems):
    a cache field or op that is not the kind's, masks for a kind whose masks
    kvproto/2 does not carry; each a problem, not only a note."""
    from kvspec.fuzz import kinds as registry

    for kind in others:
        d = kinds.get(kind)
        if kind not in ("rotating", "paged") or not isinstance(d, dict):
            continue  # the schema's sentence says so
        entry = registry.get(kind)
        lists = {k: d.get(k) if isinstance(d.get(k), list) else [] for k in ("fields", "ops", "observables")}
        fields = sorted(str(f) for f in set(map(str, lists["fields"])) - set(entry.cache_fields))
        if fields:
            report.problem("hello", f"the hello declares cache fields {fields} for kind {kind}, which the {kind} kind "
                                    f"does not have (docs/kvtrace.md: {', '.join(entry.cache_fields)}); kvspec "
                                    "refuses such a hello: drop them or spell them as the trace format does")
        ops = sorted(set(map(str, lists["ops"])) - set(entry.all_ops) - set(entry.refuses) - {"expect"})
        if ops:
            report.problem("hello", f"the hello declares ops {ops} for kind {kind}, which the {kind} kind does not "
                                    f"have (docs/kvtrace.md: {', '.join(o for o in entry.all_ops if o != 'expect')}); "
                                    "kvspec refuses such a hello: drop them or spell them as the trace format does")


def _cache_for(declared: dict[str, Any], dtype: str | None = None) -> dict[str, Any]:
    dtype = dtype or ("float16" if "float16" in declared["dtypes"] else (declared["dtypes"] or ["float16"])[0])
    full = {**CACHE, "dtype": dtype}
    return {k: v for k, v in full.items() if k in declared["fields"] or k in ("kind", "rows")}


def _shape(cache_: dict[str, Any], windows: str, wide: bool = False) -> _Shape:
    """The shape of the canned cache as sent (an undeclared field at the dense default)."""
    d = cache_.get("head_dim", 8)
    return _Shape(cache_.get("batch", 1), cache_.get("kv_heads", 2), cache_.get("k_head_dim", d),
                  cache_.get("v_head_dim", d), cache_.get("dtype", "float16"), windows, wide)


class _Checker:
    """The canned sessions against one adapter."""

    version = KVPROTO

    def __init__(self, argv: list[str], timeout: float, report: Report):
        self.argv, self.timeout, self.report = argv, timeout, report
        self.declared: dict[str, Any] = {}
        self.shape: _Shape | None = None

    def start(self, label: str) -> _Session | None:
        try:
            return _Session(self.argv, self.timeout, self.report, label)
        except OSError as exc:
            why = exc.strerror or str(exc)
            fix = ("build it first, or give its path (./adapter, not adapter)" if isinstance(exc, FileNotFoundError)
                   else "make it executable (chmod +x) and give it a #! line" if isinstance(exc, PermissionError)
                   else "check the command line")
            self.report.problem("start", f"started {shlex.join(self.argv)}; it could not start ({why}); {fix}")
            return None

    def hello(self) -> _Session | None:
        s = self.start("hello")
        if s is None:
            return None
        try:
            reply = s.ask("hello", dict(HELLO), part="hello_reply")
        except _Dead:
            return None
        if isinstance(reply.get("kvproto"), int) and reply["kvproto"] in range(KVPROTO, KVPROTO_MAX + 1):
            self.version = reply["kvproto"]
        declared = _hello_problems(reply, self.report)
        if declared is None:
            if isinstance(reply.get("kinds"), dict) and not any(p.step == "hello" for p in self.report.problems):
                self.report.passed.append("hello")
            s.bye()
            return None
        self.declared = declared
        windows = str(reply["windows"]) if reply.get("windows") in ("bytes", "identities") else "bytes"
        cache_ = _cache_for(declared)
        self.shape = _shape(cache_, windows)
        if not any(p.step == "hello" for p in self.report.problems):
            self.report.passed.append("hello")
        return s

    # -- one reply against the contract ---------------------------------------------------
    def expect(self, s: _Session, step: str, body: dict[str, Any], rows: list[int], *, result: Any = "skip",
               refused: str | None = None, held: list[int] | None | str = "skip",
               holders: dict[str, list[int]] | None = None) -> None:
        before = len(self.report.problems)
        reply = s.ask(step, body)
        sent = _short({"id": s.next_id - 1, **body}, 160)
        ok = reply.get("ok")
        err: dict[str, Any] = reply["error"] if isinstance(reply.get("error"), dict) else {}
        if refused is not None:
            if ok is True:
                self.report.problem(step, f"sent {sent}; it answered ok; the contract refuses this op "
                                          f"({refused}): answer ok false with error category {refused!r}")
            elif ok is False and err.get("category") not in (refused, None):
                self.report.problem(step, f"sent {sent}; it refused with category {err.get('category')!r}; the "
                                          f"contract's category here is {refused!r} (categories are compared, "
                                          "messages never): use that category")
        elif ok is False:
            self.report.problem(step, f"sent {sent}; it refused ({err.get('category')}: "
                                      f"{_short(err.get('message', ''), 80)}); the contract runs this op: run it")
        if refused is None and ok is True and result != "skip":
            self._result(step, sent, reply, result)
        self._state(step, sent, reply, rows, held, holders, refused)
        if len(self.report.problems) == before:
            self.report.passed.append(step)

    def _result(self, step: str, sent: str, reply: dict[str, Any], result: Any) -> None:
        assert self.shape is not None
        if self.diverged:
            return
        got = reply.get("result")
        if isinstance(result, list):  # an append's returned window
            names, why = self.shape.name_rows(got)
            if names is None:
                if why != "it is not a window":
                    self.report.problem(step, f"sent {sent}; the returned window is unreadable: {why}; the protocol "
                                              f"wants [B, H, n, D] in C order, {self.shape.width} little-endian bytes "
                                              f"an element for {self.shape.dtype}: lay the tensors out so")
                elif "result" not in reply:
                    self.report.problem(step, f"sent {sent}; the reply has no result; an append's result is the "
                                              "window it returns (the live rows): add it")
            elif names != result:
                self.report.problem(step, f"sent {sent}; the returned window holds rows {names}; the contract's is "
                                          f"{result}{_UNKNOWN_ROWS if '?' in names else ''}: return the live window "
                                          "after the append (the rest of this session's states follow from it and "
                                          "are not compared)")
                self.diverged = True
        elif result is None:
            if got is not None:
                self.report.problem(step, f"sent {sent}; result is {_short(got)}; this op returns nothing: send "
                                          "null or leave result out")
        elif got != result or isinstance(got, bool):
            self.report.problem(step, f"sent {sent}; result is {_short(got)}; the contract's is {result} (rows "
                                      "removed for trim and trim_to): return it")

    def _state(self, step: str, sent: str, reply: dict[str, Any], rows: list[int], held: Any,
               holders: dict[str, list[int]] | None, refused: str | None = None) -> None:
        assert self.shape is not None
        st = reply.get("state")
        if self.diverged:
            return  # the state follows from an earlier problem of this session: said once
        if not isinstance(st, dict):
            if "state" not in reply:
                self.report.problem(step, f"sent {sent}; the reply has no state; every reply to init and op "
                                          "carries the state after it (observables, cache, held, holders): add it")
            return
        want = {"offset": None, "live_start": 0, "live_len": len(rows)}
        got_parts: list[str] = []
        want_parts: list[str] = []
        for name in self.declared["observables"]:
            if name not in OBSERVABLES:
                continue
            if name not in st:
                self.report.problem(step, f"sent {sent}; its state lacks {name}, which the hello declares among its "
                                          "observables; a declared observable is in every state line: report it "
                                          "(or stop declaring it)")
                continue
            got = st[name]
            expected = want.get(name)
            if name == "capacity":
                if isinstance(got, int) and not isinstance(got, bool) and got < len(rows):
                    self.report.problem(step, f"sent {sent}; capacity is {got} with {len(rows)} live rows; capacity "
                                              "is the rows the buffers hold (live_len <= capacity): report that")
            elif name == "offset":
                if self._offset is not None and got != self._offset:
                    got_parts.append(f"offset {_short(got)}")
                    want_parts.append(f"offset {self._offset}")
            elif got != expected:
                got_parts.append(f"{name} {_short(got)}")
                want_parts.append(f"{name} {expected}")
        names, why = self.shape.name_rows(st.get("cache"))
        if names is None:
            if "cache" in st:
                self.report.problem(step, f"sent {sent}; the state's cache window is unreadable: {why}; the protocol "
                                          f"wants [B, H, n, D] in C order, {self.shape.width} little-endian bytes an "
                                          f"element for {self.shape.dtype}: lay the tensors out so")
        elif names != rows:
            got_parts.append(f"live rows {names}{_UNKNOWN_ROWS if '?' in names else ''}")
            want_parts.append(f"live rows {rows}")
        if got_parts:
            rule = ("a refused op changes nothing" if refused else
                    "docs/dense.md: offset counts tokens kept, trims lower it, the live window is the rows kept, "
                    "oldest first")
            self.report.problem(step, f"sent {sent}; the state after it has {', '.join(got_parts)}; the contract's "
                                      f"is {', '.join(want_parts)} ({rule}): fix the op (the rest of this "
                                      "session's states follow from it and are not compared)")
            self.diverged = True
        if held != "skip" and "held" in st:
            hnames = None if st["held"] is None else self.shape.name_rows(st["held"])[0]
            if hnames != held and not self.diverged:
                self.diverged = True
                self.report.problem(step, f"sent {sent}; held is {hnames if hnames is not None else 'null'}; the "
                                          f"contract's is {held if held is not None else 'null'} (the window hold "
                                          "keeps alive): report it")
        if holders is not None and isinstance(st.get("holders"), dict):
            got_h = {k: self.shape.name_rows(w)[0] for k, w in st["holders"].items()}
            if got_h != holders and not self.diverged:
                self.diverged = True
                self.report.problem(step, f"sent {sent}; holders are {got_h}; the contract's are {holders} (every "
                                      "snapshot by name, its rows as taken): report them")

    _offset: int | None = None
    diverged = False

    def run(self, s: _Session, steps: list[tuple[str, dict[str, Any], dict[str, Any]]], dtype: str | None = None,
            wide: bool = False) -> None:
        """Init, then each step ``(label, op, expectation)`` whose op the
        hello declares; stop this session when the adapter is gone."""
        cache_ = _cache_for(self.declared, dtype)
        self.shape = _shape(cache_, self.shape.windows if self.shape else "bytes", wide)
        self.diverged = False
        try:
            self._offset = 0
            self.expect(s, f"{s.label}: init", {"request": "init", "cache": cache_, "wide": wide}, [], held=None, holders={})
            first = 0
            for label, op, exp in steps:
                if op["op"] not in self.declared["ops"] and op["op"] != "no_such_op":
                    continue
                if "snapshot" not in self.declared["ops"]:
                    exp.pop("holders", None)
                if "hold" not in self.declared["ops"]:
                    exp.pop("held", None)
                body: dict[str, Any] = {"request": "op", "op": op}
                if op["op"] == "append":
                    body["first"] = first
                    first += op["n"] if exp.get("refused") is None else 0
                self._offset = exp.pop("offset", self._offset)
                self.expect(s, f"{s.label}: {label}", body, **exp)
        except _Dead:
            self.report.notes.append(f"the {s.label} session stopped where the adapter did; its later steps did "
                                     "not run")
            return
        s.bye()


Step = tuple[str, dict[str, Any], dict[str, Any]]


def _sessions(declared: dict[str, Any]) -> list[tuple[str, list[Step]]]:
    """The canned sessions: (name, steps); each step (label, op, expectation)."""
    basic: list[Step] = [
        ("op append n=3", {"op": "append", "n": 3}, {"rows": [0, 1, 2], "result": [0, 1, 2], "offset": 3}),
        ("op fetch", {"op": "fetch"}, {"rows": [0, 1, 2], "result": None}),
        ("op trim n=1", {"op": "trim", "n": 1}, {"rows": [0, 1], "result": 1, "offset": 2}),
        ("op append n=2", {"op": "append", "n": 2}, {"rows": [0, 1, 3, 4], "result": [0, 1, 3, 4], "offset": 4}),
        ("op trim n=-1", {"op": "trim", "n": -1}, {"rows": [0, 1, 3, 4], "result": 0}),
        ("op trim_to len=1", {"op": "trim_to", "len": 1}, {"rows": [0], "result": 3, "offset": 1}),
    ]
    holders: list[Step] = [
        ("op append n=2", {"op": "append", "n": 2}, {"rows": [0, 1], "result": [0, 1], "offset": 2}),
        ("op hold", {"op": "hold"}, {"rows": [0, 1], "held": [0, 1]}),
        ("op snapshot", {"op": "snapshot", "name": "s"}, {"rows": [0, 1], "holders": {"s": [0, 1]}}),
        ("op append n=1", {"op": "append", "n": 1}, {"rows": [0, 1, 2], "result": [0, 1, 2], "offset": 3,
                                                     "holders": {"s": [0, 1]}}),
        ("op restore", {"op": "restore", "name": "s"}, {"rows": [0, 1], "offset": 2, "holders": {"s": [0, 1]}}),
        ("op release_hold", {"op": "release_hold"}, {"rows": [0, 1], "held": None}),
        ("op drop", {"op": "drop", "name": "s"}, {"rows": [0, 1], "holders": {}}),
    ]
    refusals: list[Step] = [
        ("op hold before any append (refused)", {"op": "hold"}, {"rows": [], "refused": "state", "held": None}),
        ("op append n=2", {"op": "append", "n": 2}, {"rows": [0, 1], "offset": 2}),
        ("op trim_to past the offset (refused)", {"op": "trim_to", "len": 5},
         {"rows": [0, 1], "refused": "invalid_argument"}),
        ("op restore of an unknown name (refused)", {"op": "restore", "name": "nosuch"},
         {"rows": [0, 1], "refused": "state"}),
        ("op snapshot", {"op": "snapshot", "name": "a"}, {"rows": [0, 1], "holders": {"a": [0, 1]}}),
        ("op snapshot of a name in use (refused)", {"op": "snapshot", "name": "a"},
         {"rows": [0, 1], "refused": "state", "holders": {"a": [0, 1]}}),
        ("bad request: an op no adapter has (refused)", {"op": "no_such_op"}, {"rows": [0, 1], "refused": "unsupported"}),
        ("op fetch after the bad request", {"op": "fetch"}, {"rows": [0, 1], "result": None}),
    ]
    out: list[tuple[str, list[Step]]] = [("basic", basic), ("holders", holders), ("refusals", refusals)]
    # every other dtype it declares, with wide rows (token 2 is beyond float16's range)
    for dtype in declared["dtypes"]:
        if dtype != "float16" and dtype in ("bfloat16", "float32"):
            out.append((f"dtype {dtype}", [("op append n=3", {"op": "append", "n": 3},
                                            {"rows": [0, 1, 2], "result": [0, 1, 2], "offset": 3})]))
    return out


def check_command(argv: list[str], timeout: float = DEFAULT_TIMEOUT) -> Report:
    """Check the adapter program ``argv`` (see the module docstring)."""
    report = Report(shlex.join(argv))
    checker = _Checker(list(argv), timeout, report)
    first = checker.hello()
    if first is None:
        return report
    undeclared = sorted({op["op"] for _, steps in _sessions(checker.declared) for _, op, _ in steps}
                        - set(checker.declared["ops"]) - {"no_such_op"})
    if undeclared:
        report.notes.append(f"not checked (not among the ops the hello declares): {', '.join(undeclared)}")
    for i, (name, steps) in enumerate(_sessions(checker.declared)):
        s = first if i == 0 else checker.start(name)
        if s is None:
            break
        s.label = name
        dtype = name.removeprefix("dtype ") if name.startswith("dtype ") else None
        checker.run(s, [(label, op, dict(exp)) for label, op, exp in steps], dtype, wide=dtype is not None)
    return report


# -- a cache class --------------------------------------------------------------------------------

#: the canned trace run on a class (the ops it does not have are left out)
CLASS_TRACE = {"kvtrace": 1, "cache": {"kind": "dense", "step": 4, "kv_heads": 2, "head_dim": 4},
               "ops": [{"op": "append", "n": 3}, {"op": "fetch"}, {"op": "trim", "n": -1}, {"op": "trim", "n": 1},
                       {"op": "snapshot", "name": "s"},
                       {"op": "append", "n": 2}, {"op": "trim_to", "len": 1}, {"op": "restore", "name": "s"},
                       {"op": "trim_to", "len": 5, "error": True}, {"op": "drop", "name": "s"}]}
RING_TRACE = {"kvtrace": 1, "cache": {"kind": "rotating", "max_size": 4, "keep": 0, "step": 4, "kv_heads": 2,
                                      "head_dim": 4},
              "ops": [{"op": "append", "n": 3}, {"op": "fetch"}, {"op": "append", "n": 1}, {"op": "append", "n": 1},
                      {"op": "trim", "n": 1}]}


def check_class(spec: str) -> Report:
    """Check a cache class target ``module:Class`` (or any ``--target``
    that names a target): its declaration, the members the target API
    needs, and a small canned trace replayed against the spec. Raises
    kvspec.fuzz.targets.TargetError when ``spec`` names nothing importable (a
    usage error)."""
    import inspect

    from kvspec.fuzz import targets
    from kvspec.fuzz.targets import CLASS_KINDS, REQUIRED_METHODS, TargetError

    report = Report(spec)
    obj = None
    if targets._MODULE_ATTR.fullmatch(spec) and spec not in targets.BUILTIN:
        module = spec.partition(":")[0]
        try:
            obj = targets._load(spec)
        except ModuleNotFoundError as exc:
            raise TargetError(f"--target {spec}: module {module!r} cannot be imported ({exc}); is its package "
                              "installed or on PYTHONPATH?") from None
        except AttributeError as exc:
            raise TargetError(f"--target {spec}: {exc}") from None
    if inspect.isclass(obj):
        kind = getattr(obj, "kvspec_kind", None)
        if kind not in CLASS_KINDS:
            report.problem("class", f"class {obj.__qualname__} has kvspec_kind = {kind!r}; a class target "
                                    f"declares its kind: add kvspec_kind = \"dense\" (or \"rotating\")")
        for m in REQUIRED_METHODS:
            if not hasattr(obj, m) and m != "offset":
                report.problem("class", f"class {obj.__qualname__} has no {m}(); every target needs "
                                        f"update_and_fetch(keys, values) and fetch(): add it (docs/targets.md)")
        if report.problems:
            return report
    try:
        target = targets.resolve(spec)
    except TargetError as exc:
        if obj is None:
            raise
        report.problem("class", f"{exc}")
        return report
    for c in target.classes:
        if c.skipped:
            report.notes.append(f"{c.name} ({c.kind}/{c.mode}) skips {', '.join(sorted(c.skipped))} "
                                "(not in the class: never generated, reported)")
    kinds_run = [k for k, _ in target.configs()]
    for kind, doc in (("dense", CLASS_TRACE), ("rotating", RING_TRACE)):
        if kind in kinds_run:
            _class_session(target, kind, doc, report)
    return report


def _class_session(target: Any, kind: str, doc: dict[str, Any], report: Report) -> None:
    from kvspec.fuzz.failures import TargetCapabilityError
    from kvspec.fuzz.lockstep import Divergence
    from kvspec.fuzz.replay import make_lockstep
    from kvspec.fuzz.trace import TraceFormatError, parse

    c = target.cache_class(kind, "fp16")
    ops = [op for op in doc["ops"] if c is None or op["op"] not in c.skipped]
    step = f"canned {kind} trace"
    try:
        trace = parse({**doc, "ops": ops})
        target.check(trace.cache, trace.ops)
        lock = make_lockstep(trace.cache, None, False, target)
        for note in sorted(getattr(lock, "not_compared", ())):
            if note != "masks":
                report.notes.append(f"{kind}: {note} not compared (the class does not provide it)")
        for i, op in enumerate(trace.ops):
            lock.step(i, op)
    except Divergence as d:
        text = " ".join(str(d).split())
        report.problem(step, f"replayed {len(ops)} canned ops ({', '.join(o['op'] for o in ops)}); the class "
                             f"diverges from the spec: {text[:400]}; fix the class where it breaks that rule "
                             "(kvspec replay of a kvtrace with these ops shows it)")
        return
    except (TargetCapabilityError, TraceFormatError) as exc:
        report.problem(step, f"built its cache for {json.dumps(doc['cache'])}; {exc}; make the class take the "
                             "trace's cache fields its __init__ names, or add a kvspec_make(cache) classmethod")
        return
    except Exception as exc:  # noqa: BLE001 - the class's own crash, said in a sentence
        report.problem(step, f"replayed {len(ops)} canned ops; the class raised {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}; fix the class so the canned trace runs")
        return
    report.passed.append(step)
