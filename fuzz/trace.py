"""kvtrace/1: load, validate and write operation traces.

The format is specified in ``shared/reference/kvtrace.md``; its machine form
is ``fuzz/kvtrace.schema.json`` (JSON Schema 2020-12), checked with the
``jsonschema`` library. A file that fails validation raises
:class:`TraceFormatError`, whose message names the op index and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from fuzz import kinds


def cache_defaults(kind: str, mode: str | None = None) -> dict[str, Any]:
    """The defaults of the optional cache fields of ``kind`` in ``mode``
    (fuzz/kinds.py)."""
    try:
        return kinds.get(kind, mode).defaults()
    except kinds.UnknownKindError:
        return dict(kinds.COMMON_FIELDS)


class TraceFormatError(Exception):
    """The document is not a valid kvtrace/1 trace (replay exit status 2)."""


def schema() -> dict[str, Any]:
    """The kvtrace/1 JSON Schema shipped with the package."""
    text = resources.files("fuzz").joinpath("kvtrace.schema.json").read_text()
    return json.loads(text)


_VALIDATOR: jsonschema.Draft202012Validator | None = None


def _strict_integer(checker: object, instance: object) -> bool:
    # JSON Schema counts 1.0 as an integer; a trace's counts and indices
    # must be written as integers.
    return isinstance(instance, int) and not isinstance(instance, bool)


def _validator() -> jsonschema.Draft202012Validator:
    global _VALIDATOR
    if _VALIDATOR is None:
        base = jsonschema.Draft202012Validator
        strict = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _strict_integer))
        _VALIDATOR = strict(schema())
    return _VALIDATOR


def _describe(err: jsonschema.ValidationError) -> str:
    path = list(err.absolute_path)
    where = "document"
    if path[:1] == ["ops"] and len(path) >= 2:
        where = f"op {path[1]}"
        if len(path) >= 3:
            where += f" field {'.'.join(str(p) for p in path[2:])!r}"
    elif path:
        where = "field " + ".".join(str(p) for p in path)
    return f"{where}: {err.message}"


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
    """Raise TraceFormatError naming the op index and field of the first
    (most relevant) schema violation."""
    errors = sorted(_validator().iter_errors(doc), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        # A field of the wrong type also leaves that field "unevaluated";
        # name the type error, not the knock-on one.
        primary = [e for e in errors if e.validator != "unevaluatedProperties"] or errors
        best = jsonschema.exceptions.best_match(primary)
        raise TraceFormatError(_describe(best))


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
    return Trace(cache=cache, ops=list(doc["ops"]), title=doc.get("title", ""))


def load(path: str | Path) -> Trace:
    """Read and validate a trace file. Raises TraceFormatError for unreadable
    files, bad JSON (with line and column) and schema violations."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceFormatError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return parse(doc)


def write(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace.dumps())
    return path
