"""Fuzz campaigns: run a state machine under fixed or random seeds, report
what was reached, and turn a failure into a minimal kvtrace file."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hyp_seed
from hypothesis.stateful import get_state_machine_test

from fuzz import kinds
from fuzz.lockstep import Divergence
from fuzz.machine import KVMachine
from fuzz.replay import make_lockstep, replay
from fuzz.targets import resolve
from fuzz.trace import Trace, cache_defaults, write
from spec.errors import KVCacheError


def machine_for(kind: str, mode: str = "fp16", inplace: bool = True, factories: dict[str, Any] | None = None,
                check_inplace: bool = True, fixed: dict[str, Any] | None = None,
                target: Any = None) -> type[KVMachine]:
    """A fresh state-machine class for one configuration: the machine of the
    registry entry that runs ``kind`` in ``mode`` (fuzz/kinds.py), bound to ``mode``, the in-place
    switch, the implementation ``factories`` (injected bugs) and pinned cache
    fields ``fixed``. Class attributes, so runs in one process never share
    statistics. ``target`` (a name or ``fuzz.targets.Target``; None:
    ``impl``) picks the implementation and the ops it runs. Raises
    UnknownKindError for a kind the registry does not have."""
    base: type[KVMachine] = kinds.get(kind, mode).machine_class()
    if target is not None:
        target = resolve(target)
        if not target.is_impl and base.plain is not None and not getattr(target, "full_shapes", False):
            base = base.plain
        base = target.machine_base(kind, mode, base)
        if target.is_impl and not target.excluded:
            target = None  # the plain machine: no per-op target check
    name = f"{base.__name__}_{mode}_{'inplace' if inplace else 'copy'}"
    return type(name, (base,), {
        "mode": mode, "inplace": inplace, "factories": factories, "check_inplace": check_inplace,
        "fixed": dict(fixed or {}), "target": target, "covered": {},
        "stats": {}, "runs": 0, "last_run": None, "first_failure": None,
        "make_lockstep": staticmethod(make_lockstep),
    })


def fuzz_settings(max_examples: int, steps: int, derandomize: bool = False, shrink: bool = True) -> settings:
    """Settings for one batch: no example database (runs are reproducible from
    the seed alone), no deadline (MLX's first call compiles kernels).
    ``shrink=False`` reports the first failing example as found (shrinking
    costs about ten times the search for a catalog bug)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        # no explicit/reuse phases: no database
        phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
        print_blob=False,
        report_multiple_bugs=False,
    )


@dataclass
class RunResult:
    """One batch: whether it failed, with what, and what it reached."""

    failed: bool
    seconds: float
    examples: int
    steps: int
    #: examples and seconds until the first failing example (before shrinking)
    examples_to_catch: int | None = None
    seconds_to_catch: float | None = None
    stats: dict[str, int] = field(default_factory=dict)
    error: BaseException | None = None
    trace: Trace | None = None


def run_machine(machine: type[KVMachine], seed: int, max_examples: int = 50, steps: int = 40,
                shrink: bool = True) -> RunResult:
    """Run one seeded batch of ``max_examples`` examples (shrinking on
    failure unless ``shrink=False``)."""
    machine.runs, machine.stats, machine.last_run, machine.first_failure = 0, {}, None, None
    test = get_state_machine_test(machine, settings=fuzz_settings(max_examples, steps, shrink=shrink))
    test = hyp_seed(seed)(test)
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        test()
    except Exception as exc:  # noqa: BLE001 - Divergence, or an assertion from an invariant
        error = exc
    seconds = time.perf_counter() - start
    executed = machine.stats.get("ops", 0)
    trace = failure_trace(machine, error) if error is not None else None
    caught = machine.first_failure
    return RunResult(error is not None, seconds, machine.runs, executed,
                     caught[0] if caught else None, caught[1] - start if caught else None,
                     dict(machine.stats), error, trace)


def failure_trace(machine: type[KVMachine], error: BaseException) -> Trace | None:
    """The minimal failing run as a kvtrace, annotated with the spec's
    predictions so another engine can replay it without our spec: the failing
    op carries ``returns``/``inplace``/``capacity``, and ``expect`` ops pin the
    live window and every snapshot and handle after it."""
    if machine.last_run is None:
        return None
    cfg, ops = machine.last_run
    if isinstance(error, Divergence):
        ops = ops[: error.index + 1]
    title = f"{machine.__name__}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    return annotate(Trace(cache={**cfg}, ops=[dict(op) for op in ops], title=title[:300]))


def annotate(trace: Trace) -> Trace:
    """Add the spec's predictions to the last op and ``expect`` ops after it."""
    lock = make_lockstep({**cache_defaults(trace.cache["kind"], trace.cache.get("mode")), **trace.cache})
    last: Any = None
    refused = False
    for op in trace.ops:
        if op["op"] == "expect":
            continue
        try:
            last, lock.world = lock.spec_apply(op)
            refused = False
        except KVCacheError:
            refused = True
    if not trace.ops:
        return trace
    final = trace.ops[-1]
    if refused:
        final["error"] = True
    elif final["op"] != "expect":
        final.update(lock.predictions(final, last))
    trace.ops.extend(lock.expect_ops())
    return trace


