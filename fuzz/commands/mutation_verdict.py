"""A survivor's triage verdict (docs/mutation.md, "Survivor triage")."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """Why a surviving mutant is left alive.

    ``function``: the mutated function (mutmut's name without ``__mutmut_N``);
    ``change``: the mutated line (``+`` side of ``mutmut show``, stripped),
    matched exactly; ``z3``: the
    :data:`proofs.equivalents.EQUIVALENCES` check that proves it, if any;
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
