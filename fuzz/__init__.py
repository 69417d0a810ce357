"""Differential fuzzing of ``impl`` against ``spec``: kvtrace traces,
lockstep replay, Hypothesis state machines, campaigns and the catalog of
injected bugs. Depends on ``spec`` and ``impl``; nothing depends on it.

Importing it changes no warning filter: a ``RollbackWarning`` (a rollback
a sliding-window ring cannot honour) stays visible to the code that
imports ``fuzz``. The harness compares every trim with the spec, where a
refused rollback is an expected outcome, and silences the warning only
inside its own steps (:func:`expected_refusals`, around each
``Lockstep.step``)."""

from __future__ import annotations

# the folder is the package kvspec.fuzz (pyproject.toml maps it): imported as `fuzz` it would be a
# second copy of it, beside the one the rest of kvspec uses
if __name__ != "kvspec.fuzz" and "hypofuzz" not in __import__("sys").modules:
    raise ImportError(f"{__name__}: this folder is the package kvspec.fuzz; import kvspec.fuzz")


import contextlib as _contextlib
import warnings as _warnings
from collections.abc import Iterator as _Iterator

from kvspec.spec.errors import RollbackWarning as _RollbackWarning


@_contextlib.contextmanager
def expected_refusals() -> _Iterator[None]:
    """Ignore ``kvspec.spec.errors.RollbackWarning`` inside the ``with`` block
    only (``warnings.catch_warnings``: the filters are put back on exit,
    also on an exception): for the harness's own trims, whose refusals
    the lockstep compares with the spec's. Not thread-safe (Python's
    warning filters are process-wide)."""
    with _warnings.catch_warnings():
        _warnings.filterwarnings("ignore", category=_RollbackWarning)
        yield
