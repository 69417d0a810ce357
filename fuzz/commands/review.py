"""Reviewing a change to an engine's caches: ``kvspec conformance --baseline``
and ``kvspec fuzz --target T --baseline``.

The head is the environment the command runs in (the engine as installed
there, ``PYTHONPATH`` included). The base (``--baseline BASE``) is one of

* a saved report (``BASE`` ends in ``.json``): the JSON ``kvspec
  conformance --examples N --json`` or ``kvspec fuzz --target T --examples
  N --json`` printed on the base (or the JSON of an earlier comparison:
  its head);
* an import folder (``BASE`` is a folder, e.g. a checkout of the engine
  at the base commit): the base runs in a process of its own with the
  folder first on ``sys.path``;
* another install (``BASE`` is a Python executable, e.g. another
  virtualenv's ``bin/python``, with kvspec installed there too): the base
  runs in that interpreter.

A base process never sees the head's ``PYTHONPATH`` nor the current
folder on its ``sys.path``. Both sides run the same search bounded by
examples (``--examples``, default :data:`BASELINE_EXAMPLES`), from the same
seed, never by seconds: an unchanged copy of the engine gives the same
divergences.

A divergence is identified by a stable key: the class (or the fuzz
configuration ``kind/mode/write path``), the check that failed (the
divergence's ``what`` with holder names and numbers left out,
:func:`check_of`) and the op class it failed at (``kvspec.fuzz.targets.op_class``:
``trim n>0``, ``append n=1``, ...), never by seed or trace text. Keys
only the head has are *added*, keys only the base has are *fixed*, keys
both have are *in both*. A search stops at the first divergence of an op
class, so a divergence one side found can hide another from that side's
search: before saying so, an added key's minimal trace is replayed on the
base (an import folder or an install) and a fixed key's on the head; a
replay that diverges under the same key moves it to *in both*.

Exit status: 1 when the head adds a divergence; 0 when it adds none; 2
for bad input (an unreadable or mismatched report, a base that is neither
a report, a folder nor an executable) and when there is no verdict (the
base could not run, a class or campaign stopped without a verdict).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: examples per class (conformance) or campaign (fuzz) of a comparison
#: when --examples is not given
BASELINE_EXAMPLES = 200
#: the seed of a fuzz comparison when --seed is not given (never the clock)
FUZZ_SEED = 20261207
#: seconds a side may run before it is called hung (a guard, never a bound)
SIDE_TIMEOUT = 3600.0
#: the module a side's process runs (``python -m``)
SIDE_MODULE = "kvspec.fuzz.commands.review_side"
#: exit status of a side that could not run (kvspec.fuzz.commands.review_side)
SIDE_FAILED = 3


class BaselineError(ValueError):
    """Bad input to a comparison: exit 2 with the message."""


class SideFailure(RuntimeError):
    """A side could not run (a tool failure, never a divergence): exit 2."""


@dataclass(frozen=True)
class Baseline:
    """Where the base comes from: ``how`` is ``report``, ``path`` or
    ``python``; ``where`` the file, folder or executable."""

    how: str
    where: str

    def describe(self) -> str:
        return {"report": "saved report", "path": "import folder", "python": "install of"}[self.how] + f" {self.where}"


def parse_baseline(value: str) -> Baseline:
    """``--baseline``'s value as a :class:`Baseline`; BaselineError naming
    the rule when it is none of a report, a folder or an executable."""
    p = Path(value)
    rule = "give a saved report (REPORT.json), an import folder, or a Python executable"
    if not value or not p.exists():
        raise BaselineError(f"--baseline: {value!r} does not exist ({rule})")
    if p.is_dir():
        return Baseline("path", str(p.resolve()))
    if p.suffix == ".json":
        return Baseline("report", str(p.resolve()))
    if os.access(p, os.X_OK):
        # not resolved: a virtualenv's python is a link to the base
        # interpreter, and only the link's path makes it that virtualenv's
        return Baseline("python", str(p.absolute()))
    raise BaselineError(f"--baseline: {value} is neither a .json report, a folder nor an executable ({rule})")


# -- keys ------------------------------------------------------------------------
def check_of(what: str) -> str:
    """A divergence's ``what`` without what varies from run to run: the
    arguments of ``make_mask``, holder and snapshot names' numbers, layer
    and op numbers (``view of s1 changed (isolation)`` -> ``view of sN
    changed (isolation)``)."""
    w = re.sub(r"make_mask\(.*\)", "make_mask", what)
    w = w.replace("holder:", "")
    w = re.sub(r"'[^']*'", "'…'", w)
    w = re.sub(r"\d+", "N", w)
    return re.sub(r"\s+", " ", w).strip()


def op_class_of(op: Any) -> str:
    """The op class (``kvspec.fuzz.targets.op_class``) of a finding's op, ``-`` for none."""
    from kvspec.fuzz.targets import op_class

    if not isinstance(op, dict) or "op" not in op:
        return "-"
    try:
        return op_class(op)
    except (KeyError, TypeError):
        return str(op.get("op"))


