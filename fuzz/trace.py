"""kvtrace/1: load, validate and write operation traces.

The format is specified in ``docs/kvtrace.md``; its machine form is
``fuzz/kvtrace.schema.json`` (JSON Schema 2020-12), checked with the
``jsonschema`` library. A document that fails raises
:class:`TraceFormatError`, whose message lists every problem in document
order, each naming the op index and field.

A trace is untrusted input, so loading is strict and bounded (the limits
below, documented in docs/kvtrace.md "Loading: strict, bounded, fast"):
UTF-8 only, no duplicate keys, no ``NaN``/``Infinity``, bounded size,
nesting, op count and buffer size. Validation is fast: ops are checked by a
validator compiled from the schema's own op rules (:class:`_OpChecker`), and
only the ops it rejects go through ``jsonschema`` for their messages.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from kvspec.fuzz import kinds


def cache_defaults(kind: str, mode: str | None = None) -> dict[str, Any]:
    """The defaults of the optional cache fields of ``kind`` in ``mode``
    (fuzz/kinds.py)."""
    try:
        return kinds.get(kind, mode).defaults()
    except kinds.UnknownKindError:
        return dict(kinds.COMMON_FIELDS)


#: Largest trace file read, in bytes.
MAX_BYTES = 64 * 2**20
#: Deepest nesting of JSON arrays and objects (a trace needs 4).
MAX_DEPTH = 64
#: Most ops in one trace (also ``maxItems`` in the schema); checked before
#: any op is validated.
MAX_OPS = 1_000_000
#: Most elements one K or V tensor of the trace's cache may need:
#: ``rows * batch * kv_heads * head_dim`` (32 MiB of float16).
MAX_ELEMENTS = 2**24
#: Most rows one trace may append (token identities handed out): the bound
#: below which portable rows are distinct (kvspec.spec.rows.TOKEN_LIMIT, 2^24).
MAX_TOKENS = 2**24
#: Problems printed at most; the rest are counted.
MAX_ERRORS_SHOWN = 20
#: A prefix trace (docs/kvtrace.md "The prefix kind"): replay names every
#: slot of the pool, and every row a slot holds by its token prefix, after
#: every op, so an op costs time in proportion to the slots and to the
#: tokens the pool holds. Most slots (``n_blocks * block_size``) of a pool:
#: 256 keep an op to tens of milliseconds (the fuzzer draws at most 48).
MAX_PREFIX_SLOTS = 256
#: Most tokens in one prefix op's list (an admit's, decode's or lookup's
#: ``tokens``, an expect's ``window``): twice the largest pool, room for a
#: prompt the pool cannot hold.
MAX_PREFIX_OP_TOKENS = 512
#: Most tokens the admits and decodes of one prefix trace hand the pool in
#: all (they bound the longest request, so every row's name).
MAX_PREFIX_TOKENS = 1024


class TraceFormatError(Exception):
    """The document is not a valid kvtrace/1 trace (replay exit status 2)."""


def schema() -> dict[str, Any]:
    """The kvtrace/1 JSON Schema shipped with the package."""
    text = resources.files("kvspec.fuzz").joinpath("kvtrace.schema.json").read_text()
    return json.loads(text)


def _strict_integer(checker: object, instance: object) -> bool:
    # JSON Schema counts 1.0 as an integer; a trace's counts and indices
    # must be written as integers.
    return isinstance(instance, int) and not isinstance(instance, bool)


_VALIDATORS: dict[str, Any] = {}


def _validator(part: str = "document") -> Any:
    """A cached ``jsonschema`` validator of the whole document, or of one op
    (``part="op"``), with strict integers."""
    if part not in _VALIDATORS:
        base = jsonschema.Draft202012Validator
        strict = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _strict_integer))
        doc = schema()
        if part == "op":
            doc = {"$defs": doc["$defs"], "$ref": "#/$defs/op"}
        _VALIDATORS[part] = strict(doc)
    return _VALIDATORS[part]


# -- the compiled op checker -----------------------------------------------------
_TYPES = {
    "null": lambda x: x is None,
    "integer": lambda x: _strict_integer(None, x),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "array": lambda x: isinstance(x, list),
    "object": lambda x: isinstance(x, dict),
}
_SUPPORTED = {"type", "minimum", "maximum", "minLength", "maxLength", "maxItems", "items", "enum", "const", "$ref",
              "properties", "required", "additionalProperties"}


class _OpChecker:
    """Says whether one op is valid, exactly as the schema's ``$defs/op``
    would, at a fraction of the cost. Built from the schema itself: the op
    names, each ``if op is X then ...`` clause and the common properties; a
    schema keyword it does not know makes construction fail (so a schema
    change cannot silently loosen validation; tests/test_trace.py also
    compares it with jsonschema on drawn ops)."""

    def __init__(self, doc: dict[str, Any]):
        self.defs = doc["$defs"]
        op = self.defs["op"]
        self.names = frozenset(op["properties"]["op"]["enum"])
        common: dict[str, Any] = {}
        self.rules: dict[str, tuple[frozenset[str], dict[str, Any]]] = {}
        specific: dict[str, list[dict[str, Any]]] = {n: [] for n in self.names}
        for entry in op["allOf"]:
            if "if" not in entry:
                common.update(entry["properties"])
                continue
            cond = entry["if"]["properties"]["op"]
            names = [cond["const"]] if "const" in cond else cond["enum"]
            for n in names:
                if n in specific:  # a rule for an op no kind runs yet is inert
                    specific[n].append(entry["then"])
        for n in self.names:
            props = dict(common)
            required: set[str] = {"op"}
            for then in specific[n]:
                props.update(then.get("properties", {}))
                required.update(then.get("required", ()))
            props = {k: self._compile(v) for k, v in props.items()}
            props["op"] = lambda x: True
            self.rules[n] = (frozenset(required), props)

    def _compile(self, s: dict[str, Any]) -> Any:
        while "$ref" in s:
            s = self.defs[s["$ref"].rsplit("/", 1)[1]]
        unknown = set(s) - _SUPPORTED
        if unknown:
            raise ValueError(f"_OpChecker: schema keywords {sorted(unknown)} are not compiled")
        checks = []
        if "type" in s:
            # a list of types (``["integer", "null"]``): any of them; each
            # keyword below then applies to its own type only, as in JSON Schema
            types = [_TYPES[t] for t in ([s["type"]] if isinstance(s["type"], str) else s["type"])]
            checks.append(lambda x: any(t(x) for t in types))

        def number(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if "minimum" in s:
            lo = s["minimum"]
            checks.append(lambda x: not number(x) or x >= lo)
        if "maximum" in s:
            hi = s["maximum"]
            checks.append(lambda x: not number(x) or x <= hi)
        if "minLength" in s:
            ml = s["minLength"]
            checks.append(lambda x: not isinstance(x, str) or len(x) >= ml)
        if "maxLength" in s:
            xl = s["maxLength"]
            checks.append(lambda x: not isinstance(x, str) or len(x) <= xl)
        if "enum" in s:
            allowed = s["enum"]
            checks.append(lambda x: any(x == a and type(x) is type(a) for a in allowed))
        if "const" in s:
            const = s["const"]
            checks.append(lambda x: x == const and type(x) is type(const))
        if "maxItems" in s:
            mi = s["maxItems"]
            checks.append(lambda x: not isinstance(x, list) or len(x) <= mi)
        if "items" in s:
            item = self._compile(s["items"])
            checks.append(lambda x: not isinstance(x, list) or all(item(v) for v in x))
        if {"properties", "required", "additionalProperties"} & set(s):
            props = {k: self._compile(v) for k, v in s.get("properties", {}).items()}
            needed = frozenset(s.get("required", ()))
            closed = s.get("additionalProperties", True)
            if not isinstance(closed, bool):
                raise ValueError("_OpChecker: additionalProperties must be true or false")

            def obj(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True  # these keywords apply to objects only
                if not needed.issubset(x):
                    return False
                return all(props[k](v) if k in props else closed for k, v in x.items())

            checks.append(obj)
        return lambda x: all(c(x) for c in checks)

    def ok(self, op: Any) -> bool:
        if not isinstance(op, dict):
            return False
        name = op.get("op")
        if not isinstance(name, str) or name not in self.names:
            return False
        required, props = self.rules[name]
        if not required.issubset(op):
            return False
        for key, value in op.items():
            check = props.get(key)
            if check is None or not check(value):
                return False
        return True


_CHECKER: _OpChecker | None = None


def _op_checker() -> _OpChecker:
    global _CHECKER
    if _CHECKER is None:
        _CHECKER = _OpChecker(schema())
    return _CHECKER


# -- messages ----------------------------------------------------------------------
def _where(path: list[Any]) -> str:
    if path[:1] == ["ops"] and len(path) >= 2:
        where = f"op {path[1]}"
        if len(path) >= 3:
            where += f" field {'.'.join(str(p) for p in path[2:])!r}"
        return where
    if path:
        return "field " + ".".join(str(p) for p in path)
    return "document"


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind_ops(doc: Any) -> tuple[str, tuple[str, ...]] | None:
    """``(kind, ops)``: the ops a trace's cache kind (in its mode) runs, for
    the unknown-op message; None when the cache names no known kind."""
    cache = doc.get("cache") if isinstance(doc, dict) else None
    name = cache.get("kind") if isinstance(cache, dict) else None
    if not isinstance(name, str):
        return None
    mode = cache.get("mode")
    try:
        kind = kinds.get(name, mode if isinstance(mode, str) else None)
    except kinds.UnknownKindError:
        try:
            kind = kinds.get(name)
        except kinds.UnknownKindError:
            return None
    return kind.kind, tuple(op for op in kind.all_ops if op not in kind.without)


def _messages(errors: list[jsonschema.ValidationError], prefix: list[Any],
              kind_ops: tuple[str, tuple[str, ...]] | None = None) -> list[tuple[list[Any], str]]:
    """One message per problem. Knock-on errors are dropped: a field of the
    wrong type also leaves that field "unevaluated", and an op whose name is
    missing or unknown has no rule for its other fields. ``kind_ops``
    (:func:`_kind_ops`): an unknown op's message lists that kind's ops."""
    out = []
    real = [e for e in errors if e.validator != "unevaluatedProperties"]
    for e in real or errors:
        path = prefix + list(e.absolute_path)
        if e.validator == "required" and e.validator_value == ["op"]:
            msg = 'has no "op" (every op names its operation)'
        elif list(e.absolute_path) == ["op"] and e.validator == "enum":
            names = e.validator_value
            if kind_ops is not None:
                whose, names = f"the ops of kind {kind_ops[0]}", kind_ops[1]
            else:
                whose = "the ops of every kind"
            msg = (f"unknown op {_short(repr(e.instance), 60)}{_did_you_mean(e.instance, names)}; "
                   f"known: {', '.join(names)} ({whose})")
        elif e.validator == "enum":
            msg = _short(e.message) + _did_you_mean(e.instance, e.validator_value)
        elif e.validator in ("additionalProperties", "unevaluatedProperties") and isinstance(e.instance, dict):
            known = list(e.schema.get("properties") or {})
            extra = [k for k in e.instance if k not in known]
            msg = _short(e.message) + "".join(_did_you_mean(k, known) for k in extra[:1])
        elif e.validator == "required" and isinstance(e.instance, dict):
            missing = [k for k in e.validator_value if k not in e.instance]
            close = [k for k in e.instance if missing and _did_you_mean(k, missing)]
            msg = _short(e.message) + (f" (is {close[0]!r} a misspelling of it?)" if close else "")
        else:
            msg = _short(e.message)
        if (path, msg) not in out:
            out.append((path, msg))
    return out


def _did_you_mean(word: Any, known: Any) -> str:
    """`` (did you mean 'x'?)`` for a misspelled name, else the empty string."""
    import difflib

    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [k for k in known if isinstance(k, str)], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _order(doc: Any, path: list[Any]) -> tuple[Any, ...]:
    """Sort key: document order (the file's key order at the top level, op
    index, then the path)."""
    keys = list(doc) if isinstance(doc, dict) else []
    head = keys.index(path[0]) if path and path[0] in keys else -1
    return (head, *[(0, p) if isinstance(p, int) else (1, str(p)) for p in path[1:]])


def _raise(problems: list[tuple[list[Any], str]], doc: Any, more: int = 0) -> None:
    problems = sorted(problems, key=lambda pm: _order(doc, pm[0]))
    shown = problems[:MAX_ERRORS_SHOWN]
    hidden = len(problems) - len(shown) + more
    lines = [f"{_where(p)}: {m}" for p, m in shown]
    if hidden:
        lines.append(f"... and {hidden} more")
    head = lines[0] if len(lines) == 1 else f"{len(problems) + more} problems:\n  " + "\n  ".join(lines)
    raise TraceFormatError(head)


@dataclass
class Trace:
    """A parsed trace: the cache configuration (defaults filled in) and the
    ops as plain dicts, exactly as in the file."""

    cache: dict[str, Any]
    ops: list[dict[str, Any]]
    title: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kvtrace": 1}
        if self.title:
            doc["title"] = self.title
        doc["cache"] = self.cache
        doc["ops"] = self.ops
        return doc

    def dumps(self) -> str:
        """One op per line: readable in a bug report and in a diff."""
        head = {k: v for k, v in self.to_json().items() if k != "ops"}
        lines = json.dumps(head, indent=2)[:-2]
        ops = ",\n".join("    " + json.dumps(op) for op in self.ops)
        return lines + ',\n  "ops": [\n' + ops + "\n  ]\n}\n"


def validate(doc: Any) -> None:
    """Raise TraceFormatError listing every schema violation in document
    order (at most MAX_ERRORS_SHOWN, then a count), each naming the op
    index and field. More than MAX_OPS ops is refused before any op is
    looked at."""
    ops = doc.get("ops") if isinstance(doc, dict) else None
    if isinstance(ops, list) and len(ops) > MAX_OPS:
        raise TraceFormatError(f"field ops: {len(ops)} ops, more than the limit of {MAX_OPS}")
    if isinstance(ops, list):
        head = {k: (v if k != "ops" else []) for k, v in doc.items()}
    else:
        head = doc
    problems = _messages(list(_validator().iter_errors(head)), [])
    more = 0
    if isinstance(ops, list):
        kind_ops = _kind_ops(doc)
        checker = _op_checker()
        bad = [i for i, op in enumerate(ops) if not checker.ok(op)]
        for i in bad[:MAX_ERRORS_SHOWN]:
            found = _messages(list(_validator("op").iter_errors(ops[i])), ["ops", i], kind_ops)
            if not found:  # pragma: no cover - the checker and the schema disagree
                found = [(["ops", i], "rejected by the op checker")]
            problems += found
        more = max(0, len(bad) - MAX_ERRORS_SHOWN)
    if problems:
        _raise(problems, doc, more)


def _rows_bound(cache: dict[str, Any], ops: list[dict[str, Any]]) -> int:
    """An upper bound on the rows any one buffer of this trace can hold."""
    appended = [op["n"] for op in ops if op["op"] == "append"]
    rows = sum(appended) + cache["step"]
    if cache["kind"] == "paged":
        # a pool block per started block of every append, plus one copied
        # on write, plus a growth chunk
        bs = cache["block_size"]
        rows = sum(n + 2 * bs for n in appended) + cache.get("chunk", 1) * bs
    if cache["kind"] == "rotating":
        rows = min(rows, cache["max_size"] + max(appended, default=0)) + cache.get("undo", 0)
    if cache["kind"] == "prefix":  # the pool's slabs, allocated whole on the first write
        rows = cache["n_blocks"] * cache["block_size"]
    return rows


#: op fields one kind needs and another refuses, where two kinds share the op
#: name (the schema states the union): (kind, op) -> (required, refused)
KIND_OP_FIELDS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("cells", "decode"): (("seqs", "pos0"), ("req",)),
    ("prefix", "decode"): (("req",), ("seqs", "pos0", "drops")),
    ("prefix", "expect"): ((), ("of", "order", "layer", "store")),
}


def _kind_op_problems(kind: str, i: int, op: dict[str, Any]) -> list[tuple[list[Any], str]]:
    """The rules of one kind's op that the schema (shared by every kind)
    cannot state: the fields a shared op name takes in this kind, the
    ``window`` of an expect (a prefix expect names its checks), and in a
    prefix trace: token and block ids (integers >= 0: a value no engine
    could be handed; an empty list or an id past the pool is the spec's
    refusal and runs), tokens per op (MAX_PREFIX_OP_TOKENS) and the shape of
    ``returns`` (:func:`_prefix_returns_problems`)."""
    out: list[tuple[list[Any], str]] = []
    name = op["op"]
    required, refused = KIND_OP_FIELDS.get((kind, name), ((), ()))
    out += [(["ops", i], f"{f!r} is a required property") for f in required if f not in op]
    out += [(["ops", i, f], f"a {kind} {name} has no field {f!r}") for f in refused if f in op]
    if name == "expect" and kind != "prefix":
        if "window" not in op:
            out.append((["ops", i], "'window' is a required property"))
        out += [(["ops", i, f], f"a {kind} expect has no field {f!r} (a prefix expect's)")
                for f in ("req", "table", "free") if f in op]
    if kind != "prefix":
        return out
    for f in ("tokens", "window"):
        if len(op.get(f, ())) > MAX_PREFIX_OP_TOKENS:
            why = (f"{len(op[f])} tokens, more than the limit of {MAX_PREFIX_OP_TOKENS} per op of a prefix "
                   "trace (replay names every row by its tokens after every op: the limit keeps a replay to "
                   f"seconds; a pool holds at most {MAX_PREFIX_SLOTS} tokens)")
            out.append((["ops", i, f], why))
        bad = [t for t in op.get(f, ()) if isinstance(t, int) and t < 0]
        if bad:
            why = f"token ids are integers >= 0 (a prefix block's key is its tokens), got {bad[0]}"
            out.append((["ops", i, f], why))
    # ids no engine could be handed: refused here; an id past the pool, or an
    # empty list, is the spec's refusal to compare and runs
    ids = {"free_blocks": ("blocks",), "expect": ("table", "free")}.get(name, ())
    for f in ids:
        bad = [b for b in op.get(f, ()) if isinstance(b, int) and b < 0]
        if bad:
            why = (f"block ids are integers >= 0, got {bad[0]} (an id past the pool is the spec's refusal "
                   "and runs; a negative one is no block id)")
            out.append((["ops", i, f], why))
    if "returns" in op:
        out += _prefix_returns_problems(i, name, op["returns"])
    if name == "expect":
        if not {"window", "table", "free"} & set(op):
            why = "a prefix expect checks something: 'window' and/or 'table' of a request ('req'), or 'free'"
            out.append((["ops", i], why + " (the free queue)"))
        if {"window", "table"} & set(op) and "req" not in op:
            why = "'req' is a required property (a prefix expect's 'window' and 'table' are a request's)"
            out.append((["ops", i], why))
    return out


#: What a prefix op returns (kvspec.spec.prefix.apply_op), as its ``returns`` check
#: must be written.
PREFIX_RETURNS = {
    "admit": 'an object {"admitted": bool, "hit": int >= 0, "table": [block ids >= 0 or null]}',
    "resume": 'an object {"admitted": bool, "hit": int >= 0, "table": [block ids >= 0 or null]}',
    "decode": "a boolean (whether the tokens found room)",
    "reset": "a boolean (whether the pool was reset)",
    "lookup": "an integer >= 0 (the hit tokens)",
}


def _is_int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _prefix_returns_problems(i: int, name: str, value: Any) -> list[tuple[list[Any], str]]:
    """The shape of a prefix op's ``returns`` (:data:`PREFIX_RETURNS`; no
    value, absent or null, for free, preempt, free_blocks and expect): a
    check of another shape could never hold, so it is the trace's format
    error (exit 2), not a failed check (exit 3)."""
    where = ["ops", i, "returns"]
    want = PREFIX_RETURNS.get(name)
    got = _short(json.dumps(value), 80)
    if want is None:
        if value is None:
            return []
        return [(where, f"a prefix {name} returns nothing: 'returns' is absent or null, got {got}")]
    if name in ("admit", "resume"):
        if not isinstance(value, dict):
            return [(where, f"a prefix {name} returns {want}, got {got}")]
        out: list[tuple[list[Any], str]] = []
        missing = [k for k in ("admitted", "hit", "table") if k not in value]
        extra = [k for k in value if k not in ("admitted", "hit", "table")]
        if missing or extra:
            what = "; ".join(x for x in (missing and f"missing {', '.join(map(repr, missing))}",
                                         extra and f"unknown {', '.join(map(repr, extra))}") if x)
            out.append((where, f"a prefix {name} returns {want}: {what}"))
        if "admitted" in value and not isinstance(value["admitted"], bool):
            out.append((where + ["admitted"], f"a boolean, got {_short(json.dumps(value['admitted']), 60)}"))
        if "hit" in value and not _is_int(value["hit"]):
            out.append((where + ["hit"], f"an integer >= 0 (hit tokens), got {_short(json.dumps(value['hit']), 60)}"))
        if "table" in value:
            table = value["table"]
            if not isinstance(table, list):
                out.append((where + ["table"], f"a list of block ids, got {_short(json.dumps(table), 60)}"))
            else:
                bad = [b for b in table if b is not None and not _is_int(b)]
                if bad:
                    why = ("block ids are integers >= 0 (null: a block a sliding window released), "
                           f"got {_short(json.dumps(bad[0]), 60)}")
                    out.append((where + ["table"], why))
        return out
    ok = isinstance(value, bool) if name in ("decode", "reset") else _is_int(value)
    return [] if ok else [(where, f"a prefix {name} returns {want}, got {got}")]


def _prefix_load_bounds(cache: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """A prefix trace's pool and tokens within :data:`MAX_PREFIX_SLOTS` and
    :data:`MAX_PREFIX_TOKENS` (TraceFormatError naming the field)."""
    slots = cache["n_blocks"] * cache["block_size"]
    if slots > MAX_PREFIX_SLOTS:
        raise TraceFormatError(
            f"field cache.n_blocks: n_blocks {cache['n_blocks']} x block_size {cache['block_size']} = {slots} slots, "
            f"more than the limit of {MAX_PREFIX_SLOTS} for a prefix trace (replay names every slot after every "
            "op: the limit keeps a replay to seconds; a bug needs a few blocks, not an engine's whole pool)"
        )
    handed = sum(len(op["tokens"]) for op in ops if op["op"] in ("admit", "decode") and "tokens" in op)
    if handed > MAX_PREFIX_TOKENS:
        raise TraceFormatError(
            f"field ops: the admits and decodes hand the pool {handed} tokens, more than the limit of "
            f"{MAX_PREFIX_TOKENS} for a prefix trace (every row is named by its tokens after every op: the limit "
            "keeps a replay to seconds)"
        )


def check_semantics(kind: kinds.Kind, cache: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Rules the schema cannot state: a ring's ``keep < max_size``, ops the
    kind neither runs nor refuses by contract (fuzz/kinds.py: a paged op on
    a dense cache), a prefix trace's ids, ``returns`` shapes and bounds
    (MAX_PREFIX_SLOTS, MAX_PREFIX_OP_TOKENS, MAX_PREFIX_TOKENS), and the
    buffer bound MAX_ELEMENTS."""
    problems: list[tuple[list[Any], str]] = []
    if cache["kind"] == "rotating" and cache["keep"] >= cache["max_size"]:
        problems.append((["cache", "keep"], f"must be < max_size ({cache['max_size']}), got {cache['keep']}"))
    known = set(kind.all_ops) | set(kind.refuses)
    for i, op in enumerate(ops):
        if "seq" in op and kind.kind == "cells":
            if not isinstance(op["seq"], int):  # out of range: the memory's refusal, compared
                problems.append((["ops", i, "seq"], f"a cells sequence id is an integer, got {op['seq']!r}"))
        elif "seq" in op and "fork" not in kind.all_ops:
            problems.append((["ops", i, "seq"], f"a {kind.kind} cache has no sequences (paged caches do)"))
        elif "seq" in op and not isinstance(op["seq"], str):
            problems.append((["ops", i, "seq"], f"a paged sequence is named by a string, got {op['seq']!r}"))
        if op["op"] not in known:
            why = f"op {op['op']!r} is not an operation of a {kind.kind} cache (its ops: {', '.join(kind.all_ops)})"
            problems.append((["ops", i], why))
        problems += _kind_op_problems(kind.kind, i, op)
    if problems:
        _raise(problems, {"cache": 0, "ops": 0})
    appended = sum(op["n"] for op in ops if op["op"] == "append")
    if appended > MAX_TOKENS:
        raise TraceFormatError(
            f"field ops: the appends hand out {appended} token identities, more than the limit of {MAX_TOKENS} "
            "(rows are distinct for identities below it)"
        )
    rows = _rows_bound(cache, ops)
    elements = rows * cache["batch"] * cache["kv_heads"] * cache["head_dim"]
    if elements > MAX_ELEMENTS:
        raise TraceFormatError(
            f"field cache: buffers of up to {rows} rows x batch {cache['batch']} x kv_heads {cache['kv_heads']} x "
            f"head_dim {cache['head_dim']} = {elements} elements per tensor, more than the limit of {MAX_ELEMENTS}"
        )
    if cache["kind"] == "prefix":
        _prefix_load_bounds(cache, ops)


