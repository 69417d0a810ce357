"""``kvspec verify``: everything that must hold, in one table.

1. every regression trace in ``tests/traces/`` replays clean, and a trace
   named after an injected bug also diverges on that bug;
2. a fixed-seed fuzz campaign per implemented kind/mode and in-place setting
   finds no divergence;
3. every injected bug of the catalog is caught, and its minimal trace
   replays clean on the real implementation (no false alarm);
4. the real-decoding scenarios inside mlx-lm models (``kvspec e2e``), except
   with ``--quick`` (``make test`` runs their short form);
5. the proofs and the CrossHair contracts (``kvspec prove --crosshair``),
   unless skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fuzz import kinds

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "traces"
CAMPAIGN_SEED = 20261129
BUG_SEED = 1


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


def check_traces() -> list[Check]:
    from fuzz.bugs import catalog
    from fuzz.replay import replay
    from fuzz.trace import TraceFormatError, load

    bugs = {b.name: b for b in catalog()}
    out = []
    for path in sorted(TRACES.glob("*.json")):
        start = time.perf_counter()
        try:
            trace = load(path)
            result = replay(trace)
            ok, detail = result.ok, f"{result.ops_run} ops agree" if result.ok else str(result.divergence).splitlines()[0]
            bug = bugs.get(path.stem)
            if ok and bug is not None:
                on_bug = replay(trace, bug.factories)
                ok = not on_bug.ok
                detail += "; diverges on the bug" if ok else "; does NOT diverge on the bug it is named after"
        except TraceFormatError as exc:
            ok, detail = False, f"invalid: {exc}"
        out.append(Check(f"trace {path.name}", ok, detail, time.perf_counter() - start))
    if not out:
        out.append(Check("traces", False, f"no traces in {TRACES}", 0.0))
    return out


def check_campaigns(budget: float, require_reach: bool = True) -> list[Check]:
    """One fixed-seed campaign per registry campaign: no divergence, and
    (``require_reach``; off for ``--quick``, whose budget is too short to
    promise it) every event of the kind's ``must_reach`` reached."""
    from fuzz.campaign import campaign, save_failure

    out = []
    for kind in kinds.KINDS.values():
        for mode, inplace in kind.campaigns:
            rep = campaign(kind.kind, mode, inplace, budget, CAMPAIGN_SEED)
            ops = rep.stats.get("ops", 0)
            missed = [label for label in kind.must_reach if not rep.stats.get(label)]
            if rep.failure is None:
                detail = f"{rep.examples} examples, {ops} ops, {ops / max(rep.seconds, 1e-9):.0f} ops/s"
                if kind.must_reach:
                    detail += "; " + ", ".join(f"{label} {rep.stats.get(label, 0)}" for label in kind.must_reach)
                if missed:
                    detail += f"; NOT REACHED: {', '.join(missed)}"
                out.append(Check(f"fuzz {rep.config}", not (missed and require_reach), detail, rep.seconds))
            else:
                detail = str(rep.failure.error).splitlines()[0]
                if rep.failure.trace is not None:
                    path = save_failure(rep.failure.trace, "fuzz-failures", rep.config.replace("/", "-"))
                    detail += f" (kvspec replay {path})"
                out.append(Check(f"fuzz {rep.config}", False, detail, rep.seconds))
    return out


def check_bugs(out: str, seeds: int) -> list[Check]:
    """The injected-bug catalog (and each entry's variants) from ``seeds``
    fixed seeds: every entry must be caught in every seed, and its minimal
    trace must pass on the real implementation."""
    from fuzz.commands.mutants import run_mutants

    checks = []
    for rep in run_mutants(seeds, out=str(Path(out) / "mutants")):
        j = rep.to_json()
        if rep.caught:
            detail = (f"caught in {seeds}/{seeds} seeds, examples med {j['median_examples']} worst "
                      f"{j['worst_examples']}, trace {rep.trace}")
        else:
            detail = "; ".join(rep.problems)
        checks.append(Check(f"bug {rep.name}", rep.caught, detail, sum(rep.seconds)))
    return checks