def key_of(unit: str, what: str, op: Any) -> str:
    """The stable key of a divergence: class or configuration, check, op class."""
    return f"{unit} | {check_of(what)} | {op_class_of(op)}"


def _parse_failure(line: str) -> tuple[dict[str, Any], str] | None:
    """``op 3 {"op": ...}: what`` (a Divergence's first line) as (op, what)."""
    m = re.match(r"op (\d+) ", line)
    if not m:
        return None
    try:
        op, end = json.JSONDecoder().raw_decode(line, m.end())
    except ValueError:
        return None
    rest = line[end:]
    return (op, rest[2:]) if rest.startswith(": ") else None


@dataclass
class Divergences:
    """One side's divergences by key, and its units without a verdict."""

    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)
    no_verdict: dict[str, str] = field(default_factory=dict)
    units: list[str] = field(default_factory=list)


def divergences(doc: dict[str, Any], command: str) -> Divergences:
    """The divergences of a conformance report (``classes``) or of an
    example-bounded fuzz report (``runs``), each under :func:`key_of`."""
    out = Divergences()
    if command == "conformance":
        for c in doc.get("classes", []):
            unit = c["cache_class"]
            out.units.append(unit)
            if c.get("no_verdict"):
                out.no_verdict[unit] = c["no_verdict"]
            for f in c.get("findings", []):
                key = key_of(unit, f.get("what", ""), f.get("op"))
                out.by_key.setdefault(key, {
                    "key": key, "unit": unit, "check": check_of(f.get("what", "")),
                    "op_class": op_class_of(f.get("op")), "what": f.get("what"), "summary": f.get("summary"),
                    "index": f.get("index"), "op": f.get("op"), "trace": f.get("trace"), "replay": f.get("replay"),
                    "target": f.get("target"), "waived": f.get("waived", []), "category": f.get("category"),
                    "confirmed": f.get("confirmed")})
        return out
    for r in doc.get("runs", []):
        unit = str(r["config"]).rsplit(":", 1)[-1]
        out.units.append(unit)
        if r.get("result") in ("ok",):
            continue
        if r.get("result") != "FAILED":
            out.no_verdict[unit] = f"{r.get('result')}: {r.get('failure', '')}".rstrip(": ")
            continue
        d = r.get("divergence")
        if d is None:
            parsed = _parse_failure(str(r.get("failure", "")))
            d = {"index": None, "op": parsed[0], "what": parsed[1]} if parsed else \
                {"index": None, "op": None, "what": str(r.get("failure", ""))}
        key = key_of(unit, d["what"], d["op"])
        out.by_key.setdefault(key, {
            "key": key, "unit": unit, "check": check_of(d["what"]), "op_class": op_class_of(d["op"]),
            "what": d["what"], "summary": r.get("failure"), "index": d.get("index"), "op": d["op"],
            "trace": r.get("trace"), "replay": r.get("replay"), "target": doc.get("target"), "waived": [],
            "category": None, "confirmed": None})
    return out


@dataclass
class Comparison:
    """What the head adds, fixes and shares with the base."""

    added: list[dict[str, Any]]
    fixed: list[dict[str, Any]]
    both: list[dict[str, Any]]
    no_verdict: dict[str, str]

    @property
    def exit_code(self) -> int:
        return 1 if self.added else 2 if self.no_verdict else 0


