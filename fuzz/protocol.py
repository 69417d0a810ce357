"""Pieces of the target API (docs/targets.md) that the harness reads and
the CLI may load without MLX: how a refusal is put in a category, and how an
observable is read from a cache object."""

from __future__ import annotations

from typing import Any

from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError

#: How refusals are compared across implementations (docs/targets.md): by
#: category, never by message text.
REFUSAL_CATEGORIES = ("invalid argument", "state", "unsupported")
_SPEC_CATEGORIES = ((InvalidArgumentError, "invalid argument"), (StateError, "state"),
                    (UnsupportedOperationError, "unsupported"))
#: what other code raises, in this order: an argument outside the rule, an
#: op the object does not do, an op refused in its current state
_BUILTIN_CATEGORIES = ((ValueError, "invalid argument"), (TypeError, "invalid argument"),
                       (IndexError, "invalid argument"), (NotImplementedError, "unsupported"),
                       (RuntimeError, "state"))


def refusal_category(exc: BaseException, extra: dict[type, str] | None = None) -> str | None:
    """The refusal category of an exception: ``extra`` (a target's own
    exception types) first, then the spec's error types, then ValueError /
    TypeError / IndexError (invalid argument), NotImplementedError
    (unsupported) and RuntimeError (state). None: not a refusal (a crash:
    AttributeError, KeyError, AssertionError, ...)."""
    for table in (tuple((extra or {}).items()), _SPEC_CATEGORIES, _BUILTIN_CATEGORIES):
        for exc_type, category in table:
            if isinstance(exc, exc_type):
                return category
    return None


#: observables read through a method, not an attribute (docs/targets.md)
OBSERVABLE_METHODS = {"trimmable": "is_trimmable", "trimmable_rows": "trimmable_rows",
                      "log_saved_rows": "log_saved_rows"}


def read_observable(cache: Any, key: str) -> Any:
    """An observable of an implementation's cache: ``offset``, ``idx``,
    ``capacity``... are attributes; ``trimmable``, ``trimmable_rows`` and
    ``log_saved_rows`` are methods (``is_trimmable()``, ...). Raises
    AttributeError when the object has no such member."""
    method = OBSERVABLE_METHODS.get(key)
    if method is not None:
        return getattr(cache, method)()
    return getattr(cache, key)
