"""``kvspec verify``: everything that must hold, in one table.

1. every regression trace in ``tests/traces/`` replays clean, and a trace
   named after an injected bug also diverges on that bug; each of the
   harness's cheaper checks catches the catalog bug paired with it, and only
   it does (``kvspec.fuzz.harness_mutants``);
2. a fixed-seed fuzz campaign per implemented kind/mode and in-place setting
   finds no divergence;
3. every injected bug of the catalog is caught in each of 5 seeds, and each
   failing run replays clean on the real implementation (when it does not,
   the implementation diverges from the spec at the op named). Verify does
   not shrink: it asks whether and how soon each seed catches the bug
   (``kvspec mutants --only NAME`` gives the minimal trace; ``make test``
   replays each bug's shipped minimal trace, tests/test_replay.py);
4. the real-decoding scenarios inside mlx-lm models (``kvspec e2e``) at
   the verify size: 32-token streams on models 2 and 3 (``make test`` runs
   the same scenarios on models 0 and 1; ``kvspec e2e`` 64-token streams on
   models 0 to 2), except with ``--quick``;
5. the proofs and the CrossHair contracts (``kvspec prove --crosshair``),
   unless skipped; ``--quick`` runs every Z3 obligation and leaves
   CrossHair out.

``--quick`` gives every kind, every injected bug and every obligation a
first verdict: each campaign runs :data:`QUICK_EXAMPLES` examples (a bound
in examples, not seconds, so the verdict does not depend on the clock), each
bug one seed. The jobs run on warm worker processes
(:class:`kvspec.fuzz.workers.WarmPool`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvspec.fuzz import interrupt, kinds

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "traces"
CAMPAIGN_SEED = 20261129
#: seconds per fixed-seed campaign (about 7k ops each; long campaigns are
#: ``make fuzz`` / ``kvspec fuzz --budget``). Enough for every kind's
#: ``must_reach`` events, which a campaign that misses them fails on.
CAMPAIGN_BUDGET = 8.0
#: a campaign that has not reached every ``must_reach`` event within its
#: budget goes on up to this many budgets (search seconds) before it fails
#: with NOT REACHED: the H200 runs a tenth of the CPU's examples a second
REACH_FACTOR = 4
BUG_SEED = 1
#: examples a seed may run to catch a catalog bug in verify (``kvspec
#: mutants`` allows 2000): every bug is caught within 40 on seeds 1-5 on
#: the CPU (docs/fuzzing.md), so a device ten times slower still catches it
#: and a miss ends as "missed after N examples", not as a killed job
BUG_EXAMPLES = 400
#: examples of each fixed-seed campaign in ``--quick`` (one batch): a
#: bound in examples, so quick's verdict does not depend on the clock
QUICK_EXAMPLES = 25
#: a quick campaign's expected seconds per kind (the queue's order)
QUICK_CAMPAIGN_SECONDS = {"prefix": 8.0, "cells": 5.0, "layers": 4.0, "models": 4.0, "dense": 2.5}
#: expected seconds per seed and variant of a bug job on a warm worker (the
#: queue's order: most bugs are caught within a tenth of a second, a
#: prefix bug within 2 s; kvspec mutants --json gives each one's)
BUG_SEED_WEIGHT = 0.3
#: wall-clock seconds per seed and variant of a bug job (its limit is this
#: times seeds times variants: it follows the job's own size, not a floor)
BUG_SEED_SECONDS = 60.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float
    #: a kvtrace that reproduces what the check found (printed below the
    #: table, whole: a path is never wrapped inside a cell)
    trace: str | None = None
    #: passed, but with exceptions a reader must see, each with its reason
    #: (a CrossHair condition not confirmed and explained): shown as "warn",
    #: never "ok"
    warnings: tuple[str, ...] = ()
    #: failed without a verdict: the tool could not repeat its own answer
    #: (kvspec.fuzz.machine.FlakyVerdict); shown as TOOL FAILURE, exit 2
    tool_failure: bool = False


def check_traces() -> list[Check]:
    from kvspec.fuzz.bugs import catalog
    from kvspec.fuzz.campaign import clean_replay_failure
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import TraceFormatError, load

    bugs = {b.name: b for b in catalog()}
    out = []
    for path in sorted(TRACES.glob("*.json")):
        start = time.perf_counter()
        try:
            trace = load(path)
            result = replay(trace)
            ok = result.ok
            detail = f"{result.ops_run} ops agree" if ok else clean_replay_failure(path, result.divergence)
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


def check_harness_mutants() -> list[Check]:
    """The harness's cheaper checks, each checked by the catalog bug only it
    catches (kvspec.fuzz.harness_mutants): the bug's trace diverges on that check
    and, with the check switched off, passes; and the Int8 expected rows
    stay the same with kvspec.impl.quant's functions wrong and change with
    kvspec.fuzz.quant_ref's wrong."""
    from kvspec.fuzz.harness_mutants import CHECKS, check_int8_oracle, check_pairing

    out = []
    for check in CHECKS:
        start = time.perf_counter()
        problems = check_pairing(check)
        only = f", and missed with {check.switch[1]} off" if check.switch else ""
        detail = "; ".join(problems) or f"{check.bug}'s trace diverges on this check ({check.where}){only}"
        out.append(Check(f"harness check: {check.name}", not problems, detail, time.perf_counter() - start))
    start = time.perf_counter()
    problems = check_int8_oracle()
    detail = "; ".join(problems) or ("unchanged with kvspec.impl.quant's quantizer and dequantizer wrong, changed with "
                                     "kvspec.fuzz.quant_ref's wrong (float16, bfloat16, float32)")
    out.append(Check("harness check: Int8 oracle independent of kvspec.impl.quant", not problems, detail,
                     time.perf_counter() - start))
    return out


