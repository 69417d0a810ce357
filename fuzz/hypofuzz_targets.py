"""The state machines as pytest tests, for HypoFuzz (``kvspec campaign``).

HypoFuzz collects Hypothesis tests with pytest and fuzzes them on every
core, adaptively, for as long as it runs. This module is the file it
collects: one ``RuleBasedStateMachine.TestCase`` per registry campaign
(fuzz/kinds.py: every kind, mode and in-place setting that ``kvspec
verify`` runs), each the machine ``kvspec.fuzz.campaign.machine_for`` builds, so
every check of the lockstep harness runs unchanged. It does not import
HypoFuzz (an AGPL tool kept an optional extra): HypoFuzz imports it.

The ``kvspec campaign`` command sets, in the environment of the HypoFuzz
process it starts:

* ``KVSPEC_CAMPAIGN_OUT``: the folder a failure's kvtrace is written to
  (``campaign-<kind>-<mode>-<inplace|copy>[-<bug>]-<KVSPEC_CAMPAIGN_RUN>.json``;
  shrinking rewrites it while the trace gets shorter, so what is there at
  the end is the shortest failing run seen);
* ``KVSPEC_CAMPAIGN_RUN``: this run's name in those files (the command's
  start time), so a run never mistakes an earlier run's file for its own;
* ``KVSPEC_CAMPAIGN_DB``: the example database (``kvspec.fuzz.campaign.
  open_database``: a folder, ``redis://HOST:PORT``), which HypoFuzz's
  workers and dashboard share through Hypothesis's default settings;
* ``KVSPEC_CAMPAIGN_BUG``: an injected bug of the catalog (optional);
* ``KVSPEC_CAMPAIGN_ONLY``: ``kind``, ``kind/mode`` or ``kind/mode/inplace``
  prefixes, comma-separated (optional; default every campaign).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings

from kvspec.fuzz import kinds
from kvspec.fuzz.campaign import failure_trace, machine_for, open_database
from kvspec.fuzz.machine import KVMachine
from kvspec.fuzz.trace import write

#: ops per example, as in ``kvspec fuzz``
STEPS = 40


def configs(only: str | None) -> list[tuple[str, str, bool]]:
    """The registry's campaigns whose ``kind/mode/inplace|copy`` label
    starts with one of the comma-separated prefixes of ``only`` (None or
    empty: all)."""
    prefixes = [p.strip() for p in (only or "").split(",") if p.strip()]
    out = []
    for entry in kinds.KINDS.values():
        for mode, inplace in entry.campaigns:
            label = f"{entry.kind}/{mode}/{'inplace' if inplace else 'copy'}"
            if not prefixes or any(label == p or label.startswith(p.rstrip("/") + "/") for p in prefixes):
                out.append((entry.kind, mode, inplace))
    return out


def trace_ops(trace: Any) -> int:
    return sum(1 for op in trace.ops if op["op"] != "expect")


def recording(machine: type[KVMachine], out: Path, stem: str) -> type[KVMachine]:
    """``machine`` writing each failing run's kvtrace to ``out/stem.json``
    when it is shorter than the one there (HypoFuzz shrinks a failure in
    the worker that found it; the minimal run is replayed last)."""

    class Recording(machine):  # type: ignore[valid-type,misc]
        def do(self, op: dict[str, Any]) -> None:
            try:
                super().do(op)
            except Exception as exc:
                self.failed_with = exc
                raise

        def teardown(self) -> None:
            super().teardown()
            exc = getattr(self, "failed_with", None)
            if exc is None:
                return
            trace = failure_trace(type(self), exc)
            if trace is None:
                return
            path = out / f"{stem}.json"
            try:
                from kvspec.fuzz.trace import load

                if trace_ops(load(path)) <= trace_ops(trace):
                    return
            except Exception:  # noqa: BLE001, S110 - absent, or half-written by another worker: replace it
                pass
            tmp = out / f".{stem}.{os.getpid()}.tmp"
            write(trace, tmp)
            tmp.replace(path)  # atomic: workers of one target race here

    Recording.__name__ = Recording.__qualname__ = machine.__name__
    return Recording


def build() -> dict[str, Any]:
    """The TestCase classes, by test name (``Test_<kind>_<mode>_<inplace|copy>``)."""
    from kvspec.fuzz.bugs import by_name

    db = open_database(os.environ.get("KVSPEC_CAMPAIGN_DB") or "none")
    # every health check off (MLX's first calls are slow, the machines draw
    # much) but nested_given, which HypoFuzz refuses to fuzz under
    quiet = [h for h in HealthCheck if h is not HealthCheck.nested_given]
    # derandomize=False stated: Hypothesis loads its "ci" profile (derandomize=True,
    # database=None) when the environment has CI set, a new profile inherits the
    # loaded one, and HypoFuzz collects no test that sets derandomize
    settings.register_profile("kvspec-campaign", database=db, deadline=None, stateful_step_count=STEPS,
                              suppress_health_check=quiet, print_blob=False, derandomize=False)
    settings.load_profile("kvspec-campaign")
    bug = os.environ.get("KVSPEC_CAMPAIGN_BUG") or None
    entry = by_name(bug) if bug else None
    out = Path(os.environ.get("KVSPEC_CAMPAIGN_OUT") or "fuzz-failures")
    out.mkdir(parents=True, exist_ok=True)
    tests: dict[str, Any] = {}
    # a bug runs in its own configuration (as `kvspec fuzz --bug` does)
    chosen = configs(os.environ.get("KVSPEC_CAMPAIGN_ONLY")) if entry is None else \
        [(entry.kind, entry.modes[0], entry.inplace)]
    for kind, mode, inplace in chosen:
        label = f"{kind}_{mode}_{'inplace' if inplace else 'copy'}"
        machine = machine_for(kind, mode, inplace, entry.factories if entry else None)
        stem = (f"campaign-{kind}-{mode}-{'inplace' if inplace else 'copy'}" + (f"-{bug}" if bug else "")
                + f"-{os.environ.get('KVSPEC_CAMPAIGN_RUN') or 'run'}")
        test = recording(machine, out, stem).TestCase
        # Hypothesis's TestCase suppresses every health check; ours the profile's
        test.settings = settings()
        test.__name__ = test.__qualname__ = f"Test_{label}"
        tests[test.__name__] = test
    return tests


if os.environ.get("KVSPEC_CAMPAIGN_OUT"):  # only in the process `kvspec campaign` starts
    globals().update(build())