def compare(head: Divergences, base: Divergences) -> Comparison:
    """Keys only the head has (added), only the base has (fixed), both.
    A unit without a verdict on either side is compared on neither."""
    skip = set(head.no_verdict) | set(base.no_verdict)
    h = {k: v for k, v in head.by_key.items() if v["unit"] not in skip}
    b = {k: v for k, v in base.by_key.items() if v["unit"] not in skip}
    nv = {f"head {u}": why for u, why in head.no_verdict.items()}
    nv.update({f"base {u}": why for u, why in base.no_verdict.items()})
    return Comparison([h[k] for k in h if k not in b], [b[k] for k in b if k not in h],
                      [h[k] for k in h if k in b], nv)


def move_to_both(comp: Comparison, which: str, keys: set[str], note: str) -> None:
    """Move the entries of ``comp.<which>`` whose key is in ``keys`` to
    ``both``, with ``note`` saying which replay put it there."""
    keep = []
    for e in getattr(comp, which):
        if e["key"] in keys:
            comp.both.append({**e, "note": note})
        else:
            keep.append(e)
    setattr(comp, which, keep)


# -- the reports a side writes ------------------------------------------------------
def load_report(path: str, command: str) -> dict[str, Any]:
    """A saved report for ``command``, or BaselineError naming what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BaselineError(f"--baseline: {path} is not a readable JSON report ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if isinstance(doc, dict) and isinstance(doc.get("head"), dict) and "base" in doc:
        doc = doc["head"].get("report")  # an earlier comparison: its head
    field_name = "classes" if command == "conformance" else "runs"
    if not isinstance(doc, dict) or not isinstance(doc.get(field_name), list):
        made = ("kvspec conformance --examples N --json" if command == "conformance"
                else "kvspec fuzz --target T --examples N --json")
        raise BaselineError(f"--baseline: {path} is not a {command} report (no {field_name!r} list; make one with "
                            f"{made})")
    if not isinstance(doc.get("examples"), int):
        raise BaselineError(f"--baseline: {path} was bounded by seconds, not by examples (a verdict that depends on "
                            f"the machine's speed): make the base report with --examples N")
    return doc


# -- running a side ------------------------------------------------------------------
def _side_env(base: bool) -> dict[str, str]:
    env = dict(os.environ)
    if base:
        env.pop("PYTHONPATH", None)
    return env


def start_side(request: dict[str, Any], python: str, folder: Path, name: str,
               base: Baseline | None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start one side (``base`` None: the head) as a process; its request,
    result and log files go to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    req = dict(request)
    req["result"] = str((folder / f"{name}.result.json").resolve())
    if base is not None:
        req["isolate"] = True
        req["path"] = [base.where] if base.how == "path" else []
    req_path = folder / f"{name}.request.json"
    req_path.write_text(json.dumps(req, indent=1) + "\n")
    log = folder / f"{name}.log"
    result = Path(req["result"])
    if result.exists():
        result.unlink()
    with open(log, "wb") as fh:
        try:
            proc = subprocess.Popen([python, "-m", SIDE_MODULE, str(req_path.resolve())], stdin=subprocess.DEVNULL,
                                    stdout=fh, stderr=subprocess.STDOUT, env=_side_env(base is not None))
        except OSError as exc:
            raise SideFailure(f"{name}: {python} could not be started ({exc})") from None
    return proc, result, log


def finish_side(proc: subprocess.Popen[bytes], result: Path, log: Path, name: str,
                deadline: float) -> dict[str, Any]:
    """Wait for a side and return its result; SideFailure when it did not
    run (the reason, and the end of its log)."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SideFailure(f"{name}: still running after {SIDE_TIMEOUT:.0f} s (hung?); log: {log}") from None
    doc: Any = None
    if result.exists():
        try:
            doc = json.loads(result.read_text())
        except json.JSONDecodeError:
            doc = None
    if proc.returncode != 0 or not isinstance(doc, dict) or "error" in doc:
        why = doc.get("error") if isinstance(doc, dict) and doc.get("error") else _tail(log)
        raise SideFailure(f"{name} could not run (exit {proc.returncode}): {why}; log: {log}")
    return doc


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " / ".join(text[-lines:]) or "no output"