def _examples_campaign(kind: str, mode: str, inplace: bool, examples: int) -> Any:
    """A fixed-seed campaign bounded by examples, not seconds: seeded
    batches until ``examples`` have run or one fails (at least one batch;
    at most ``examples`` batches, so a batch that runs none cannot loop).
    Its verdict does not depend on the clock or the load."""
    from kvspec.fuzz.campaign import Campaign

    run = Campaign(kind, mode, inplace, CAMPAIGN_SEED)
    while run.report.batches == 0 or (not run.failed and run.report.examples < examples
                                      and run.report.batches < examples):
        run.batch()
    return run.report


def check_campaigns(budget: float, only: tuple[str, str, bool] | None = None, require_reach: bool = True,
                    examples: int | None = None) -> list[Check]:
    """One fixed-seed campaign per registry campaign (``only``: just that
    ``(kind, mode, inplace)``): no divergence, and (``require_reach``; off
    for ``--quick``, whose campaigns are too short to promise it) every
    event of the kind's ``must_reach`` reached. ``examples``: each campaign
    runs that many examples instead of ``budget`` seconds (``--quick``: a
    verdict that does not depend on the clock)."""
    from kvspec.fuzz.campaign import campaign, save_failure

    out = []
    for kind in kinds.KINDS.values():
        for mode, inplace in kind.campaigns:
            if only is not None and only != (kind.kind, mode, inplace):
                continue
            if examples is not None:
                rep = _examples_campaign(kind.kind, mode, inplace, examples)
            else:
                # a campaign that has not reached its edges within ``budget``
                # goes on up to REACH_FACTOR times it (a slower device)
                # ``fit``: its last batch cut to the seconds left, so the search stops at the budget
                rep = campaign(kind.kind, mode, inplace, budget, CAMPAIGN_SEED,
                               reach=kind.must_reach if require_reach else (), reach_budget=budget * REACH_FACTOR,
                               fit=True)
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
                path = None
                if rep.failure.trace is None:
                    detail += "; no kvtrace was recorded (the failure came outside a rule)"
                else:
                    path = str(save_failure(rep.failure.trace, "fuzz-failures", rep.config.replace("/", "-")))
                    detail += f"; kvtrace {path}: {_replay_verdict(path)}"
                out.append(Check(f"fuzz {rep.config}", False, detail, rep.seconds, path))
    return out


def _replay_verdict(path: str) -> str:
    """Whether the saved kvtrace of a failed campaign fails again on replay
    (a deterministic divergence) or replays clean (a failure that depends
    on timing: on a GPU, an ordering or aliasing race)."""
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import load

    try:
        result = replay(load(path))
    except Exception as exc:  # noqa: BLE001 - reported in the check's detail
        return f"replay raised {type(exc).__name__}: {exc}"
    if result.ok:
        return (f"replays clean ({result.ops_run} ops): the failure did not recur, so it depends on timing "
                "(on a GPU: an ordering or aliasing race)")
    return f"fails again on replay at op {result.divergence.index if result.divergence else '?'}"


def check_bugs(out: str, seeds: int, names: list[str] | None = None) -> list[Check]:
    """The injected-bug catalog (and each entry's variants; ``names``: only
    these entries) from ``seeds`` fixed seeds: every entry must be caught in
    every seed, and every failing run (unshrunk: item 3 of this module's
    doc) must pass on the real implementation."""
    from kvspec.fuzz.commands.mutants import run_mutants

    checks = []
    for rep in run_mutants(seeds, max_examples=BUG_EXAMPLES, out=str(Path(out) / "mutants"), names=names,
                           shrink_first=False):
        j = rep.to_json()
        if rep.caught:
            detail = f"caught in {seeds}/{seeds} seeds, examples med {j['median_examples']} worst {j['worst_examples']}"
        else:
            detail = "; ".join(rep.tool_failures + rep.problems)
        checks.append(Check(f"bug {rep.name}", rep.caught, detail, sum(rep.seconds), rep.trace,
                            tool_failure=bool(rep.tool_failures)))
    return checks


def check_batch(ring: bool, examples: int) -> list[Check]:
    """The batch lockstep (``kvspec.fuzz.batch``): ``examples`` programs of a batch
    cache against B single caches and the spec's layout."""
    from kvspec.fuzz.batch import campaign

    r = campaign(ring, max_examples=examples)
    detail = f"{r.examples} programs, batch = B single caches" if r.ok else r.failure.splitlines()[0]
    return [Check(f"batch lockstep/{'rotating' if ring else 'dense'}", r.ok, detail, r.seconds,
                  tool_failure=r.status == "tool failure")]


def check_batch_recurrent(examples: int) -> list[Check]:
    """The recurrent batch lockstep (``kvspec.fuzz.batch.recurrent_campaign``):
    ``examples`` programs of a batch RecurrentCache against B single ones."""
    from kvspec.fuzz.batch import recurrent_campaign

    r = recurrent_campaign(max_examples=examples)
    detail = f"{r.examples} programs, batch = B single caches" if r.ok else r.failure.splitlines()[0]
    return [Check("batch lockstep/recurrent", r.ok, detail, r.seconds, tool_failure=r.status == "tool failure")]


