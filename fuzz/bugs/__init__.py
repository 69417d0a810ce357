"""The catalog of deliberately injected bugs: the entry type and the catalog.

Production code carries no fault switches: each entry is a named subclass of
an implementation class that replaces exactly one method with a broken
version. The fuzzer must catch every entry (``kvspec verify``, ``kvspec
mutants``); an entry it misses means the checks have a hole.

Each entry names the spec clause it violates and the public bug kind or seed
it comes from, so a reviewer can follow it to the rule it breaks. Each cache
kind keeps its entries in ``fuzz/bugs/<kind>.py`` (a ``BUGS`` tuple); the
registry (``fuzz/kinds.py``) names that list, and :func:`catalog` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvspec.fuzz.kinds import KINDS


@dataclass(frozen=True)
class InjectedBug:
    """One catalog entry.

    ``factories`` maps a cache kind to the broken implementation class;
    ``kind``/``modes``/``inplace`` say which configurations the fuzzer runs to
    catch it (the first mode is the one ``kvspec verify`` uses).
    """

    name: str
    clause: str
    source: str
    kind: str
    modes: tuple[str, ...]
    replaces: str
    description: str
    factories: dict[str, Callable[..., Any]] = field(default_factory=dict)
    inplace: bool = True
    #: extra ways the kill matrix must catch it: (label, pinned cache
    #: fields, whether the in-place decision is observed). With the decision
    #: unobserved only isolation (a holder's bytes changing) can catch it.
    variants: tuple[tuple[str, dict[str, Any], bool], ...] = ()
    #: ``gpu``: the bug breaks a GPU-only path (the CUDA write layer) and is
    #: run only with ``--device gpu``; ``cpu``: it breaks a choice made only
    #: off CUDA (the host write mechanism) and is run only there; ``any``:
    #: everywhere.
    device: str = "any"


def catalog() -> list[InjectedBug]:
    """Every injected bug, kind by kind in registry order."""
    return [bug for kind in KINDS.values() for bug in kind.bug_list()]


def runnable(bug: InjectedBug) -> bool:
    """Whether ``bug`` can run on this process's device (a GPU-only bug needs
    MLX's CUDA backend and the GPU as the default device; a CPU-only bug
    anything else)."""
    if bug.device == "any":
        return True
    from kvspec.fuzz.device import current
    from kvspec.impl.write import backend

    on_cuda = current() == "gpu" and backend() == "cuda"
    return on_cuda if bug.device == "gpu" else not on_cuda


class UnknownBugError(KeyError):
    """A bug name the catalog does not have; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])


def batch_bugs() -> list[InjectedBug]:
    """The batch caches' injected bugs (``fuzz/bugs/batch.py``): not a
    kvtrace kind, so not in :func:`catalog`; ``kvspec verify`` runs them
    through the batch lockstep (``kvspec.fuzz.batch.catch``) and ``kvspec e2e
    --bug`` through the ``batch`` scenario."""
    import importlib

    return list(importlib.import_module("kvspec.fuzz.bugs.batch").BUGS)


def by_name(name: str) -> InjectedBug:
    """The catalog entry (or batch bug) called ``name``. Raises
    UnknownBugError listing the known names."""
    every = catalog() + batch_bugs()
    for bug in every:
        if bug.name == name:
            return bug
    import difflib

    known = [b.name for b in every]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownBugError(f"no injected bug named {name!r}{hint}; kvspec mutants --list names the {len(known)} known ones")