def save_failure(trace: Trace, folder: str | Path, stem: str) -> Path:
    return write(trace, Path(folder) / f"{stem}.json")


@dataclass
class CampaignReport:
    config: str
    seconds: float
    examples: int
    steps: int
    stats: dict[str, int]
    failure: RunResult | None = None


def campaign(kind: str, mode: str, inplace: bool, budget: float, seed: int, factories: dict[str, Any] | None = None,
             batch: int = 25, steps: int = 40, target: Any = None,
             progress: Any = None) -> CampaignReport:
    """Run seeded batches until ``budget`` seconds are spent or one fails;
    at least one batch, so a campaign never checks nothing. ``target`` (name
    or ``fuzz.targets.Target``; None: ``impl``) picks the implementation
    under test; non-impl configs are labelled with it. ``progress(text)``
    is called after every batch."""
    machine = machine_for(kind, mode, inplace, factories, target=target)
    label = f"{kind}/{mode}/{'inplace' if inplace else 'copy'}"
    if target is not None and getattr(target, "name", target) != "impl":
        label = f"{getattr(target, 'name', target)}:{label}"
    total = CampaignReport(label, 0.0, 0, 0, {})
    start = time.perf_counter()
    k = 0
    while k == 0 or time.perf_counter() - start < budget:
        result = run_machine(machine, seed + k, max_examples=batch, steps=steps)
        k += 1
        total.examples += result.examples
        total.steps += result.steps
        for key, v in result.stats.items():
            total.stats[key] = total.stats.get(key, 0) + v
        if progress is not None:
            progress(f"{total.examples} examples, {total.steps} ops, {time.perf_counter() - start:.0f} s of {budget:.0f}")
        if result.failed:
            total.failure = result
            break
    total.seconds = time.perf_counter() - start
    return total


def catch_bug(bug, seed: int, max_examples: int, out_dir: Path, fixed: dict | None = None,
              check_inplace: bool = True, stem: str | None = None, shrink: bool = True):
    """Fuzz one injected bug; returns (caught, seconds, examples, trace path,
    false alarm message or None). ``fixed`` pins cache fields and
    ``check_inplace=False`` leaves only isolation to catch unsafe writes.
    The trace is the shrunk counterexample, or with ``shrink=False`` the
    first failing run up to the failing op; either way it is replayed on
    the real implementation, where it must pass."""
    machine = machine_for(bug.kind, bug.modes[0], bug.inplace, bug.factories, check_inplace, fixed)
    result = run_machine(machine, seed, max_examples=max_examples, shrink=shrink)
    if not result.failed or result.trace is None:
        return False, result.seconds, result.examples, None, None
    if result.examples_to_catch is None and result.error is not None:
        # failed outside a rule (e.g. in an invariant): count the whole run
        result.examples_to_catch, result.seconds_to_catch = result.examples, result.seconds
    first = str(result.error).splitlines()[0] if result.error is not None else ""
    result.trace.title = f"injected bug {bug.name} ({bug.clause}): {bug.description}. Caught at {first}"[:400]
    path = save_failure(result.trace, out_dir, stem or bug.name)
    if result.error is not None and not isinstance(result.error, (Divergence, AssertionError)):
        # the state machine itself raised (a harness fault): no check caught the bug
        alarm = (f"the harness raised {type(result.error).__name__}: {first} (trace {path}); "
                 "that is not a divergence, so it does not count as catching the bug")
        return True, result.seconds_to_catch, result.examples_to_catch, path, alarm
    clean = replay(result.trace)
    alarm = None if clean.ok else clean_replay_failure(path, clean.divergence)
    return True, result.seconds_to_catch, result.examples_to_catch, path, alarm


def clean_replay_failure(path: Any, divergence: Any) -> str:
    """What it means that a trace fails on the production implementation:
    when the implementation disagrees with the spec, the implementation
    diverges (the trace found a real bug, not a false alarm); only a trace
    whose own checks fail on the spec points at the harness."""
    first = str(divergence).splitlines()[0] if divergence is not None else "no divergence recorded"
    detail = "; ".join(line.strip() for line in str(divergence).splitlines()[1:])
    if divergence is not None and divergence.labels[0] == "trace expects" or "fails on the spec" in first:
        return f"trace {path} does not hold on the spec at op {divergence.index} (a harness fault): {first}; {detail}"
    index = divergence.index if divergence is not None else "?"
    return (f"the implementation diverges from the spec at op {index} of trace {path} "
            f"(replay it: kvspec replay {path}): {first}; {detail}")