def run_sides(sides: list[tuple[str, dict[str, Any], str, Baseline | None]], folder: Path) -> dict[str, Any]:
    """Run sides ``(name, request, python, base)`` at once; their results
    by name. Every side is waited for; the first failure is raised after."""
    deadline = time.monotonic() + SIDE_TIMEOUT
    started = []
    try:
        for name, request, python, base in sides:
            started.append((name, *start_side(request, python, folder, name, base)))
    except SideFailure:
        for _, proc, _, _ in started:
            proc.kill()
            proc.wait()
        raise
    results: dict[str, Any] = {}
    running = list(started)
    try:
        while running:
            done = [s for s in running if s[1].poll() is not None] or \
                ([running[0]] if time.monotonic() >= deadline else [])
            for name, proc, result, log in done:
                running.remove((name, proc, result, log))
                results[name] = finish_side(proc, result, log, name, deadline)
            if not done:
                time.sleep(0.1)
    finally:  # a side that failed leaves no verdict: the others are not waited for
        for _, proc, _, _ in running:
            proc.kill()
            proc.wait()
    return results


# -- what a side runs (in its own process) ---------------------------------------------
def serve(request: dict[str, Any]) -> int:
    """Run ``request`` (kvspec.fuzz.commands.review_side) and write its result."""
    out = Path(request["result"])
    try:
        command = request["command"]
        if command == "conformance":
            doc = conformance_side(request)
        elif command == "fuzz":
            doc = fuzz_side(request)
        elif command == "replay":
            doc = replay_side(request)
        else:
            raise ValueError(f"unknown command {command!r}")
    except BaseException as exc:  # noqa: BLE001 - every failure of a side is reported, never a divergence
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}))
        import traceback

        traceback.print_exc()
        return SIDE_FAILED
    out.write_text(json.dumps(doc))
    return 0


def conformance_side(request: dict[str, Any]) -> dict[str, Any]:
    """An example-bounded conformance search (``kvspec conformance
    --examples N --json``'s report)."""
    from kvspec.fuzz.commands.conformance import run_conformance, to_json

    reports: list[Any] = []
    run_conformance(float("inf"), request["seed"], request["out"], request.get("classes"),
                    request.get("max_findings", 8), request.get("target"), reports=reports,
                    examples=request["examples"], steps=request.get("steps", 40))
    doc = to_json(reports, request["seed"], None, request["examples"], request.get("steps", 40))
    doc["exit"] = 2 if doc["no_verdict"] else 0 if doc["ok"] else 1
    doc["interrupted"] = False
    return doc


def fuzz_side(request: dict[str, Any]) -> dict[str, Any]:
    """An example-bounded fuzz run of a target (:func:`fuzz_examples`)."""
    return fuzz_examples(request.get("target") or "impl", request.get("kind"), request.get("mode"),
                         request.get("inplace", "both"), request["seed"], request["examples"],
                         request.get("steps", 40), request.get("engine"), request["out"])


def replay_side(request: dict[str, Any]) -> dict[str, Any]:
    """Replay minimal traces (``items``: trace, target, waived) and say
    where each diverges; a trace that cannot run says why."""
    from kvspec.fuzz.replay import failure_status, replay
    from kvspec.fuzz.targets import resolve
    from kvspec.fuzz.trace import load

    results = []
    for item in request["items"]:
        try:
            target = resolve(item.get("target") or "impl")
            for w in item.get("waived", []):
                target = target.waiving(w)
            r = replay(load(item["trace"]), target=target)
        except Exception as exc:  # noqa: BLE001 - a trace the side cannot run is reported, never a divergence
            results.append({"trace": item["trace"], "status": failure_status(exc), "error": str(exc).splitlines()[0]
                            if str(exc) else type(exc).__name__})
            continue
        d = r.divergence
        results.append({"trace": item["trace"], "status": "ok" if d is None else "diverged",
                         **({} if d is None else {"index": d.index, "op": d.op, "what": d.what})})
    return {"replays": results}