def check_e2e() -> list[Check]:
    """The real-decoding scenarios (fuzz/commands/e2e.py) at their default size."""
    from fuzz.commands.e2e import DEFAULT, run_all

    checks = []
    for r in run_all(DEFAULT):
        extra = f", acceptance {r.acceptance:.0%}" if r.acceptance is not None else ""
        detail = f"{r.tokens} tokens, {r.distinct} distinct{extra}" if r.ok else r.detail
        checks.append(Check(f"e2e {r.name}", r.ok, detail, r.seconds))
    return checks


def _crosshair_text(ch: dict) -> str:
    keys = ("confirmed", "not_confirmed", "precondition_unmet", "counterexamples")
    parts = [f"{k.replace('_', ' ')} {len(v) if isinstance(v, list) else v}" for k in keys if (v := ch.get(k)) is not None]
    diff = (ch.get("diffbehavior") or {}).get("status")
    if diff:
        parts.append(f"diffbehavior spec vs impl regrow_capacity: {diff}")
    return ", ".join(parts) or json.dumps(ch)[:200]


def check_proofs() -> list[Check]:
    start = time.perf_counter()
    try:
        import proofs.cli  # noqa: F401
    except ImportError:
        return [Check("proofs", False, "proofs package missing", 0.0)]
    proc = subprocess.run([sys.executable, "-c", "import sys; from proofs.cli import main; sys.exit(main(['--json', '--crosshair']))"],
                          check=False, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return [Check("proofs", False, f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}", seconds)]
    checks = []
    for ob in doc.get("obligations", []):
        # An obligation that waits for a spec that does not exist yet (paged)
        # is reported, not failed; everything else must be proved with its
        # negative control refuted.
        waits = ob.get("status") == "waits"
        ok = waits or (ob.get("status") == "proved" and ob.get("negative_control") == "refuted")
        checks.append(Check(f"proof {ob['name']}", ok, f"{ob.get('status')}, negative control {ob.get('negative_control')}",
                            float(ob.get("seconds", 0.0))))
    ch = doc.get("crosshair")
    if ch is not None:
        checks.append(Check("crosshair spec/ contracts", bool(ch.get("ok")), _crosshair_text(ch), float(ch.get("seconds", 0.0))))
    if proc.returncode != 0:
        checks.append(Check("proofs", False, f"kvspec prove exited {proc.returncode}", seconds))
    return checks


def check_equivalents() -> list[Check]:
    """The Z3 checks behind the equivalent-mutant arguments (docs/mutation.md)."""
    from proofs.equivalents import EQUIVALENCES, check

    checks = []
    for e in EQUIVALENCES:
        start = time.perf_counter()
        r = check(e)
        detail = ("equivalent, control refuted" if r.ok else
                  f"{'equivalent' if r.proved else 'NOT equivalent'}, control {'refuted' if r.control_refuted else 'NOT refuted'}"
                  f" ({r.counterexample})")
        checks.append(Check(f"equivalent mutant {r.name}", r.ok, detail, time.perf_counter() - start))
    return checks


def run_verify(quick: bool = False, as_json: bool = False, out: str = "fuzz-failures", skip_proofs: bool = False) -> int:
    start = time.perf_counter()
    checks = check_traces()
    checks += check_campaigns(4.0 if quick else 25.0, require_reach=not quick)
    checks += check_bugs(out, 1 if quick else 5)
    if not quick:
        checks += check_e2e()
    if not skip_proofs:
        checks += check_proofs()
        checks += check_equivalents()
    total = time.perf_counter() - start
    ok = all(c.ok for c in checks)
    if as_json:
        print(json.dumps({"ok": ok, "seconds": round(total, 1),
                          "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail, "seconds": round(c.seconds, 2)} for c in checks]}))
    else:
        table = Table(title="kvspec verify" + (" (quick)" if quick else ""))
        table.add_column("check")
        table.add_column("result")
        table.add_column("time", justify="right")
        table.add_column("detail", overflow="fold")
        for c in checks:
            table.add_row(escape(c.name), "[green]ok[/]" if c.ok else "[bold red]FAIL[/]", f"{c.seconds:.1f}s", escape(c.detail))
        console = Console(highlight=False, width=160)
        console.print(table)
        failed = [c.name for c in checks if not c.ok]
        console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed in {total:.0f} s")
    return 0 if ok else 1