def check_batch_bugs(examples: int) -> list[Check]:
    """Every injected batch bug (``fuzz/bugs/batch.py``: the dense and ring
    batches' ``BUGS``, the recurrent kind's ``RECURRENT_BUGS``) caught by the
    batch lockstep."""
    from kvspec.fuzz.batch import catch
    from kvspec.fuzz.bugs import batch_bugs
    from kvspec.fuzz.bugs.batch import RECURRENT_BUGS

    out = []
    for bug in batch_bugs() + list(RECURRENT_BUGS):
        r = catch(bug, max_examples=examples, shrink=False)
        detail = (f"caught after {r.examples} programs: {r.failure.splitlines()[0]}" if r.caught
                  else f"not caught in {r.examples} programs" + (f": {r.failure.splitlines()[0]}" if r.failure else ""))
        out.append(Check(f"bug {bug.name}", r.caught, detail[:200], r.seconds, tool_failure=r.status == "tool failure"))
    return out


def check_e2e(names: list[str] | None = None) -> list[Check]:
    """The real-decoding scenarios (fuzz/commands/e2e/) at the verify size
    (``kvspec.fuzz.commands.e2e.checks.VERIFY``: the short size's 32-token
    streams and window 8 on models 2 and 3, which ``make test``'s short
    size does not build), every check of each and the short size's
    minimums; the figures a scenario only reports in its notes (which this
    table does not show) are not measured
    (``kvspec.fuzz.commands.e2e.checks.checks_only``). ``kvspec e2e`` runs
    the default size (64 tokens, window 16, models 0 to 2)."""
    from kvspec.fuzz.commands.e2e import VERIFY, run_all
    from kvspec.fuzz.commands.e2e.checks import checks_only

    checks = []
    with checks_only():
        results = run_all(VERIFY, names=names)
    for r in results:
        extra = f", acceptance {r.acceptance:.0%}" if r.acceptance is not None else ""
        detail = f"{r.tokens} tokens, {r.distinct} distinct{extra}" if r.ok else r.detail
        checks.append(Check(f"e2e {r.name}", r.ok, detail, r.seconds))
    return checks


def _crosshair_text(ch: dict) -> str:
    keys = ("confirmed", "not_confirmed", "explained", "precondition_unmet", "counterexamples")
    parts = [f"{k.replace('_', ' ')} {len(v) if isinstance(v, list) else v}" for k in keys if (v := ch.get(k)) is not None]
    if ch.get("retried"):
        parts.append(f"run again with three times the limit: {', '.join(ch['retried'])}")
    if ch.get("errors"):
        parts.append(f"errors: {'; '.join(ch['errors'])[:300]}")
    return ", ".join(parts) or json.dumps(ch)[:200]


def check_crosshair_file(rel: str) -> list[Check]:
    """CrossHair on the contracts of one spec file (``spec/dense.py``):
    every condition confirmed or explained (``kvspec.proofs.crosshair_run``); one
    ``crosshair`` process, so the job keeps one core busy."""
    from kvspec.proofs import crosshair_run

    res = crosshair_run.run(files=[rel], diff=False, workers=1)
    if not res.conditions and not res.errors:
        return [Check(f"crosshair {rel} contracts", False, "no condition was checked or explained", res.seconds)]
    return [Check(f"crosshair {rel} contracts", res.ok, _crosshair_text(res.to_json()), res.seconds,
                  warnings=tuple(res.warnings))]


def check_crosshair_diff() -> list[Check]:
    """``crosshair diffbehavior`` of the spec's regrow rule against the
    implementation's (no difference) and against its negative control (a
    difference found)."""
    from kvspec.proofs import crosshair_run

    start = time.perf_counter()
    diff = crosshair_run.diffbehavior(*crosshair_run.DIFF_TARGET, 10.0)
    control = crosshair_run.diffbehavior(*crosshair_run.DIFF_CONTROL, 10.0)
    ok = diff["status"] == "same" and control["status"] == "differ"
    detail = (f"spec vs impl regrow_capacity: {diff['status']} (must be same); control "
              f"regrow_capacity_multiple_of_step: {control['status']} (must differ)")
    if not ok:
        bad = diff if diff["status"] != "same" else control
        detail += f"; {bad['output'][-200:]}"
    return [Check("crosshair diffbehavior regrow_capacity", ok, detail, time.perf_counter() - start)]


#: CPU seconds each Z3 obligation took on this project's 2-core machine,
#: each in a process of its own as the pool runs it (2026-12-06; the job's
#: expected seconds on an idle core): the pool's queue starts the longest
#: first. An obligation missing here counts 5 s.
PROOF_SECONDS = {1: 5.0, 2: 3.5, 3: 1.0, 4: 0.5, 5: 0.5, 6: 8.0, 7: 0.5, 8: 6.5,
                 9: 0.5, 10: 0.5, 11: 0.5, 12: 0.5, 13: 0.5, 14: 1.0, 15: 2.0, 16: 0.5,
                 17: 0.5, 18: 0.5, 19: 0.5, 20: 0.5, 21: 0.5, 22: 2.0, 23: 2.5, 24: 2.0, 25: 0.5, 26: 0.5}