def fuzz_examples(target_name: str, kind: str | None, mode: str | None, inplace: str, seed: int, examples: int,
                  steps: int, engine: str | None, out: str | Path) -> dict[str, Any]:
    """Fuzz every configuration of ``target_name`` (filtered by ``kind``,
    ``mode``, ``inplace``: on, off, both) for ``examples`` examples each, in
    seeded rounds of 25 (round ``k`` runs seed ``seed + k``), stopping a
    configuration at its first failure; a failure is shrunk by replays
    (``ops_shrink``), never by seconds. The report: ``runs`` rows as
    ``kvspec fuzz --json`` writes them, with ``divergence`` (index, op,
    what) for a divergence. Raises BaselineError when no configuration
    matches."""
    from kvspec.fuzz import kinds
    from kvspec.fuzz.campaign import (
        check_engine,
        default_engine,
        machine_for,
        run_machine,
        save_failure,
    )
    from kvspec.fuzz.commands.conformance import BATCH, rounds_for
    from kvspec.fuzz.failures import Divergence
    from kvspec.fuzz.replay import failure_status
    from kvspec.fuzz.targets import resolve

    target = resolve(target_name)
    engine = check_engine(engine or default_engine())
    have = target.configs()
    configs = [(k, m) for k, m in have if kind in (None, k) and mode in (None, m)]
    if not configs:
        raise BaselineError(f"no implementation for kind={kind} mode={mode} on target {target.label}; have "
                            f"{', '.join(f'{k}/{m}' for k, m in have)}")
    switchable = target.is_impl or getattr(target, "takes_inplace", False)
    settings = {"on": [True], "off": [False], "both": [True, False]}[inplace] if switchable else [True]
    runs = [(k, m, ip) for k, m in configs
            for ip in (settings if m == "fp16" and kinds.get(k, m).inplace_switch else settings[:1])]
    rows = []
    for k, m, ip in runs:
        config = f"{k}/{m}/{'inplace' if ip else 'copy'}"
        machine = machine_for(k, m, ip, target=None if target.is_impl else target)
        row: dict[str, Any] = {"config": config if target.is_impl else f"{target.label}:{config}",
                               "examples": 0, "steps": 0, "seconds": 0.0, "shrink_seconds": 0.0,
                               "shrink_cut": False, "result": "ok", "reached": {}, "examples_to_catch": None}
        print(f"fuzz: {row['config']} (seed {seed}, {examples} examples) ...", file=sys.stderr, flush=True)
        for r in range(rounds_for(examples)):
            res = run_machine(machine, seed + r, max_examples=BATCH, steps=steps, engine=engine, ops_shrink=True)
            row["examples"] += res.examples
            row["steps"] += res.steps
            row["seconds"] = round(row["seconds"] + res.seconds, 2)  # reported, never a bound
            for name, count in res.stats.items():
                row["reached"][name] = row["reached"].get(name, 0) + count
            if not res.failed:
                continue
            row["examples_to_catch"] = row["examples"] - res.examples + (res.examples_to_catch or res.examples)
            status = failure_status(res.error)
            row["result"] = "FAILED" if status == "diverged" else status
            row["failure"] = str(res.error).splitlines()[0] if str(res.error) else type(res.error).__name__
            if isinstance(res.error, Divergence):
                row["divergence"] = {"index": res.error.index, "op": res.error.op, "what": res.error.what}
            if res.trace is not None:
                stem = f"{k}-{m}-{'inplace' if ip else 'copy'}-seed{seed}"
                stem = stem if target.is_impl else re.sub(r"[^A-Za-z0-9_.-]+", "_", target.label) + f"-{stem}"
                path = save_failure(res.trace, out, stem)
                row["trace"] = str(path)
                row["replay"] = f"kvspec replay {shlex.quote(str(path))}" + ("" if target.is_impl else f" --target {shlex.quote(target.label)}")
            break
        if row["examples"] == 0 and row["result"] == "ok":
            row["result"] = "no examples"
        rows.append(row)
    refused = any(r["result"] not in ("ok", "FAILED") for r in rows)
    failed = any(r["result"] == "FAILED" for r in rows)
    again = (f"kvspec fuzz --target {shlex.quote(target.label)}" + (f" --kind {kind}" if kind else "")
             + (f" --mode {mode}" if mode else "") + f" --inplace {inplace} --examples {examples} --seed {seed}")
    return {"seed": seed, "examples": examples, "steps": steps, "engine": engine, "budget": None, "jobs": 1,
            "target": target.label, "database": "none", "interrupted": None, "rerun": again, "declared": {},
            "runs": rows, "ok": not failed and not refused, "exit": 2 if refused else 1 if failed else 0}


# -- the comparison ------------------------------------------------------------------------
@dataclass
class Request:
    """What both sides run: ``command`` (conformance or fuzz) and its
    parameters, the same on both sides."""

    command: str
    params: dict[str, Any]
    out: Path


