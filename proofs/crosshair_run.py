"""Run CrossHair on the spec's PEP 316 contracts, and one ``diffbehavior``.

``crosshair check --analysis_kind=PEP316 --per_condition_timeout=N`` is run
on every ``spec/*.py`` that has ``pre:``/``post:`` lines (one process per
file, in parallel), with ``--report_all`` so that every condition is counted:
*confirmed* (over all paths), *not confirmed* (no counterexample within the
time limit), *precondition unmet* (CrossHair found no input satisfying the
``pre:`` lines in time) or a *counterexample* (an ``error:`` line: a
contract is false).

``crosshair diffbehavior kvspec.spec.dense.regrow_capacity
kvspec.impl.dense.regrow_capacity`` compares the spec's regrow rule with the
implementation's pure helper (kvspec.impl.dense imports MLX at module level, which
is cheap; CrossHair only executes the two integer functions, never MLX code).
Its negative control diffs the spec against
``kvspec.proofs.crosshair_run.regrow_capacity_multiple_of_step`` (capacity rounded
up to a multiple of step, a common misreading): CrossHair must find a
difference, or the diff proves nothing.

Every condition must be confirmed. Where a bound makes that possible the
bound is a ``pre:`` line of the contract, argued in the function's
docstring (why it loses nothing). A function whose contract CrossHair
cannot exhaust even bounded (a symbolic cache: tuples of entries, buffer,
marker, mode; string methods) is in :data:`EXPLAINED` with the reason and
the check that covers it instead (``tests/test_contracts_sampled.py``
evaluates its very ``pre:``/``post:`` lines on reachable inputs); CrossHair
is not run on it, and each of its conditions is reported as *explained*: a
warning with its reason, never "ok". A condition that is not confirmed and
not explained, or a precondition CrossHair cannot meet, fails the run; such
a function is first run once more alone with three times the per-condition
limit (on a loaded machine a confirmation can miss the limit).

Usage: ``python -m kvspec.proofs.crosshair_run [--json] [--timeout N]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: How CrossHair's CLI is run: through this interpreter (``python -m
#: crosshair``), never a PATH lookup: where the package travels as a wheel on
#: PYTHONPATH (the GPU machine) no ``crosshair`` script is installed.
CROSSHAIR = [sys.executable, "-m", "crosshair"]
LINE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<level>\w+): (?P<msg>.*)$")
DIFF_TARGET = ("kvspec.spec.dense.regrow_capacity", "kvspec.impl.dense.regrow_capacity")
DIFF_CONTROL = ("kvspec.spec.dense.regrow_capacity", "kvspec.proofs.crosshair_run.regrow_capacity_multiple_of_step")


def regrow_capacity_multiple_of_step(prev: int, n: int, step: int) -> int:
    """Negative control for diffbehavior: round ``prev + n`` up to a multiple
    of step (wrong after a logical trim: semantics.md 2 says the capacity is
    ``prev + ceil(n/step)*step``, not necessarily a multiple of step)."""
    return -(-(prev + n) // step) * step


_SAMPLED = ("CrossHair does not exhaust the paths of a symbolic DenseCache (entries tuple, buffer, marker, "
            "mode) within the limit (append and trim bounded to at most 3 entries were tried: still not confirmed); "
            "its pre:/post: lines are evaluated on reachable caches by tests/test_contracts_sampled.py")

#: ``(file, function)`` -> why CrossHair cannot confirm its contract and what
#: checks it instead (see the module docstring).
EXPLAINED: dict[tuple[str, str], str] = {
    ("spec/dense.py", "append"): _SAMPLED,
    ("spec/dense.py", "trim"): _SAMPLED,
    ("spec/dense.py", "trim_to"): _SAMPLED,
    ("spec/dense.py", "trim_front_keep_sink"): _SAMPLED,
    ("spec/dense.py", "gather_within_tail"): _SAMPLED,
    ("spec/dense.py", "gather_positions"): (
        "unbounded, CrossHair finds no input meeting its pre: lines (precondition unmet); with at most 3 positions of "
        "4 rows it meets them but does not confirm the post: lines within the limit (tried); its pre:/post: lines "
        "are evaluated on reachable caches by tests/test_contracts_sampled.py"),
    ("spec/dense.py", "inplace_switch"): (
        "CrossHair does not exhaust str.strip().lower() on a symbolic string within the limit, even of at most 5 "
        "characters (tried); tests/test_contracts_sampled.py evaluates the post: lines on drawn strings and on "
        "every switch word with blanks and mixed case"),
}


@dataclass
class Condition:
    file: str
    line: int
    function: str
    condition: str
    status: str  # confirmed | not confirmed | precondition unmet | counterexample | explained | other
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function, "condition": self.condition,
                "status": self.status, **({"message": self.message} if self.status != "confirmed" else {})}


@dataclass
class CrosshairResult:
    conditions: list[Condition] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    diff: dict[str, Any] = field(default_factory=dict)
    diff_control: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: ``file:function`` run a second time with three times the limit
    retried: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.conditions)

    @property
    def counterexamples(self) -> list[Condition]:
        return [c for c in self.conditions if c.status == "counterexample"]

    #: the spec files whose contracts this result covers (``None``: every
    #: :func:`contract_files` file)
    files: list[str] | None = None
    #: whether this result includes the diffbehavior check and its control
    #: (a run of some files only, as ``kvspec verify`` splits it, may not)
    with_diff: bool = True

    @property
    def ok(self) -> bool:
        diff_ok = not self.with_diff or (self.diff.get("status") == "same"
                                         and self.diff_control.get("status") == "differ")
        return (not self.counterexamples and not self.errors and diff_ok and not self.count("not confirmed")
                and not self.count("precondition unmet") and not self.count("other"))

    @property
    def warnings(self) -> list[str]:
        """One line per explained condition: where, what, and why."""
        return [f"{c.file}:{c.line} {c.function}: {c.condition}: not confirmed by CrossHair: {c.message}"
                for c in self.conditions if c.status == "explained"]

    def summary(self) -> str:
        text = (f"{self.count('confirmed')} confirmed, {self.count('not confirmed')} not confirmed, "
                f"{self.count('explained')} explained (warnings), "
                f"{self.count('precondition unmet')} precondition unmet, {len(self.counterexamples)} counterexamples")
        if self.with_diff:
            text += (f"; diffbehavior spec vs impl regrow_capacity: {self.diff.get('status', '?')}, "
                     f"control: {self.diff_control.get('status', '?')}")
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "confirmed": self.count("confirmed"), "not_confirmed": self.count("not confirmed"),
            "precondition_unmet": self.count("precondition unmet"), "explained": self.count("explained"),
            "warnings": self.warnings,
            "counterexamples": [c.to_json() for c in self.counterexamples],
            "conditions": [c.to_json() for c in self.conditions], "errors": self.errors,
            "diffbehavior": self.diff, "diffbehavior_control": self.diff_control,
            "retried": self.retried, "ok": self.ok, "seconds": round(self.seconds, 3),
            **({"files": self.files} if self.files is not None else {}),
        }


def contract_files(spec_dir: Path = ROOT / "spec") -> list[Path]:
    return sorted(p for p in spec_dir.glob("*.py") if re.search(r"^\s*(pre|post):", p.read_text(), re.MULTILINE))


def _locate(path: Path, line: int) -> tuple[str, str]:
    """(function, condition text) for a reported line."""
    text = path.read_text().splitlines()
    cond = text[line - 1].strip() if 0 < line <= len(text) else ""
    if not cond.startswith(("pre:", "post:")):
        cond = "(runs without an exception under its pre: lines)"
    func = "?"
    for node in ast.walk(ast.parse("\n".join(text))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0):
            func = node.name
    return func, cond


def _classify(msg: str) -> str:
    if msg.startswith("Confirmed"):
        return "confirmed"
    if msg.startswith("Not confirmed"):
        return "not confirmed"
    if "precondition" in msg.lower():
        return "precondition unmet"
    return "other"


#: Z3 resource units CrossHair may spend on one solver query
#: (``CROSSHAIR_SMT_RLIMIT``): with ``--per_path_timeout=inf`` (below) this,
#: not a wall-clock timeout, bounds every query. CrossHair's own limits are
#: process CPU seconds (``--per_condition_timeout``, ``time.process_time``),
#: which load does not shrink; but it derives a Z3 query timeout from the
#: per-path limit (half of it, *wall-clock*: crosshair.statespace), which a
#: loaded machine turns into "not confirmed". An infinite per-path limit sets
#: no Z3 timeout; the per-condition CPU limit still bounds the condition.
SMT_RLIMIT = 5_000_000
#: the options that make CrossHair's limits CPU seconds and Z3 units only
CLOCK_FREE = ["--per_path_timeout=inf"]


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run a ``crosshair`` command; ``timeout`` (wall-clock seconds) is a
    hang guard far above any honest run: when it fires the result is exit
    124, reported as CrossHair's failure ("error"), never as a verdict."""
    try:
        # the checkout first, then whatever PYTHONPATH already holds: where
        # CrossHair and Z3 travel as wheels on PYTHONPATH (the GPU machine),
        # replacing it would hide them from ``python -m crosshair``
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               "CROSSHAIR_SMT_RLIMIT": str(SMT_RLIMIT)}
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s: {' '.join(cmd)}"
    return p.returncode, p.stdout + p.stderr