#: CPU seconds of each e2e scenario's job at the verify size (2026-12-07,
#: this machine, a whole verify run, checks only; the queue's order: the
#: longest start first). One missing here counts 10 s.
E2E_SECONDS = {"hybrid_speculative": 12.6, "speculative_drift": 4.0, "hybrid_prompt_reuse": 3.6, "turbo": 3.3,
               "prompt_reuse": 3.1, "speculative": 2.9, "speculative_window": 2.7, "hybrid_mlx_lm": 2.3,
               "bf16_models": 1.5, "quantized_models": 1.4, "batch": 1.2, "greedy": 1.0, "sliding_window": 0.7,
               "prefix_sharing": 0.5, "lru_prompt_cache": 0.3, "mixed_rollback": 0.3}
#: the same for CrossHair, per spec file (one ``crosshair`` process each)
CROSSHAIR_SECONDS = {"spec/dense.py": 10.0, "spec/layers.py": 13.0, "spec/paged.py": 3.0, "spec/rotating.py": 13.0,
                     "spec/turbo.py": 4.0, "spec/recurrent.py": 2.0, "spec/cells.py": 2.0,
                     "spec/prefix.py": 8.0}


def _missing_solver(e: ImportError) -> str:
    """What a proof job says where the proofs cannot be imported: the
    missing module by name (on the GPU machine, Z3: ``tools/gpu_extras.sh``
    ships it), not a guess."""
    missing = e.name or str(e)
    if missing.split(".")[0] == "z3":
        return "Z3 is not installed (pip install z3-solver; on the GPU machine: tools/gpu_extras.sh)"
    return f"the proofs cannot be imported: {e}"


#: what the proof zygote imports before it forks each obligation's process:
#: what ``python -c "...print_obligation_checks(N)"`` would import before
#: it runs the obligation (no MLX, no Z3 solver run)
PROOF_PRELOAD = ("kvspec.fuzz.commands.verify", "kvspec.proofs.cli:obligations")


def check_obligation(number: int) -> list[Check]:
    """Z3 obligation ``number`` (``kvspec.proofs.cli.obligations``): proved in
    both domains with every negative control refuted, or waiting for a spec
    that does not exist yet (reported, not failed).

    It runs in a process of its own, forked for it alone from a zygote
    (``kvspec.fuzz.zygote``: a fresh interpreter that imported the proofs
    and ran nothing), so every obligation starts from the same process
    state whatever ran before it: Z3's search is not a function of its
    input and seed alone. Inside a warm worker that had run the other jobs,
    a search that ends in a second in a fresh process ran for minutes in
    Z3's nonlinear arithmetic, where the resource limit is not counted. The
    zygote is started once per process that runs obligations (about a
    quarter of a second), not once per obligation. A process that gives no
    result (it died, or printed no checks) is a tool failure."""
    import dataclasses

    try:
        import kvspec.proofs.cli  # noqa: F401 - a missing Z3 is said here, not in the child
    except ImportError as e:
        return [Check(f"proof {number}", False, _missing_solver(e), 0.0)]
    from kvspec.fuzz import zygote

    proc = zygote.shared(PROOF_PRELOAD).run("kvspec.fuzz.commands.verify:print_obligation_checks", (int(number),))
    lines = proc.stdout.strip().splitlines()
    try:
        rows = json.loads(lines[-1])
        names = {f.name for f in dataclasses.fields(Check)}
        return [Check(**{k: (tuple(v) if k == "warnings" else v) for k, v in row.items() if k in names})
                for row in rows]
    except (IndexError, ValueError, TypeError):
        return [Check(f"proof {number}", False, f"the obligation's process gave no result (exit {proc.returncode}): "
                      f"{(proc.stderr or proc.stdout).strip()[-400:]}", 0.0, tool_failure=True)]


def print_obligation_checks(number: int) -> None:
    """:func:`check_obligation`'s work, in the process that runs it: its
    checks as one JSON line on stdout."""
    import dataclasses

    print(json.dumps([dataclasses.asdict(c) for c in obligation_checks(number)]))


def obligation_checks(number: int) -> list[Check]:
    """:func:`check_obligation`'s work, in the process that runs it."""
    from kvspec.proofs.cli import obligations

    thunks = [thunk for n, thunk in obligations() if n == number]
    if not thunks:
        return [Check(f"proof {number}", False, f"no obligation numbered {number}", 0.0)]
    checks = []
    for thunk in thunks:
        ob = thunk()
        waits = ob.status == "waits"
        ok = waits or (ob.status == "proved" and ob.negative_control == "refuted")
        detail = f"{ob.status}, negative control {ob.negative_control}"
        if ob.units_given:
            detail += f"; Z3 units: at most {ob.units:,} of {ob.units_given:,} per check"
        if not ok:
            bad = [f"{p.part} ({p.domain}): {p.status}" + (f" ({p.reason})" if p.status == "unknown" else "")
                   for p in ob.parts if p.status != "proved"]
            bad += [f"control {c.name}: {c.status}" for c in ob.controls if c.status != "refuted"]
            bad += [u for u in ob.unknowns() if u.startswith("negative control")]
            detail += "; " + "; ".join(bad)[:600] + f"; rerun it alone: {ob.rerun()}"
        checks.append(Check(f"proof {ob.name}", ok, detail, ob.seconds))
    return checks