def compare_sides(req: Request, base: Baseline) -> dict[str, Any]:
    """Run the head (and the base, unless it is a saved report), compare,
    cross-check by replays; the comparison as a JSON document with
    ``exit``. Raises BaselineError (bad input) and SideFailure (no verdict)."""
    base_doc: dict[str, Any] | None = None
    if base.how == "report":
        base_doc = load_report(base.where, req.command)
        for name in ("seed", "examples", "steps"):  # not given: the report's
            if req.params.get(name) is None and base_doc.get(name) is not None:
                req.params[name] = base_doc[name]
        if req.command == "conformance" and not req.params.get("classes"):  # the classes the report ran
            req.params["classes"] = [c.get("cache_class") for c in base_doc["classes"]] or None
    defaults = {"seed": req.params.pop("default_seed", FUZZ_SEED), "examples": BASELINE_EXAMPLES, "steps": 40}
    for name, value in defaults.items():
        if req.params.get(name) is None:
            req.params[name] = value
    if base_doc is not None:
        _check_same(req, base_doc, base.where)
    python = base.where if base.how == "python" else sys.executable
    sides = [("head", {**req.params, "command": req.command, "out": str((req.out / "head").resolve())},
              sys.executable, None)]
    if base_doc is None:
        sides.append(("base", {**req.params, "command": req.command, "out": str((req.out / "base").resolve())},
                      python, base))
    results = run_sides(sides, req.out)
    head_doc = results["head"]
    base_doc = base_doc if base_doc is not None else results["base"]
    head_div, base_div = divergences(head_doc, req.command), divergences(base_doc, req.command)
    for side, other, name in ((head_div, base_div, "base"), (base_div, head_div, "head")):
        for unit in side.units:  # a class or configuration one side did not run is compared on neither
            if unit not in other.units:
                side.no_verdict.setdefault(unit, f"not run on the {name}")
    comp = compare(head_div, base_div)
    cross_check(comp, req, base, python)
    return {"command": req.command, "seed": req.params["seed"], "examples": req.params["examples"],
            "head": {"where": "this environment", "report": head_doc},
            "base": {"how": base.how, "where": base.where, "report": base_doc},
            "added": comp.added, "fixed": comp.fixed, "both": comp.both, "no_verdict": comp.no_verdict,
            "exit": comp.exit_code}


def _check_same(req: Request, doc: dict[str, Any], where: str) -> None:
    """A saved report must have run what the head runs: same seed, examples,
    steps, and the same classes (conformance) or target (fuzz)."""
    for name in ("seed", "examples", "steps"):
        if doc.get(name, req.params[name]) != req.params[name]:
            raise BaselineError(f"--baseline: {where} ran --{name} {doc.get(name)}, this run --{name} "
                                f"{req.params[name]}: both sides must search the same examples")
    if req.command == "conformance":
        want = req.params.get("classes")
        have = [c.get("cache_class") for c in doc.get("classes", [])]
        if want and sorted(want) != sorted(have):
            raise BaselineError(f"--baseline: {where} ran the classes {', '.join(map(str, have))}; this run "
                                f"{', '.join(want)}")


def cross_check(comp: Comparison, req: Request, base: Baseline, python: str) -> None:
    """Replay fixed keys' base traces on the head (this process) and, when
    the base can run, added keys' head traces on the base; same key: both."""
    fixed = [e for e in comp.fixed if e.get("trace") and Path(e["trace"]).exists()]
    if fixed:
        got = replay_side({"items": [{"trace": e["trace"], "target": _target_of(e, req), "waived": e["waived"]}
                                     for e in fixed]})["replays"]
        move_to_both(comp, "fixed", _same_keys(fixed, got), "the head diverges on the base's trace")
    added = [e for e in comp.added if e.get("trace")]
    if added and base.how != "report":
        request = {"command": "replay", "items": [{"trace": e["trace"], "target": _target_of(e, req),
                                                   "waived": e["waived"]} for e in added]}
        got = run_sides([("base-replay", request, python, base)], req.out)["base-replay"]["replays"]
        move_to_both(comp, "added", _same_keys(added, got), "the base diverges on the head's trace")


def _target_of(entry: dict[str, Any], req: Request) -> str:
    return entry.get("target") or req.params.get("target") or "mlx-lm"


def _same_keys(entries: list[dict[str, Any]], replays: list[dict[str, Any]]) -> set[str]:
    return {e["key"] for e, r in zip(entries, replays)
            if r.get("status") == "diverged" and key_of(e["unit"], r["what"], r["op"]) == e["key"]}