def contract_functions(path: Path) -> list[tuple[str, int, list[tuple[int, str]]]]:
    """``(name, def line, [(line, condition)])`` of every top-level function
    of ``path`` whose docstring has ``pre:``/``post:`` lines."""
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node, clean=False)):
            first = node.body[0].lineno  # the docstring's first line
            conds = [(first + i, ln.strip()) for i, ln in enumerate(doc.splitlines())
                     if ln.strip().startswith(("pre:", "post:"))]
            if conds:
                out.append((node.name, node.lineno, conds))
    return out


def check_file(path: Path, per_condition_timeout: float) -> tuple[list[Condition], list[str]]:
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    conds, errors = [], []
    targets, skipped = [], False
    for name, line, lines in contract_functions(path):
        reason = EXPLAINED.get((rel, name))
        if reason is None:
            # FILE:LINE of its def, not kvspec.spec.x.name: CrossHair reads its options from every parent
            # package of a dotted name, and kvspec is a namespace package it cannot read
            targets.append(f"{path}:{line}")
            continue
        skipped = True
        conds += [Condition(rel, ln, name, text, "explained", reason) for ln, text in lines if text.startswith("post:")]
    if not targets:
        return conds, errors
    if not skipped:
        targets = [str(path)]  # the whole file (also one outside the repository)
    more, errs = check_targets(targets, per_condition_timeout)
    return conds + more, errors + errs