def proof_jobs(crosshair: bool = True) -> list[Job]:
    """One job per Z3 obligation, per CrossHair contract file and for the
    diffbehavior check (``crosshair=False``: the obligations only):
    independent, so the pool balances them over the cores with everything
    else (a single proofs job was the run's critical path)."""
    try:
        from kvspec.proofs import crosshair_run
        from kvspec.proofs.cli import TITLES, obligations
    except ImportError:
        return [Job("proofs", "check_obligation", (0,), 1.0)]
    # a proof's expected seconds are CPU seconds of an idle core; on a loaded
    # machine it does the same work (Z3 counts its budgets in deterministic
    # units, with no clock in its strategy: kvspec.proofs.domain.solver) in more
    # wall-clock time. Its limit, eight times them and at least 300 s, is a
    # hang guard: when it fires the job fails as stopped, never as the
    # obligation's "unknown"
    jobs = [Job(f"proof {TITLES.get(n, n)}", "check_obligation", (n,), PROOF_SECONDS.get(n, 5.0),
                max(300.0, 8 * PROOF_SECONDS.get(n, 5.0)))
            for n in sorted({n for n, _ in obligations()})]
    if not crosshair:
        return jobs
    for path in crosshair_run.contract_files():
        rel = str(path.relative_to(crosshair_run.ROOT))
        jobs.append(Job(f"crosshair {rel}", "check_crosshair_file", (rel,), CROSSHAIR_SECONDS.get(rel, 10.0)))
    jobs.append(Job("crosshair diffbehavior", "check_crosshair_diff", (), 4.0))
    return jobs


def check_equivalents() -> list[Check]:
    """The Z3 checks behind the equivalent-mutant arguments (docs/mutation.md)."""
    from kvspec.proofs.equivalents import EQUIVALENCES, check

    checks = []
    for e in EQUIVALENCES:
        start = time.perf_counter()
        r = check(e)
        detail = ("equivalent, control refuted" if r.ok else
                  f"{'equivalent' if r.proved else 'NOT equivalent'}, control {'refuted' if r.control_refuted else 'NOT refuted'}"
                  f" ({r.counterexample})")
        checks.append(Check(f"equivalent mutant {r.name}", r.ok, detail, time.perf_counter() - start))
    return checks


# -- the plan: independent jobs, run inline or in a process pool ---------------------
@dataclass(frozen=True)
class Job:
    """One independent unit of ``kvspec verify``: ``func(*args)`` returns
    its checks. ``weight`` (expected seconds) orders the pool's queue,
    longest first; the table keeps the plan's order whatever finishes first."""

    label: str
    func: str
    args: tuple = ()
    weight: float = 1.0
    #: wall-clock seconds it may run (None: :func:`job_limit`'s default)
    limit: float | None = None


def _under_mechanism(mechanism: str, fn: Any, *args: Any) -> list[Check]:
    """``fn(*args)`` with the CUDA in-place mechanism ``mechanism``
    (``KV_CUDA_INPLACE``, kvspec.impl.write) for this job only; each check's name
    says which mechanism ran."""
    saved = os.environ.get("KV_CUDA_INPLACE")
    os.environ["KV_CUDA_INPLACE"] = mechanism
    try:
        checks = fn(*args)
    finally:
        if saved is None:
            os.environ.pop("KV_CUDA_INPLACE", None)
        else:
            os.environ["KV_CUDA_INPLACE"] = saved
    for c in checks:
        c.name += f" [cuda {mechanism}]"
    return checks


def check_campaigns_cuda(mechanism: str, budget: float, only: tuple[str, str, bool]) -> list[Check]:
    """:func:`check_campaigns` under the CUDA in-place mechanism ``mechanism``."""
    return _under_mechanism(mechanism, check_campaigns, budget, only)


def check_bugs_cuda(mechanism: str, out: str, seeds: int, names: list[str]) -> list[Check]:
    """:func:`check_bugs` under the CUDA in-place mechanism ``mechanism``.
    On CUDA verify runs the catalog's (device-independent) bugs under
    ``kernel``: there an in-place write aliases the buffer exactly as the
    NumPy view does on the CPU, so an ownership-rule bug (an in-place write
    that a holder sees) is observable as it is on the CPU; under ``donate``
    MLX copies beside a holder and hides it."""
    return _under_mechanism(mechanism, check_bugs, out, seeds, names)


def gpu_only_bugs_skipped() -> list[str]:
    """Catalog entries this device cannot run (GPU-only ones off a CUDA GPU,
    CPU-only ones on it)."""
    from kvspec.fuzz.bugs import catalog, runnable

    return [b.name for b in catalog() if not runnable(b)]


