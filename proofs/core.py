"""Obligations, negative controls and their results.

An obligation is a list of *parts* (one validity check each, e.g. "the
invariant is preserved by trim"), each run in both domains, plus negative
controls. A negative control is a named buggy rule; it is *refuted* when Z3
finds a counterexample to the obligation with the bug in every domain it
targets and, where the control asks for one, a reachable counterexample (a
kvtrace) that the spec's own code confirms. An obligation is ``proved`` only
if every part is proved in both domains and every negative control is
refuted; a control that is not refuted makes the obligation ``failed`` (a
proof that cannot fail proves nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvspec.proofs.domain import BV32, DOMAINS, INT, Check, Domain, check_valid

# A part builds (premises, goal) in a fresh domain.
PartBuilder = Callable[[Domain], tuple[list[Any], Any]]


@dataclass
class PartResult:
    part: str
    domain: str
    status: str
    seconds: float
    reason: str = ""
    counterexample: dict[str, Any] | None = None
    #: Z3 resource units (``rlimit``) the part's checks used and were given
    #: (``kvspec.proofs.domain.check_valid``): the verdict's budget, not seconds
    units: int = 0
    units_given: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"part": self.part, "domain": self.domain, "status": self.status,
                               "seconds": round(self.seconds, 3), "units": self.units,
                               "units_given": self.units_given}
        if self.reason:
            out["reason"] = self.reason
        if self.counterexample:
            out["counterexample"] = self.counterexample
        return out


@dataclass
class ControlResult:
    """One negative control: the buggy rule, whether Z3 refuted it, where."""

    name: str
    rule: str
    status: str  # "refuted" or "not refuted" or "unknown"
    domains: dict[str, str] = field(default_factory=dict)
    refuting_part: str = ""
    counterexample: dict[str, Any] | None = None
    trace: dict[str, Any] | None = None
    confirmed: str = ""
    seconds: float = 0.0
    #: the parts it ran (their units, and an ``unknown``'s reason)
    parts: list[PartResult] = field(default_factory=list)

    @property
    def units(self) -> int:
        """The most Z3 resource units one of its checks used."""
        return max((p.units for p in self.parts), default=0)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "rule": self.rule, "status": self.status,
                               "domains": self.domains, "seconds": round(self.seconds, 3), "units": self.units}
        unknown = [f"{p.part} ({p.domain}): {p.reason}" for p in self.parts if p.status == "unknown"]
        if unknown:
            out["unknown"] = unknown
        if self.refuting_part:
            out["refuting_part"] = self.refuting_part
        if self.counterexample:
            out["counterexample"] = self.counterexample
        if self.trace is not None:
            out["kvtrace"] = self.trace
        if self.confirmed:
            out["confirmed"] = self.confirmed
        return out


@dataclass
class ObligationResult:
    number: int
    name: str
    proves: tuple[str, ...]
    statement: str
    status: str
    parts: list[PartResult]
    controls: list[ControlResult]
    seconds: float
    waits_for: str = ""

    @property
    def negative_control(self) -> str:
        if not self.controls:
            return "none" if not self.waits_for else "-"
        if all(c.status == "refuted" for c in self.controls):
            return "refuted"
        if any(c.status == "unknown" for c in self.controls):
            return "unknown"
        return "not refuted"

    @property
    def units(self) -> int:
        """The most Z3 resource units one check of the obligation (a part
        in one domain, or a negative control's) used."""
        return max([p.units for p in self.parts] + [c.units for c in self.controls], default=0)

    @property
    def units_given(self) -> int:
        """The units one check of its parts may use (its rlimit, over the
        seeds of ``kvspec.proofs.domain.SEEDS``; the largest where parts differ)."""
        return max((p.units_given for p in self.parts), default=0)

    def rerun(self) -> str:
        """The command that runs this obligation alone."""
        return f"kvspec prove --only {self.number}"

    def unknowns(self) -> list[str]:
        """Every check that came out ``unknown``, with Z3's reason."""
        out = [f"{p.part} ({p.domain}): {p.reason}" for p in self.parts if p.status == "unknown"]
        for c in self.controls:
            out += [f"negative control {c.name}: {p.part} ({p.domain}): {p.reason}"
                    for p in c.parts if p.status == "unknown"]
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "number": self.number, "name": self.name, "proves": list(self.proves),
            "statement": self.statement, "status": self.status,
            "negative_control": self.negative_control, "seconds": round(self.seconds, 3),
            "units": self.units, "units_given": self.units_given,
            "parts": [p.to_json() for p in self.parts],
            "negative_controls": [c.to_json() for c in self.controls],
        }
        if self.waits_for:
            out["waits_for"] = self.waits_for
        if self.status != "proved" and not self.waits_for:
            out["rerun"] = self.rerun()
        return out