# -- printing ------------------------------------------------------------------------------
def print_comparison(doc: dict[str, Any], console: Any) -> None:
    """The comparison as a table (added, fixed, in both) and a verdict line."""
    from rich.markup import escape
    from rich.table import Table

    from kvspec.fuzz.commands.reports import print_table

    head, base = doc["head"]["report"], doc["base"]["report"]
    versions = ""
    if doc["command"] == "conformance":
        versions = f"; mlx-lm {head.get('mlx_lm')} (head), {base.get('mlx_lm')} (base)"
    unit = "class" if doc["command"] == "conformance" else "configuration"
    bound = (f"rounds of {doc['examples']} examples" if doc["command"] == "conformance"
             else f"{doc['examples']} examples a configuration")
    table = Table(title=f"kvspec {doc['command']} --baseline: head (this environment) against "
                        f"{escape(Baseline(doc['base']['how'], doc['base']['where']).describe())}; seed {doc['seed']}, "
                        f"{bound}{escape(versions)}")
    for col in ("", unit, "check", "op class", "example"):
        table.add_column(col, overflow="fold")
    for label, style, entries in (("added", "bold red", doc["added"]), ("fixed", "green", doc["fixed"]),
                                  ("in both", "dim", doc["both"])):
        for e in entries:
            example = e.get("summary") or e.get("what") or ""
            if e.get("note"):
                example += f" ({e['note']})"
            table.add_row(f"[{style}]{label}[/]", escape(e["unit"]), escape(e["check"]), escape(e["op_class"]),
                          escape(str(example)))
    print_table(console, table)
    for e in doc["added"]:
        if e.get("trace"):
            console.print(f"added {e['key']}:\n  replay it: {e.get('replay') or ''}\n  see it: "
                          f"{render_line(e)}", soft_wrap=True, markup=False)
    for e in doc["fixed"]:
        if e.get("trace"):
            console.print(f"fixed {e['key']}: the base's trace {e['trace']} (replay it in the base's environment: "
                          f"{e.get('replay') or ''})", soft_wrap=True, markup=False)
    for unit_name, why in doc["no_verdict"].items():
        console.print(f"no verdict, not compared: {unit_name}: {why}", soft_wrap=True, markup=False)
    n = len(doc["added"])
    if n:
        console.print(f"[bold red]the head adds {n} divergence{'s' * (n != 1)}[/] (exit 1); fixes "
                      f"{len(doc['fixed'])}; {len(doc['both'])} in both")
    else:
        console.print(f"the head adds no divergence; fixes {len(doc['fixed'])}; {len(doc['both'])} in both"
                      + (" (exit 2: not every class or configuration has a verdict)" if doc["exit"] == 2 else ""))


def render_line(entry: dict[str, Any]) -> str:
    """The ``kvspec render`` command that draws an added divergence."""
    import shlex

    trace = str(entry["trace"])
    parts = ["kvspec", "render", trace, "--html", "-o", str(Path(trace).with_suffix(".html"))]
    if entry.get("target") and entry["target"] != "impl":
        parts += ["--target", entry["target"]]
    for w in entry.get("waived") or []:
        parts += ["--waive", w]
    return " ".join(shlex.quote(p) for p in parts)


# -- the commands --------------------------------------------------------------------------
def junit_cases(doc: dict[str, Any]) -> list[Any]:
    """One JUnit test case per key: added fails, in both is skipped
    (present on the base too), fixed passes."""
    from kvspec.fuzz.commands.reports import Case

    suite = f"kvspec {doc['command']} --baseline"
    cases = [Case(suite, e["key"], False, 0.0, f"added by the head: {e.get('summary') or e.get('what')}"
                  + (f"\nreplay it: {e['replay']}" if e.get("replay") else "")) for e in doc["added"]]
    cases += [Case(suite, e["key"], True, 0.0, skipped="present on the base too") for e in doc["both"]]
    cases += [Case(suite, e["key"], True, 0.0, "fixed by the head") for e in doc["fixed"]]
    if not cases:
        cases.append(Case(suite, "no divergence on either side", True))
    return cases