def plan(quick: bool = False, out: str = "fuzz-failures", skip_proofs: bool = False) -> list[Job]:
    """Every job of a verify run, in table order. On a CUDA GPU the in-place
    campaigns run once more with the ``kernel`` mechanism (the default is
    ``donate``) and the GPU-only injected bugs join the catalog's."""
    from kvspec.fuzz.bugs import catalog, runnable
    from kvspec.impl.write import backend

    budget, seeds = (0.0, 1) if quick else (CAMPAIGN_BUDGET, 5)
    jobs = [Job("traces", "check_traces", (), 20.0), Job("harness mutants", "check_harness_mutants", (), 5.0)]
    for kind in kinds.KINDS.values():
        for mode, inplace in kind.campaigns:
            label = f"fuzz {kind.kind}/{mode}/{'inplace' if inplace else 'copy'}"
            if quick:
                jobs.append(Job(label, "check_campaigns", (0.0, (kind.kind, mode, inplace), False, QUICK_EXAMPLES),
                                QUICK_CAMPAIGN_SECONDS.get(kind.kind, 2.0)))
            else:
                jobs.append(Job(label, "check_campaigns", (budget, (kind.kind, mode, inplace), True), budget + 3))
    if backend() == "cuda":
        for kind in kinds.KINDS.values():
            for mode, inplace in kind.campaigns:
                if inplace:
                    label = f"fuzz {kind.kind}/{mode}/inplace [cuda kernel]"
                    jobs.append(Job(label, "check_campaigns_cuda", ("kernel", budget, (kind.kind, mode, inplace)),
                                    budget + 3))
    examples = 40 if quick else 200
    jobs += [Job(f"batch lockstep/{name}", "check_batch", (ring, examples), examples / 20)
             for name, ring in (("dense", False), ("rotating", True))]
    jobs.append(Job("batch lockstep/recurrent", "check_batch_recurrent", (examples,), examples / 40))
    # every batch bug is caught within 200 programs (80 at most), not all
    # within 40: quick gives them the full verify's examples (about 3 s)
    jobs.append(Job("batch bugs", "check_batch_bugs", (200,), 6.0))
    for bug in catalog():
        if not runnable(bug):
            continue
        weight = BUG_SEED_WEIGHT * seeds * (1 + len(bug.variants))
        limit = BUG_SEED_SECONDS * seeds * (1 + len(bug.variants))
        if backend() == "cuda" and bug.device != "gpu":
            jobs.append(Job(f"bug {bug.name}", "check_bugs_cuda", ("kernel", out, seeds, [bug.name]), weight, limit))
        else:
            jobs.append(Job(f"bug {bug.name}", "check_bugs", (out, seeds, [bug.name]), weight, limit))
    if not quick:
        from kvspec.fuzz.commands.e2e import SCENARIOS, gpu_skipped

        skip = {name for name, _ in gpu_skipped()}
        jobs += [Job(f"e2e {s.name}", "check_e2e", ([s.name],), E2E_SECONDS.get(s.name, 10.0))
                 for s in SCENARIOS if s.name not in skip]
    if not skip_proofs:
        jobs += proof_jobs(crosshair=not quick)
        jobs.append(Job("equivalent mutants", "check_equivalents", (), 1.0))
    return jobs


def run_job(job: Job) -> list[Check]:
    """Run one job (in a pool worker or inline). A crash is a failed check."""
    start = time.perf_counter()
    try:
        from kvspec.fuzz.device import select

        select(None)  # the device the parent chose (KVSPEC_DEVICE), in this worker too
        return globals()[job.func](*job.args)
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return [Check(job.label, False, f"crashed: {type(exc).__name__}: {exc}", time.perf_counter() - start)]


def default_jobs() -> int:
    """Every core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class Progress:
    """One line per finished job on stderr: a live rich bar on a terminal,
    plain ``[done/total] label: ok (seconds)`` lines otherwise."""

    def __init__(self, total: int, stream: Any = None, quiet: bool = False):
        self.total, self.done, self.quiet = total, 0, quiet
        #: CPU seconds of the finished jobs (their processes and the
        #: processes they waited for), summed: half of it is what the run
        #: takes on two cores of its own, whatever the load was
        self.cpu = 0.0
        #: CPU seconds the pool's workers took to start and import what
        #: every job uses (once per worker, not per job)
        self.start_cpu = 0.0
        self.stream = stream or sys.stderr
        self.console = Console(file=self.stream, highlight=False, emoji=False)
        self.bar: Any = None
        if not quiet and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                    TextColumn("{task.description}"), console=self.console, transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, markup=False)

    def finished(self, job: Job, checks: list[Check], seconds: float, cpu: float | None = None) -> None:
        """``seconds``: since the run started; ``cpu``: the job's CPU seconds
        (None: not measured, a job that was stopped or died)."""
        self.done += 1
        self.cpu += cpu or 0.0
        bad = [c.name for c in checks if not c.ok]
        verdict = "ok" if not bad else f"FAILED: {', '.join(bad)}"
        traces = [c.trace for c in checks if not c.ok and c.trace]
        if traces:  # printed as soon as the job ends: a run cut short still names them
            verdict += f" (kvtrace: {', '.join(traces)})"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{job.label}: {verdict}")
            if bad:
                self.bar.console.print(f"{job.label}: {verdict}", markup=False)
        else:
            spent = sum(c.seconds for c in checks)
            used = f", {cpu:.1f} s CPU" if cpu is not None else ""
            self.say(f"[{self.done}/{self.total}] {job.label}: {verdict} ({spent:.1f} s{used}; {seconds:.0f} s elapsed)")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def job_limit(job: Job) -> float:
    """Wall-clock seconds ``job`` may run in a pool worker before it is
    stopped and failed with a message naming it (a hung MLX evaluation or a
    runaway search must not hang the whole run): the job's own ``limit``
    (a bug job: :data:`BUG_SEED_SECONDS` per seed and variant), else four
    times its expected seconds, at least two minutes.
    ``KVSPEC_VERIFY_JOB_LIMIT`` (seconds) overrides it for every job."""
    env = os.environ.get("KVSPEC_VERIFY_JOB_LIMIT", "").strip()
    if env:
        return float(env)
    if job.limit is not None:
        return job.limit
    return max(120.0, 4.0 * job.weight)


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of the processes it
    has waited for (a job's ``crosshair`` or e2e subprocesses), and of its
    zygotes' (the proof obligations' processes, ``kvspec.fuzz.zygote.cpu``)."""
    import resource

    from kvspec.fuzz import zygote

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + zygote.cpu()