def run_parts(
    parts: list[tuple[str, PartBuilder]],
    domains: tuple[str, ...] = DOMAINS,
    stop_at_refutation: bool = False,
    timeout_ms: int = 30_000,
    contracts: bool = False,
) -> list[PartResult]:
    """Check every part in every domain (stop at the first refutation of a
    domain when ``stop_at_refutation``: negative controls need only one).
    ``contracts``: in bv32, use the contracts of nonlinear spec formulas
    (proved by their own obligation) instead of their definitions."""
    results: list[PartResult] = []
    int_status: dict[str, str] = {}
    int_models: dict[str, Any] = {}
    for kind in domains:
        ordered = parts
        if stop_at_refutation and kind != INT:
            # a negative control needs one refutation: try first the parts
            # the int run refuted
            ordered = sorted(parts, key=lambda p: int_status.get(p[0]) != "refuted")
        for label, build in ordered:
            dom = Domain(kind, contracts=contracts and kind != INT)
            premises, goal = build(dom)
            if kind == INT:
                chk = check_valid(dom, premises, goal, timeout_ms)
                int_status[label] = chk.status
                int_models[label] = chk.model
            else:
                chk = _check_bv(dom, premises, goal, timeout_ms, int_status.get(label), int_models.get(label))
            cex = _cex(chk) if chk.status == "refuted" else None
            results.append(PartResult(label, kind, chk.status, chk.seconds, chk.reason, cex, chk.units,
                                      chk.units_given))
            if stop_at_refutation and chk.status == "refuted":
                break
    return results


BV_DIRECT_MS = 2_000


def _check_bv(dom: Domain, premises: list[Any], goal: Any, timeout_ms: int, int_status: str | None,
              int_model: Any = None) -> Check:
    """bv32, cheapest sound check first:

    * the int run proved the part: the no-overflow obligations alone. When
      no intermediate value overflows, every wrapped result equals its
      exact value, so the property is the one the int run proved (reported
      with that reason). Checking the property together with them (which,
      given the int proof, asks nothing more) was the slowest half of a
      proof: on the ring's and the paged pool's modular rules Z3 ran out of
      its budget on it and then checked the obligations alone anyway;
    * the int run refuted it: its counterexample's values in 32 bits, a
      concrete bv32 counterexample when they fit;
    * otherwise, or when those do not decide it: the property and the
      no-overflow obligations together, in wrapping arithmetic (a short
      budget), then the obligations alone."""
    import z3

    spent, units, given = 0.0, 0, 0

    def total(chk: Check) -> Check:
        chk.seconds += spent
        chk.units += units
        chk.units_given += given
        return chk

    if int_status == "proved":
        alone = check_valid(dom, premises, z3.BoolVal(True), timeout_ms)
        if alone.status == "proved":
            alone.reason = "no intermediate overflow, so the int proof carries over"
            return alone
        if alone.status == "refuted":
            return alone
        spent, units, given = alone.seconds, alone.units, alone.units_given
    if int_status == "refuted" and int_model is not None:
        lo, hi = -(2 ** 31), 2 ** 31
        fixed = []
        for decl in int_model.decls():
            v = int_model[decl]
            if decl.arity() == 0 and z3.is_int_value(v) and lo <= v.as_long() < hi:
                fixed.append(z3.Int(decl.name()) == v.as_long())
            elif decl.arity() == 0 and (z3.is_true(v) or z3.is_false(v)):
                fixed.append(z3.Bool(decl.name()) == v)
        replayed = check_valid(dom, [*premises, *fixed], goal, timeout_ms)
        if replayed.status == "refuted":
            replayed.reason = replayed.reason or "the int counterexample fits in 32 bits"
            return total(replayed)
        spent, units, given = spent + replayed.seconds, units + replayed.units, given + replayed.units_given

    direct = check_valid(dom, premises, goal, min(timeout_ms, BV_DIRECT_MS))
    if direct.status != "unknown" or int_status == "proved":
        return total(direct)
    spent, units, given = spent + direct.seconds, units + direct.units, given + direct.units_given
    obligations = check_valid(dom, premises, z3.BoolVal(True), timeout_ms)
    if obligations.status == "proved":
        return total(Check("unknown", reason=f"no overflow, but the int run did not prove the property "
                                             f"({direct.reason})", seconds=obligations.seconds,
                           units=obligations.units, units_given=obligations.units_given))
    return total(obligations)