def parse(doc: Any) -> Trace:
    """Validate a decoded JSON document and return the Trace."""
    validate(doc)
    try:
        kind = kinds.get(doc["cache"]["kind"], doc["cache"].get("mode", kinds.COMMON_FIELDS["mode"]))
    except kinds.UnknownKindError as exc:
        raise TraceFormatError(f"field cache.{exc.field}: {exc}") from None
    for name in doc["cache"]:
        if name not in kind.cache_fields:
            raise TraceFormatError(
                f"field cache.{name}: not a field of kind {kind.kind} in mode {doc['cache'].get('mode', 'fp16')} "
                f"(its fields: {', '.join(kind.cache_fields)})"
            )
    cache = {**kind.defaults(), **doc["cache"]}
    ops = list(doc["ops"])
    check_semantics(kind, cache, ops)
    return Trace(cache=cache, ops=ops, title=doc.get("title", ""))


# -- reading -----------------------------------------------------------------------
def nesting_depth(data: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text, brackets inside
    strings not counted. Vectorized (escaped backslashes and quotes are
    blanked first, so every remaining quote delimits a string): a 64 MiB
    file takes well under a second."""
    data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    a = np.frombuffer(data, np.uint8)
    in_string = (np.cumsum(a == ord('"')) % 2).astype(bool)
    steps = (a == ord("[")).astype(np.int8) + (a == ord("{")) - (a == ord("]")) - (a == ord("}"))
    steps[in_string] = 0
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite numbers are refused)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {_short(text, 40)} is out of range")
    return value


def loads(data: bytes | str, source: str = "trace") -> Trace:
    """Decode and validate trace text strictly (see the module docstring).
    Raises TraceFormatError naming the problem and where."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > MAX_BYTES:
        raise TraceFormatError(f"{source}: {len(data)} bytes, more than the limit of {MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}") from None
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise TraceFormatError(f"JSON nested {depth} levels deep, more than the limit of {MAX_DEPTH}")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except _DuplicateKey as exc:
        raise TraceFormatError(f"invalid JSON: key {_short(repr(exc.args[0]), 60)} appears twice in one object") from None
    except (ValueError, RecursionError) as exc:
        raise TraceFormatError(f"invalid JSON: {_short(str(exc))}") from None
    return parse(doc)


def load(path: str | Path) -> Trace:
    """Read and validate a trace file. Raises TraceFormatError for unreadable
    or oversized files, bad JSON (with line and column) and every schema
    violation."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise TraceFormatError(f"cannot read {path}: {size} bytes, more than the limit of {MAX_BYTES}")
        data = p.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    return loads(data, str(path))


def write(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace.dumps())
    return path