def _pool_checks(job: Job, r: Any) -> list[Check]:
    """A pool result (:class:`kvspec.fuzz.workers.TaskResult`) as ``job``'s checks:
    its own, or one failed check naming the job (stopped past its limit,
    its worker died, it raised outside :func:`run_job`); a job that left
    its worker changed keeps its checks and adds a tool failure naming
    what it changed (its verdict, and the next job's, cannot be trusted)."""
    if r.status in ("ok", "leaked"):
        checks = list(r.value)
        if r.status == "leaked":
            checks.append(Check(f"{job.label} [isolation]", False,
                                f"job {job.label!r} left its worker changed ({r.leaked}); the worker was replaced "
                                "(kvspec.fuzz.workers: a job must restore what it patches)", r.seconds, tool_failure=True))
        return checks
    if r.status == "stopped":
        return [Check(job.label, False, f"job {job.label!r} ran past its wall-clock limit of {job_limit(job):.0f} s "
                      f"and was stopped (a hang or a runaway search; rerun it alone: kvspec verify -k {job.label!r} "
                      "-j 1)", r.seconds)]
    if r.status == "died":
        return [Check(job.label, False, r.error.replace(f"task {job.label!r}", f"job {job.label!r}"), r.seconds)]
    last = (r.error or "").strip().splitlines()[-1:] or ["?"]
    return [Check(job.label, False, f"crashed: {last[0]}", r.seconds)]


def run_jobs(jobs: list[Job], workers: int, progress: Progress, exitfirst: bool = False) -> dict[int, list[Check]]:
    """Run ``jobs`` on ``workers`` warm processes (:class:`kvspec.fuzz.workers.WarmPool`:
    each imports MLX, the implementation, the spec and the harness once and
    runs job after job, the longest first; 1 runs them inline). A job that
    runs past :func:`job_limit` is stopped (its worker killed and replaced)
    and reported as a failed check naming it, as is a worker that dies; a
    job that leaves its worker changed is a tool failure. Returns index ->
    checks for every job that finished; with ``exitfirst`` it returns after
    the first job with a failed check (the others do not run, or are
    stopped). KeyboardInterrupt propagates with the partial results
    attached as ``exc.partial``."""
    results: dict[int, list[Check]] = {}
    try:
        start = time.perf_counter()
        if workers <= 1:
            for i, job in enumerate(jobs):
                cpu = _cpu_seconds()
                results[i] = run_job(job)
                progress.finished(job, results[i], time.perf_counter() - start, _cpu_seconds() - cpu)
                if exitfirst and not all(c.ok for c in results[i]):
                    break
            return results
        from kvspec.fuzz.workers import Task, WarmPool

        tasks = [Task("kvspec.fuzz.commands.verify:run_job", (job,), job_limit(job), job.weight, job.label) for job in jobs]
        with WarmPool(workers) as pool:
            try:
                for r in pool.run(tasks, on_poll=interrupt.check):
                    job = jobs[r.index]
                    results[r.index] = checks = _pool_checks(job, r)
                    measured = r.status in ("ok", "leaked", "error")
                    progress.finished(job, checks, time.perf_counter() - start, r.cpu if measured else None)
                    if exitfirst and not all(c.ok for c in checks):
                        break
            finally:
                progress.start_cpu = pool.start_cpu
        return results
    except KeyboardInterrupt as exc:
        exc.partial = results  # type: ignore[attr-defined]
        raise


def select(jobs: list[Job], patterns: list[str] | None) -> list[Job]:
    """``verify -k``: the jobs whose label contains one of ``patterns`` (a
    shell glob, matched against the whole label, when it has ``*?[``)."""
    from fnmatch import fnmatchcase

    if not patterns:
        return jobs

    def hit(label: str, pat: str) -> bool:
        return fnmatchcase(label, pat) if any(ch in pat for ch in "*?[") else pat in label

    return [j for j in jobs if any(hit(j.label, p) for p in patterns)]