def check_targets(targets: list[str], per_condition_timeout: float) -> tuple[list[Condition], list[str]]:
    """``crosshair check`` on ``targets`` (files or ``module.function``)."""
    rc, out = _run([*CROSSHAIR, "check", "--analysis_kind=PEP316", f"--per_condition_timeout={per_condition_timeout}",
                    *CLOCK_FREE, "--report_all", *targets], timeout=600)
    conds: list[Condition] = []
    errors: list[str] = []
    for raw in out.splitlines():
        m = LINE.match(raw)
        if not m:
            continue
        line = int(m["line"])
        file = Path(m["file"])
        func, cond = _locate(file if file.is_absolute() else ROOT / file, line)
        rel = str(file.relative_to(ROOT)) if file.is_absolute() and file.is_relative_to(ROOT) else str(file)
        if m["level"] == "error":
            conds.append(Condition(rel, line, func, cond, "counterexample", m["msg"]))
        else:
            conds.append(Condition(rel, line, func, cond, _classify(m["msg"]), m["msg"]))
    if rc not in (0, 1):
        errors.append(f"crosshair check {' '.join(targets)} exited {rc}: {out.strip()[-500:]}")
    elif not conds or "Traceback (most recent call last)" in out:
        # --report_all reports every condition it checked: none at all (or CrossHair's own traceback)
        # is CrossHair failing, never a file whose conditions all passed
        errors.append(f"crosshair check {' '.join(targets)} gave no verdict (exit {rc}): {out.strip()[-500:]}")
    return conds, errors


