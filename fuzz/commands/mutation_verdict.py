"""A survivor's triage verdict (docs/mutation.md, "Survivor triage")."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Verdict:
    """Why a surviving mutant is left alive.

    ``function``: the mutated function (mutmut's name without ``__mutmut_N``);
    ``change``: the mutated line (``+`` side of ``mutmut show``, stripped),
    matched exactly; ``z3``: the
    :data:`kvspec.proofs.equivalents.EQUIVALENCES` check that proves it, if any;
    ``section``: the heading of docs/mutation.md that argues it."""

    function: str
    change: str
    section: str
    z3: str = ""
    #: the argument for this mutant, when the section states only its class
    why: str = ""

    def text(self) -> str:
        where = f"equivalent, Z3 `{self.z3}`" if self.z3 else "equivalent"
        why = f" {self.why}".replace("|", "\\|") if self.why else ""
        return f"{where}: [{self.section}](#{_anchor(self.section)}){why}"


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


IDENT = "Buffer identities"
LABELS = "Labels, narrowing asserts and interchangeable operands"
EVAL = "Evaluation before the NumPy view"
MARKER = "Markers after a multi-row append"


def _changes(root: Path, names: list[str]) -> dict[str, str]:
    """Each mutant's mutated line (the ``+`` side of ``mutmut show``,
    stripped), as docs/mutation.md's triage table matches it."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    out = {}
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for name in names:
            path = Path(*name.rpartition(".")[0].split(".")).with_suffix(".py")
            diff = get_diff_for_mutant(name, path=path)
            plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            out[name] = plus[0] if plus else "(no diff)"
    finally:
        os.chdir(cwd)
    return out


def sole_verdicts(changes: dict[str, str], verdict: Any) -> dict[str, Any]:
    """Mutant name -> its verdict, for each mutant of ``changes`` (all the
    mutants of its function) that a verdict names alone. A verdict is
    matched on the function and the mutated line, so a line mutated the same
    way at two places of one function (``cold = None``) is two mutants under
    one verdict, and only one of them need be the argued equivalent: such a
    verdict never lets a mutant go unrun, and a kill under it is no sign of
    a wrong verdict."""
    count = Counter((n.rsplit("__mutmut_", 1)[0], c) for n, c in changes.items())
    out = {}
    for name, change in changes.items():
        if count[(name.rsplit("__mutmut_", 1)[0], change)] == 1 and (v := verdict(name, change)) is not None:
            out[name] = v
    return out


def stale_verdicts(root: Path, codes: dict[str, Any], verdict: Any,
                   functions: set[str] | None = None) -> list[str]:
    """The mutants of ``codes`` (name -> status) that were detected although
    a verdict names them alone as equivalent: the verdict is wrong (or a
    test now tells the mutant apart) and must go."""
    names = [n for n in codes if functions is None or n.rsplit("__mutmut_", 1)[0] in functions]
    sole = sole_verdicts(_changes(root, names), verdict)
    alive = (0, 33, None)  # mutmut's survived and no tests, and not checked
    return sorted(n for n in sole if codes[n] not in alive)