def run_verify(quick: bool = False, as_json: bool = False, out: str = "fuzz-failures", skip_proofs: bool = False,
               jobs: int | None = None, width: int | None = None, patterns: list[str] | None = None,
               exitfirst: bool = False, list_only: bool = False, junit_xml: str | None = None,
               argv: list[str] | None = None) -> int:
    """Exit 0 when every check passes, 1 when one fails (with
    ``exitfirst``: the first), 2 when ``patterns`` select no job, 130 when
    interrupted (Ctrl-C: the checks finished so far are printed)."""
    start = time.perf_counter()
    workers = default_jobs() if jobs is None else jobs
    full = plan(quick, out, skip_proofs)
    the_plan = select(full, patterns)
    if list_only:
        for job in the_plan:
            print(job.label)
        return 0
    if not the_plan:
        from kvspec.fuzz.commands.reports import suggest

        hint = suggest(patterns[0], [j.label for j in full]) if patterns else ""
        Console(stderr=True, highlight=False, emoji=False).print(
            f"error: -k {' '.join(patterns or [])}: no job's label matches{hint}; kvspec verify --list shows them",
            markup=False)
        return 2
    workers = min(workers, len(the_plan))
    progress = Progress(len(the_plan), quiet=False)
    from kvspec.fuzz.campaign import default_engine
    from kvspec.fuzz.device import current
    from kvspec.impl.write import backend, inplace_mechanism

    where = (f"device {current()} ({backend()}, in-place writes: {inplace_mechanism()}); "
             f"engine {default_engine()}")
    progress.say(f"kvspec verify{' --quick' if quick else ''}: {len(the_plan)} jobs (each one or more checks, "
                 f"the table's rows) on {workers} "
                 f"process{'es' if workers > 1 else ''}; {where}; campaign seed {CAMPAIGN_SEED}, bug seeds "
                 f"1..{1 if quick else 5}")
    skipped = gpu_only_bugs_skipped()
    from kvspec.fuzz.commands.e2e import gpu_skipped

    e2e_skipped = [] if quick else [name for name, _ in gpu_skipped()]
    interrupted = False
    try:
        results = run_jobs(the_plan, workers, progress, exitfirst)
    except KeyboardInterrupt as exc:
        results, interrupted = getattr(exc, "partial", {}), True
    finally:
        progress.stop()
    checks = [c for i in range(len(the_plan)) if i in results for c in results[i]]
    missing = [the_plan[i].label for i in range(len(the_plan)) if i not in results]
    total = time.perf_counter() - start
    stopped = exitfirst and bool(missing) and not interrupted and any(not c.ok for c in checks)
    ok = all(c.ok for c in checks) and not missing
    from kvspec.fuzz.commands.reports import Case, rerun, write_junit

    again = rerun("verify", argv or ["verify"] + (["--quick"] if quick else []))
    if junit_xml:
        cases = [Case(c.name.split(" ", 1)[0], c.name, c.ok, c.seconds,
                      c.detail + (f"\nreplay it: kvspec replay {c.trace}" if c.trace and not c.ok else "")) for c in checks]
        why = "interrupted" if interrupted else "stopped at the first failure (-x)"
        cases += [Case(label.split(" ", 1)[0], label, False, 0.0, skipped=why) for label in missing]
        write_junit(junit_xml, cases)
    # a verdict the tool could not repeat is no verdict: exit 2 over 1
    code = 130 if interrupted else (0 if ok else 2 if any(c.tool_failure for c in checks) else 1)
    if as_json:
        print(json.dumps({"ok": ok, "exit": code, "seconds": round(total, 1), "cpu_seconds": round(progress.cpu, 1),
                          "jobs": workers,
                          "interrupted": interrupted, "stopped_at_first_failure": stopped, "selected": patterns or [],
                          "not_run": missing, "device": where, "gpu_only_bugs_not_run": skipped,
                          "e2e_not_run_on_gpu": e2e_skipped,
                          "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail, "seconds": round(c.seconds, 2),
                                      "trace": c.trace, "warnings": list(c.warnings),
                                      "tool_failure": c.tool_failure} for c in checks]}))
    else:
        table = Table(title="kvspec verify" + (" (quick)" if quick else ""))
        table.add_column("check", overflow="fold")
        table.add_column("result", no_wrap=True)
        table.add_column("time", justify="right", no_wrap=True)
        table.add_column("detail", overflow="fold", ratio=1)
        for c in checks:
            status = "[bold red]TOOL FAILURE[/]" if c.tool_failure else "[bold red]FAIL[/]" if not c.ok else f"[yellow]warn ({len(c.warnings)})[/]" if c.warnings else "[green]ok[/]"
            table.add_row(escape(c.name), status, f"{c.seconds:.1f}s", escape(c.detail))
        console = Console(highlight=False, width=width, emoji=False)
        from kvspec.fuzz.commands.reports import print_table

        print_table(console, table)
        failed = [c.name for c in checks if not c.ok]
        for c in checks:
            if c.trace and not c.ok:
                console.print(f"{escape(c.name)}: kvspec replay {escape(c.trace)}", soft_wrap=True)
        for c in checks:
            for w in c.warnings:
                console.print(f"[yellow]warning[/] {escape(c.name)}: {escape(w)}", soft_wrap=True)
        jobs_failed = sum(1 for i in results if not all(c.ok for c in results[i]))
        console.print(f"{len(checks) - len(failed)} checks passed, {len(failed)} failed (the table's rows), from "
                      f"{len(results)} of {len(the_plan)} jobs ({len(results) - jobs_failed} jobs passed, "
                      f"{jobs_failed} failed) in {total:.0f} s ({workers} processes, "
                      f"{progress.cpu:.0f} s of CPU in the jobs"
                      + (f", {progress.start_cpu:.0f} s starting the workers" if progress.start_cpu else "")
                      + f"; {where})")
        if skipped:
            console.print(f"not run here: {len(skipped)} injected bugs of another device ({escape(', '.join(skipped))}); "
                          "GPU-only ones run with kvspec verify --device gpu on a machine with MLX's CUDA backend, "
                          "CPU-only ones off it", soft_wrap=True)
        if e2e_skipped:
            console.print(f"not run on the GPU: e2e {escape(', '.join(e2e_skipped))} (they compare outputs of "
                          "different kernel shapes bit for bit; GPU kernels round by shape; kvspec e2e says which)",
                          soft_wrap=True)
        if interrupted or stopped:
            why = "[bold yellow]interrupted[/]" if interrupted else "[bold red]stopped at the first failure[/] (-x)"
            console.print(f"{why}: {len(missing)} of {len(the_plan)} jobs did not run: "
                          f"{escape(', '.join(missing))}\n  rerun: {escape(again)}", soft_wrap=True)
    return code