def diffbehavior(a: str, b: str, per_condition_timeout: float) -> dict[str, Any]:
    rc, out = _run([*CROSSHAIR, "diffbehavior", a, b, f"--per_condition_timeout={per_condition_timeout}", *CLOCK_FREE],
                   timeout=300)
    status = "same" if rc == 0 else "differ" if rc == 1 else "error"
    return {"a": a, "b": b, "status": status, "exit": rc, "output": out.strip()[-1500:]}


def run(per_condition_timeout: float = 10.0, diff_timeout: float = 10.0, files: list[str] | None = None,
        diff: bool = True, workers: int = 2) -> CrosshairResult:
    """CrossHair on the contracts of ``files`` (paths relative to the
    repository, e.g. ``spec/dense.py``; ``None``: every
    :func:`contract_files` file) and, with ``diff``, the diffbehavior check
    and its control, on ``workers`` threads (each drives one ``crosshair``
    process; ``kvspec verify`` runs one file per job with ``workers=1``, so
    its scheduler sees one busy core per job)."""
    t0 = time.perf_counter()
    res = CrosshairResult(files=None if files is None else list(files), with_diff=diff)
    paths = contract_files() if files is None else [ROOT / f for f in files]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(check_file, f, per_condition_timeout) for f in paths]
        if diff:
            dfut = pool.submit(diffbehavior, *DIFF_TARGET, diff_timeout)
            cfut = pool.submit(diffbehavior, *DIFF_CONTROL, diff_timeout)
        for fut in futures:
            conds, errors = fut.result()
            res.conditions += conds
            res.errors += errors
        if diff:
            res.diff, res.diff_control = dfut.result(), cfut.result()
    # A condition CrossHair did not settle may be one it confirms given more
    # time (the limit is per condition; a loaded machine gets less done in
    # it): its function is run once more alone with three times the limit.
    again = sorted({(c.file, c.function) for c in res.conditions if c.status in ("not confirmed", "precondition unmet")})
    for file, function in again:
        path = ROOT / file
        lines = [line for name, line, _ in contract_functions(path) if name == function] if path.exists() else []
        if not lines:
            continue
        conds, errors = check_targets([f"{path}:{lines[0]}"], 3 * per_condition_timeout)
        if not errors and conds:
            res.conditions = [c for c in res.conditions if (c.file, c.function) != (file, function)] + conds
            res.retried.append(f"{file}:{function}")
    res.conditions.sort(key=lambda c: (c.file, c.line))
    res.seconds = time.perf_counter() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvspec.proofs.crosshair_run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-condition timeout (CPU seconds)")
    args = parser.parse_args(argv)
    res = run(args.timeout)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        for c in res.conditions:
            print(f"{c.file}:{c.line} {c.function}: {c.status}: {c.condition}")
        for e in res.errors:
            print("error:", e)
        print("diffbehavior", res.diff["a"], res.diff["b"], "->", res.diff["status"])
        print("diffbehavior control", res.diff_control["a"], res.diff_control["b"], "->", res.diff_control["status"])
        for w in res.warnings:
            print("warning:", w)
        print(res.summary(), f"({res.seconds:.1f}s)")
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