def _cex(chk: Check) -> dict[str, Any]:
    """The scalar values of a counterexample model, by variable name."""
    import z3

    out: dict[str, Any] = {}
    for decl in chk.model.decls():
        if "!" in decl.name():  # wrapped intermediates and fresh helpers
            continue
        v = chk.model[decl]
        if z3.is_int_value(v):
            out[decl.name()] = v.as_long()
        elif z3.is_true(v) or z3.is_false(v):
            out[decl.name()] = z3.is_true(v)
    return dict(sorted(out.items()))


def overall(parts: list[PartResult], controls: list[ControlResult]) -> str:
    """proved / refuted / unknown / failed for an obligation."""
    if any(p.status == "refuted" for p in parts):
        return "refuted"
    if any(p.status == "unknown" for p in parts):
        return "unknown"
    if any(c.status != "refuted" for c in controls):
        return "failed"
    return "proved"


def control_from_parts(
    name: str,
    rule: str,
    parts: list[tuple[str, PartBuilder]],
    targets: tuple[str, ...] = DOMAINS,
    reachable: Callable[[], tuple[dict[str, Any] | None, dict[str, Any] | None, str]] | None = None,
    contracts: bool = False,
) -> ControlResult:
    """Run the obligation's parts with the buggy rule in each target domain;
    then, if given, ``reachable()`` -> (kvtrace or None, values,
    confirmation): a concrete counterexample, replayed on the spec's own code
    with the bug (a kvtrace from an empty cache where an op can show the
    bug). Refuted only if every target domain refutes and the concrete
    counterexample (when asked for) is confirmed (its confirmation string
    starts with "confirmed")."""
    t0 = time.perf_counter()
    res = run_parts(parts, targets, stop_at_refutation=True, contracts=contracts)
    domains: dict[str, str] = {}
    refuting = ""
    cex = None
    for kind in targets:
        mine = [r for r in res if r.domain == kind]
        hit = next((r for r in mine if r.status == "refuted"), None)
        if hit is not None:
            domains[kind] = "refuted"
            if not refuting:
                refuting = f"{hit.part} ({kind})" + (f": {hit.reason}" if hit.reason else "")
                cex = hit.counterexample
        elif any(r.status == "unknown" for r in mine):
            domains[kind] = "unknown"
        else:
            domains[kind] = "not refuted"
    status = "refuted" if all(v == "refuted" for v in domains.values()) else (
        "unknown" if any(v == "unknown" for v in domains.values()) else "not refuted")
    trace, confirmed = None, ""
    if reachable is not None:
        trace, values, confirmed = reachable()
        if values:
            cex = values
        if not confirmed.startswith("confirmed"):
            status = "not refuted" if status == "refuted" else status
    return ControlResult(name, rule, status, domains, refuting, cex, trace, confirmed, time.perf_counter() - t0, res)


__all__ = [
    "BV32", "INT", "ControlResult", "ObligationResult", "PartResult", "control_from_parts",
    "overall", "run_parts",
]