def sarif_findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The head's added divergences as SARIF findings (faults as errors,
    contract differences as warnings)."""
    return [{"trace": e["trace"], "target": e.get("target"), "index": e.get("index"), "op": e.get("op") or {},
             "what": e.get("what"), "spec": e.get("summary"), "impl": e.get("summary"), "replay": e.get("replay"),
             "level": "warning" if e.get("category") == "contract difference" else "error"}
            for e in doc["added"] if e.get("trace")]


def run_baseline(args: Any, command: str, params: dict[str, Any], console: Any, usage_error: Any,
                 version: str) -> int:
    """``kvspec <command> --baseline``: parse, compare, print or --json,
    write --sarif / --junit-xml; the exit status (module docstring)."""
    from rich.markup import escape

    from kvspec.fuzz.commands.reports import write_junit, write_sarif

    as_json = bool(getattr(args, "json", False))
    try:
        base = parse_baseline(args.baseline)
        req = Request(command, params, Path(args.out or tempfile.mkdtemp(prefix="kvspec-review-")))
        doc = compare_sides(req, base)
    except BaselineError as exc:
        return usage_error(console, str(exc), as_json)
    except SideFailure as exc:
        line = f"no verdict: {exc} (a tool failure, not a divergence)"
        if as_json:
            print(json.dumps({"command": command, "error": line, "exit": 2}))
        else:
            console.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
        return 2
    if getattr(args, "sarif", None):
        write_sarif(args.sarif, sarif_findings(doc), version)
    if getattr(args, "junit_xml", None):
        write_junit(args.junit_xml, junit_cases(doc))
    if as_json:
        print(json.dumps(doc))
    else:
        print_comparison(doc, console)
    return int(doc["exit"])


def _given(args: Any, flag: str) -> bool:
    """Was ``flag`` on the command line (not only its default)?"""
    argv = getattr(args, "argv", None) or []
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def fuzz_by_examples(args: Any, target: Any, console: Any, usage_error: Any, version: str) -> int:
    """``kvspec fuzz --examples N`` (a run bounded by examples, its report
    a baseline for later) and ``kvspec fuzz --target T --baseline BASE``."""
    clash = [flag for flag, on in (("--budget", _given(args, "--budget")),
                                   ("--shrink-budget", args.shrink_budget is not None),
                                   ("-j", (args.jobs or 1) > 1), ("--bug", bool(args.bug)), ("--db", bool(args.db)))
             if on]
    if clash:
        return usage_error(console, f"{clash[0]}: not with --examples or --baseline (a run bounded by examples, "
                                    "shrunk by replays, without an example database)", args.json)
    from kvspec.fuzz.campaign import default_engine

    params = {"target": target.label, "kind": args.kind, "mode": args.mode, "inplace": args.inplace,
              "examples": args.examples, "steps": None, "seed": args.seed, "default_seed": FUZZ_SEED,
              "engine": args.engine or default_engine()}
    if args.baseline:
        return run_baseline(args, "fuzz", params, console, usage_error, version)
    from rich.markup import escape

    from kvspec.fuzz.commands.reports import Case, write_junit, write_sarif

    try:
        doc = fuzz_examples(target.label, args.kind, args.mode, args.inplace,
                            args.seed if args.seed is not None else FUZZ_SEED, args.examples, 40,
                            params["engine"], args.out)
    except BaselineError as exc:
        return usage_error(console, str(exc), args.json)
    if args.junit_xml:
        write_junit(args.junit_xml, [Case("fuzz", r["config"], r["result"] == "ok", 0.0,
                                          r.get("failure", r["result"])) for r in doc["runs"]])
    if args.sarif:
        write_sarif(args.sarif, [{"trace": r["trace"], "target": target.label, **r["divergence"],
                                  "spec": r.get("failure"), "impl": r.get("failure"), "replay": r.get("replay")}
                                 for r in doc["runs"] if "divergence" in r and "trace" in r], version)
    if args.json:
        print(json.dumps(doc))
        return int(doc["exit"])
    for r in doc["runs"]:
        style = "" if r["result"] == "ok" else "[bold red]"
        console.print(f"{escape(r['config'])}: {r['examples']} examples, {r['steps']} ops: "
                      f"{style}{escape(r['result'])}{'[/]' if style else ''}")
        if "failure" in r:
            console.print(f"  {escape(r['failure'])}")
        if "trace" in r:
            console.print(f"  minimal trace written to {escape(r['trace'])}\n  replay it: {escape(r['replay'])}",
                          soft_wrap=True)
    return int(doc["exit"])
