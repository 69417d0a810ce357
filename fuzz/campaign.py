"""Fuzz campaigns: run a state machine under fixed or random seeds, report
what was reached, and turn a failure into a minimal kvtrace file."""

from __future__ import annotations

import gc
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hyp_seed
from hypothesis.errors import Flaky
from hypothesis.stateful import get_state_machine_test

from kvspec.fuzz import interrupt, kinds
from kvspec.fuzz.failures import HarnessFailure
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.machine import EDGE_RULES, KVMachine
from kvspec.fuzz.program import get_program_test, simplest_config
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.targets import BUILTIN, resolve
from kvspec.fuzz.trace import Trace, TraceFormatError, cache_defaults, parse, write
from kvspec.spec.errors import KVCacheError

#: how a batch runs a machine's rules: Hypothesis's stateful engine (a
#: choice per rule step) or kvspec.fuzz.program's (one byte string per example,
#: decoded into the same rules)
ENGINES = ("stateful", "program")


def check_engine(engine: str) -> str:
    """``engine`` if it is one of :data:`ENGINES`, else ValueError naming it."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: not one of {', '.join(ENGINES)}")
    return engine


def default_engine() -> str:
    """The engine of a batch that names none: ``$KVSPEC_ENGINE``, else
    ``program``."""
    return os.environ.get("KVSPEC_ENGINE", "program").strip() or "program"


def machine_for(kind: str, mode: str = "fp16", inplace: bool = True, factories: dict[str, Any] | None = None,
                check_inplace: bool = True, fixed: dict[str, Any] | None = None,
                target: Any = None) -> type[KVMachine]:
    """A fresh state-machine class for one configuration: the machine of the
    registry entry that runs ``kind`` in ``mode`` (fuzz/kinds.py), bound to ``mode``, the in-place
    switch, the implementation ``factories`` (injected bugs) and pinned cache
    fields ``fixed``. Class attributes, so runs in one process never share
    statistics. ``target`` (a name or ``kvspec.fuzz.targets.Target``; None:
    ``impl``) picks the implementation and the ops it runs. Raises
    UnknownKindError for a kind the registry does not have."""
    base: type[KVMachine] = kinds.get(kind, mode).machine_class()
    if target is not None:
        target = resolve(target)
        # only the built-in third-party targets (mlx-lm's caches) keep the
        # plain machine their recorded findings were drawn with; a user's
        # class or an exec: adapter gets every shape and dtype (batch > 1,
        # K and V head dims that differ, bfloat16 and float32)
        if not target.is_impl and target.name in BUILTIN and base.plain is not None \
                and not getattr(target, "full_shapes", False):
            base = base.plain
        base = target.machine_base(kind, mode, base)
        if not target.is_impl:
            # the rare-edge rules bias our own campaigns toward the
            # catalog's edges; one step of them is several ops the shrinker
            # cannot split, so a third party's trace would not be minimal
            base = type(base.__name__, (base,), {rule: None for rule in EDGE_RULES if hasattr(base, rule)})
        if target.is_impl and not target.excluded:
            target = None  # the plain machine: no per-op target check
    name = f"{base.__name__}_{mode}_{'inplace' if inplace else 'copy'}"
    # the example database's key (Hypothesis hashes it into the machine's
    # digest): the configuration and the classes under test, so a failure
    # saved from an injected bug is replayed only on that bug
    bugs = _describe_factories(factories or {})
    key = (f"kvspec {kind}/{mode}/{'inplace' if inplace else 'copy'} target={getattr(target, 'name', 'impl')} "
           f"factories={bugs} check_inplace={check_inplace} fixed={sorted((fixed or {}).items())}")
    return type(name, (base,), {
        "_hypothesis_internal_add_digest": key.encode(),
        "mode": mode, "inplace": inplace, "factories": factories, "check_inplace": check_inplace,
        "fixed": dict(fixed or {}), "target": target, "covered": {},
        "stats": {}, "runs": 0, "last_run": None, "first_failure": None, "first_error": None,
        "first_failure_run": None,
        "make_lockstep": staticmethod(make_lockstep),
    })


def _describe_factories(factories: Any) -> str:
    """The classes (or nested maps of classes) of ``factories`` by name:
    part of the example database's key."""
    if isinstance(factories, dict):
        return "{" + ",".join(f"{k}={_describe_factories(v)}" for k, v in sorted(factories.items(), key=str)) + "}"
    name = getattr(factories, "__qualname__", None)
    return f"{getattr(factories, '__module__', '?')}.{name}" if name else repr(type(factories))


def open_database(where: str | None) -> Any:
    """The Hypothesis example database ``where`` names: None or ``none``:
    none; ``redis://HOST:PORT[/DB]``: a Redis server shared by many
    machines (``hypothesis[redis]``); anything else: a local folder
    (``DirectoryBasedExampleDatabase``, safe for many processes of one
    machine). Raises ValueError naming what is wrong."""
    if where is None or where == "none":
        return None
    if where.startswith("redis://"):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as exc:
            raise ValueError(f"--db {where}: needs the redis client (pip install 'hypothesis[redis]'): {exc}") from None
        client = redis.Redis.from_url(where, socket_connect_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise ValueError(f"--db {where}: cannot reach the Redis server: {exc}") from None
        return RedisExampleDatabase(client, key_prefix=b"kvspec-examples")
    from hypothesis.database import DirectoryBasedExampleDatabase

    folder = Path(where)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--db {where}: exists and is not a folder")
    return DirectoryBasedExampleDatabase(str(folder))


def fuzz_settings(max_examples: int, steps: int, derandomize: bool = False, shrink: bool = True,
                  database: Any = None) -> settings:
    """Settings for one batch: no deadline (MLX's first call compiles
    kernels); by default no example database (runs are reproducible from
    the seed alone). With ``database`` (:func:`open_database`) its saved
    failures of this configuration are replayed first (Hypothesis's reuse
    phase) and every new failure is saved there. ``shrink=False`` reports
    the first failing example as found."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=database,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        phases=([Phase.reuse] if database is not None else []) + phases,
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
    #: shrinking was stopped by its limit (:func:`shrink_limit`)
    shrink_cut: bool = False
    #: the failure was seen once and Hypothesis could not replay it: both
    #: answers (``error`` is then a ``kvspec.fuzz.machine.FlakyVerdict``, a tool
    #: failure, and ``trace`` the run that failed)
    flaky: str | None = None


#: the start of the warning Hypothesis prints when its own shrink limit
#: stops it (:func:`shrink_limit` reports the cut itself)
_SLOW_SHRINK_WARNING = "WARNING: Hypothesis has spent more than"


@dataclass
class ShrinkLimit:
    """What :func:`shrink_limit` saw: ``cut`` is True once the limit
    stopped a shrink."""

    seconds: float | None
    cut: bool = False


@contextmanager
def shrink_limit(seconds: float | None) -> Iterator[ShrinkLimit]:
    """Within the block, Hypothesis stops shrinking a failure after
    ``seconds`` (None: its own limit, five minutes) and reports the smallest
    failing example found so far, which the machine replays last as usual.
    A slow implementation (an ``exec:`` adapter that takes milliseconds an
    op) would otherwise shrink for minutes after a budget of seconds.
    Hypothesis has no public setting for this: its engine reads the module
    constant ``MAX_SHRINKING_SECONDS`` when shrinking starts, and prints a
    warning when the limit stops it, which is dropped here and recorded as
    :attr:`ShrinkLimit.cut` (the caller reports it)."""
    seen = ShrinkLimit(seconds)
    if seconds is None:
        yield seen
        return
    from hypothesis.internal.conjecture import engine
    from hypothesis.reporting import current_reporter, with_reporter

    if not isinstance(getattr(engine, "MAX_SHRINKING_SECONDS", None), (int, float)):
        raise TypeError("this Hypothesis has no MAX_SHRINKING_SECONDS: the shrink limit cannot be applied")
    outer = current_reporter()

    def reporter(value: object) -> None:
        if str(value).startswith(_SLOW_SHRINK_WARNING):
            seen.cut = True
        else:
            outer(value)

    old = engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = max(float(seconds), 0.0)  # type: ignore[assignment]
    try:
        with with_reporter(reporter):
            yield seen
    finally:
        engine.MAX_SHRINKING_SECONDS = old


def run_machine(machine: type[KVMachine], seed: int, max_examples: int = 50, steps: int = 40,
                shrink: bool = True, database: Any = None, shrink_seconds: float | None = None,
                engine: str | None = None, ops_shrink: bool = False) -> RunResult:
    """Run one seeded batch of ``max_examples`` examples (shrinking on
    failure unless ``shrink=False``, for at most ``shrink_seconds`` when
    given: :func:`shrink_limit`; not given: Hypothesis's own limit, or
    :data:`PROGRAM_SHRINK_SECONDS` under the program engine; then
    :func:`reduce_run`; ``database``: see :func:`fuzz_settings`) on
    ``engine`` (:data:`ENGINES`; None: :func:`default_engine`).
    ``ops_shrink=True``: Hypothesis keeps the first failing example as
    found and the op-level :func:`shrink_run` alone shrinks it (bounded by
    replays, not seconds: the trace does not depend on the machine's
    load; ``shrink_seconds``, when given, caps it)."""
    machine.runs, machine.stats, machine.last_run, machine.first_failure = 0, {}, None, None
    machine.first_error, machine.first_failure_run = None, None
    run_settings = fuzz_settings(max_examples, steps, shrink=shrink and not ops_shrink, database=database)
    engine = check_engine(engine or default_engine())
    own_limit = shrink_seconds is None
    if engine == "program" and own_limit and not ops_shrink:
        # Hypothesis shrinks a program's bytes slowly (its passes minimise
        # one byte at a time; a catalog entry took 5-20 s, and up to its
        # five-minute limit in a loaded test worker), while reduce_run
        # below deletes the ops themselves: Hypothesis gets a short limit
        # of its own and the reduction its full time
        shrink_seconds = PROGRAM_SHRINK_SECONDS
    if engine == "program":
        test = get_program_test(machine, run_settings, steps)
    else:
        test = get_state_machine_test(machine, settings=run_settings)
    if database is None:
        test = hyp_seed(seed)(test)
    else:
        # hypothesis.seed() also turns the example database off; keep both
        # (the seed attribute is what seed() sets)
        test._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
    start = time.perf_counter()
    error: BaseException | None = None
    limit = ShrinkLimit(shrink_seconds)
    # what was alive before the batch (modules, the rows and masks kept
    # per token) is never garbage, so the collector skips it during the
    # batch: a full collection scanned every such object (0.2 s each on a
    # loaded 2-core machine; collection took a tenth of a batch's CPU);
    # everything made during the batch is collected as before, and it all
    # goes back to the collector afterwards (unless the process had frozen
    # objects of its own: then its freezing is left as it is)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with shrink_limit(shrink_seconds) as limit:
            test()
    except Exception as exc:  # noqa: BLE001 - Divergence, or an assertion from an invariant
        error = exc
    finally:
        if freeze:
            gc.unfreeze()
    executed = machine.stats.get("ops", 0)
    flaky = None
    if isinstance(error, Flaky) and isinstance(machine.first_error, (Divergence, AssertionError)) \
            and machine.first_failure_run is not None:
        # Hypothesis saw an op diverge and could not make that example
        # diverge again (FlakyFailure), or drew it differently when it
        # tried (FlakyStrategyDefinition): one run gave two answers, a
        # tool failure naming both (kvspec.fuzz.machine.FlakyVerdict), never a
        # finding; the run that diverged is the trace, unshrunk
        error = machine.flaky_verdict(error)
        flaky = str(error)
        machine.last_run = machine.first_failure_run
    if shrink and isinstance(error, Divergence) and machine.last_run is not None:
        # within the caller's shrink budget when it gave one (what
        # Hypothesis's shrinking, from the first failure on, left of it);
        # with none, to the end: the pass is bounded by the run's length,
        # so the trace does not depend on the machine's load
        left: float | None = None
        if not own_limit and shrink_seconds is not None:
            found = machine.first_failure[1] if machine.first_failure else start
            left = max(shrink_seconds - (time.perf_counter() - found), 0.0)
        error = shrink_run(machine, error, left) if ops_shrink else reduce_run(machine, error, left)
    seconds = time.perf_counter() - start  # the reduction is shrinking: counted with it
    # a trace only of a divergence: a target that cannot run an op, or the
    # harness's own crash, is no verdict (exit 2), and its run is no
    # "minimal trace" of anything (kvspec.fuzz.replay.failure_status); a flaky
    # verdict keeps the run that diverged, the evidence of its first answer
    trace = failure_trace(machine, error) if isinstance(error, (Divergence, AssertionError)) or flaky else None
    caught = machine.first_failure
    return RunResult(error is not None, seconds, machine.runs, executed,
                     caught[0] if caught else None, caught[1] - start if caught else None,
                     dict(machine.stats), error, trace, shrink_cut=limit.cut and not own_limit, flaky=flaky)


#: seconds Hypothesis may shrink a program engine's failure for when the
#: caller sets no shrink budget (:func:`run_machine`)
PROGRAM_SHRINK_SECONDS = 8.0


def _signature(d: Divergence) -> tuple[str, str]:
    """What makes two divergences the same failure for :func:`reduce_run`:
    the op and the check (its text without numbers: a shorter run shows the
    same fault at other offsets)."""
    return d.op.get("op", ""), re.sub(r"-?\d+", "#", d.what)


class _Replays:
    """Replays of candidate runs of a machine's failure on the same
    implementation (its ``factories``, ``check_inplace`` and target), each
    asking whether the run still diverges with the failure's
    :func:`_signature`; a candidate seen before is answered from memory.
    ``count`` is the replays run (what bounds a shrink, not seconds)."""

    def __init__(self, machine: type[KVMachine], error: Divergence) -> None:
        self.machine, self.want = machine, _signature(error)
        self.kind, self.mode = machine.kind, machine.mode
        self.seen: dict[str, Divergence | None] = {}
        self.count = 0

    def cache(self, cfg: dict[str, Any]) -> dict[str, Any]:
        entry = kinds.get(cfg.get("kind", self.kind), cfg.get("mode", self.mode))
        return {**cache_defaults(entry.kind, cfg.get("mode")), **cfg}

    def diverges(self, cfg: dict[str, Any], candidate: list[dict[str, Any]], valid: bool = False) -> Divergence | None:
        """The candidate's divergence if it fails the same way, else None.
        ``valid=True``: a candidate that is no valid kvtrace up to that op
        (kvspec.fuzz.trace's schema and rules: a batch of 0, an append of no rows)
        is refused too."""
        key = json.dumps([cfg, candidate], sort_keys=True, default=repr)
        if key in self.seen:
            return self.seen[key]
        found: Divergence | None = None
        self.count += 1
        machine = self.machine
        try:
            lock = make_lockstep(self.cache(cfg), machine.factories, machine.check_inplace,
                                 machine.target if machine.target is not None else "impl")
            for i, op in enumerate(candidate):
                lock.step(i, op)
        except Divergence as d:
            found = d if _signature(d) == self.want else None
        except Exception:  # noqa: BLE001 - a candidate the harness cannot run is not the same failure
            found = None
        if found is not None and valid:
            # checked only for a candidate that fails the same way (the
            # schema's check costs as much as a short replay)
            try:
                parse({"kvtrace": 1, "cache": cfg, "ops": candidate[: found.index + 1]})
            except TraceFormatError:
                found = None
        self.seen[key] = found
        return found


def _delete_ops(replays: _Replays, cfg: dict[str, Any], ops: list[dict[str, Any]], best: Divergence,
                deadline: float, valid: bool = False) -> tuple[list[dict[str, Any]], Divergence]:
    """Delete chunks of ``ops`` (half the run down to single ops, from the
    end, never the diverging op itself) while the run still fails the same
    way (``valid``: and is a valid kvtrace); then single ops again until no
    one of them can go (the result is one-minimal: deleting any one op
    loses the failure), unless the deadline stops it."""
    size = max(len(ops) // 2, 1)
    while time.perf_counter() < deadline:
        deleted = False
        at = len(ops) - 1 - size
        while at >= 0 and time.perf_counter() < deadline:
            candidate = ops[:at] + ops[at + size:]
            found = replays.diverges(cfg, candidate, valid)
            if found is not None:
                ops, best, deleted = candidate[: found.index + 1], found, True
                at = min(at, len(ops) - 1) - size
            else:
                at -= size
        if size > 1:
            size //= 2
        elif not deleted:
            break
    return ops, best


def reduce_run(machine: type[KVMachine], error: Divergence, seconds: float | None) -> Divergence:
    """Delete ops from the machine's failing run (``last_run``, cut at the
    diverging op) while a replay on the same implementation (its
    ``factories``, ``check_inplace`` and target) still diverges with the
    same :func:`_signature`: chunks of half the run down to single ops,
    from the end, then single ops again until none can go, for at most
    ``seconds`` (None: to the end; bounded by the run's length, the same
    result on an idle or a loaded machine). The engines shrink the
    *choices* that make a run (Hypothesis's rule steps, or kvspec.fuzz.program's
    bytes), where a composite rule step is several ops it cannot split;
    this pass shrinks the ops themselves. ``last_run`` becomes the reduced
    run; returns the reduced run's divergence (``error`` when nothing was
    deleted)."""
    cfg, ops = machine.last_run  # type: ignore[misc]
    ops = [dict(op) for op in ops[: error.index + 1]]
    deadline = float("inf") if seconds is None else time.perf_counter() + seconds
    kept, best = _delete_ops(_Replays(machine, error), cfg, ops, error, deadline)
    if best is not error:
        machine.last_run = (cfg, kept)
    return best


#: cache fields the op-level shrink never changes: what the configuration
#: under test is (a machine's ``fixed`` fields are kept too)
_CONFIG_KEPT = frozenset({"kind", "mode", "inplace"})
#: op fields it never changes: names (a snapshot's, a handle's) tie ops together
_OP_KEPT = frozenset({"op", "name"})
#: replays one :func:`shrink_run` may spend at most (a bound on a
#: pathological run; a catalog entry's takes tens to a few hundred)
SHRINK_REPLAYS = 5000


def _simpler(value: Any) -> list[Any]:
    """Values simpler than ``value``, simplest first: an integer nearer 0
    (0, 1, half, one less, in magnitude), False for True, a list with one
    element fewer, a dict with one of its values simpler; none for the rest
    (strings are names and spellings: kept)."""
    if isinstance(value, bool):
        return [False] if value else []
    if isinstance(value, int):
        if value == 0:
            return []
        size = abs(value)
        sign = 1 if value > 0 else -1
        return [sign * v for v in sorted({0, 1, size // 2, size - 1}) if v < size]
    if isinstance(value, list):
        return [value[:i] + value[i + 1:] for i in range(len(value))]
    if isinstance(value, dict):
        return [{**value, key: simpler} for key, v in value.items() if key not in _OP_KEPT
                for simpler in _simpler(v)]
    return []


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Two ops as one, when they are the same op with one integer field
    that is added up (two appends of 1 and 2 rows: one of 3) and every
    other field equal; else None."""
    if a.get("op") != b.get("op") or a.keys() != b.keys():
        return None
    counts = [k for k, v in a.items() if isinstance(v, int) and not isinstance(v, bool)]
    if len(counts) != 1 or any(a[k] != b[k] for k in a if k != counts[0]):
        return None
    return {**a, counts[0]: a[counts[0]] + b[counts[0]]}


def shrink_run(machine: type[KVMachine], error: Divergence, seconds: float | None = None) -> Divergence:
    """The op-level shrink of a failing run, which needs no help from the
    engine's own shrinker: :func:`reduce_run`'s deletions, then, while any
    of them keeps the same failure (:func:`_signature`), two adjacent ops
    merged into one (:func:`_merged`), an op's field made simpler
    (:func:`_simpler`) and a cache field set to its value in the machine's
    simplest configuration (``kvspec.fuzz.program.simplest_config``: every draw
    at its simplest; an integer may stop between the two; a field that has
    none there left out; never ``kind``,
    ``mode``, ``inplace`` or the machine's ``fixed`` fields), each followed
    by the deletions again, until none applies; a candidate that is no
    valid kvtrace (kvspec.fuzz.trace's schema and rules) is refused.
    Every accepted change makes the run simpler (fewer ops, simpler values,
    or cache fields nearer the simplest configuration), so it ends; it is
    bounded by replays
    (:data:`SHRINK_REPLAYS`), not seconds, unless ``seconds`` is given.
    The result is one-minimal under each of these changes: no op can be
    deleted, no two merged, no value made simpler. ``last_run`` becomes the
    shrunk run; returns its divergence."""
    cfg, ops = machine.last_run  # type: ignore[misc]
    cfg, ops = dict(cfg), [dict(op) for op in ops[: error.index + 1]]
    deadline = float("inf") if seconds is None else time.perf_counter() + seconds
    replays = _Replays(machine, error)
    simplest = simplest_config(machine)
    kept = _CONFIG_KEPT | set(machine.fixed)
    best = error

    def live() -> bool:
        return time.perf_counter() < deadline and replays.count < SHRINK_REPLAYS

    def config_candidates(cfg: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for key, value in cfg.items():
            if key in kept:
                continue
            if key not in simplest:
                yield {k: v for k, v in cfg.items() if k != key}
            elif simplest[key] != value:
                yield {**cfg, key: simplest[key]}
                low = simplest[key]
                if isinstance(value, int) and isinstance(low, int) and not isinstance(value, bool) and low < value:
                    # between the simplest value and this one (a block of 3
                    # rows where 1 hides the failure may still fail at 2)
                    yield from ({**cfg, key: v} for v in sorted({(low + value) // 2, value - 1} - {low}))

    def op_candidates(ops: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        for i in range(len(ops) - 1, 0, -1):
            merged = _merged(ops[i - 1], ops[i])
            if merged is not None:
                yield ops[: i - 1] + [merged] + ops[i + 1:]
        for i in range(len(ops) - 1, -1, -1):
            for simpler in _simpler(ops[i]):
                yield ops[:i] + [simpler] + ops[i + 1:]

    changed = True
    while changed and live():
        ops, best = _delete_ops(replays, cfg, ops, best, deadline, valid=True)
        changed = False
        for candidate in op_candidates(ops):
            if not live():
                break
            found = replays.diverges(cfg, candidate, valid=True)
            if found is not None:
                ops, best, changed = candidate[: found.index + 1], found, True
                break
        if changed:
            continue
        for new_cfg in config_candidates(cfg):
            if not live():
                break
            found = replays.diverges(new_cfg, ops, valid=True)
            if found is not None:
                cfg, ops, best, changed = new_cfg, ops[: found.index + 1], found, True
                break
    if best is not error:
        machine.last_run = (cfg, ops)
    return best


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
    """One configuration's campaign. ``seconds`` is the search (what a
    budget buys); ``shrink_seconds`` the time spent shrinking a failure to
    its minimal trace, timed apart (it is not part of the budget)."""

    config: str
    seconds: float
    examples: int
    steps: int
    stats: dict[str, int]
    failure: RunResult | None = None
    shrink_seconds: float = 0.0
    #: True when the shrink limit stopped shrinking: the trace is the
    #: smallest failing run found by then, not a minimal one
    shrink_cut: bool = False
    batches: int = 0
    #: examples run until the first failing one, over every batch (None: no failure)
    examples_to_catch: int | None = None


class Campaign:
    """A campaign run one seeded batch at a time (:meth:`batch`), so that
    several can share a budget round-robin (:func:`interleaved`). Batch
    ``k`` runs seed ``seed + k``: a configuration's batches are the same
    whether it runs alone or beside others. ``shrink_budget`` caps the
    seconds spent shrinking its failure (None: Hypothesis's own limit);
    ``shrink=False`` keeps the first failing example as it was found."""

    def __init__(self, kind: str, mode: str, inplace: bool, seed: int, factories: dict[str, Any] | None = None,
                 batch: int = 25, steps: int = 40, target: Any = None, progress: Any = None, database: Any = None,
                 shrink_budget: float | None = None, shrink: bool = True, engine: str | None = None):
        self.machine = machine_for(kind, mode, inplace, factories, target=target)
        self.engine = check_engine(engine or default_engine())
        label = f"{kind}/{mode}/{'inplace' if inplace else 'copy'}"
        if target is not None and getattr(target, "name", target) != "impl":
            label = f"{getattr(target, 'name', target)}:{label}"
        self.report = CampaignReport(label, 0.0, 0, 0, {})
        self.seed, self.batch_size, self.steps, self.progress = seed, batch, steps, progress
        self.database = database
        self.shrink_budget = shrink_budget
        self.shrink = shrink
        # a pinned sweep only without a database (a saved example must
        # replay under the fields it was found with) and on our
        # implementation (a target may lack the field)
        entry = kinds.get(kind, mode)
        self.sweep = entry.sweep if database is None and self.machine.target is None and \
            (target is None or getattr(resolve(target), "is_impl", False)) else None
        self.fixed = dict(self.machine.fixed)

    @property
    def failed(self) -> bool:
        return self.report.failure is not None

    def batch(self, budget: float | None = None) -> CampaignReport:
        """Run the next batch and add it to :attr:`report`. A failing batch
        is shrunk; its search part (to the first failing example) counts in
        ``seconds``, the rest in ``shrink_seconds``."""
        total = self.report
        progress = self.progress

        def found(examples: int) -> None:
            if progress is not None:
                progress(f"failure found after {total.examples + examples} examples, {total.seconds + time.perf_counter() - start:.0f} s; "
                         "shrinking it to a minimal trace (timed apart from the budget)")

        self.machine.on_failure = staticmethod(found) if progress is not None else None
        start = time.perf_counter()
        before = total.examples
        left = None if self.shrink_budget is None else max(self.shrink_budget - total.shrink_seconds, 0.0)
        size = self.batch_size
        if self.sweep is not None:
            name, values = self.sweep
            self.machine.fixed = {**self.fixed, name: values[total.batches % len(values)]}
            size = max(1, self.batch_size // len(values))
        result = run_machine(self.machine, self.seed + total.batches, max_examples=size, steps=self.steps,
                             shrink=self.shrink, database=self.database, shrink_seconds=left, engine=self.engine)
        total.batches += 1
        total.examples += result.examples
        total.steps += result.steps
        for key, v in result.stats.items():
            total.stats[key] = total.stats.get(key, 0) + v
        search = result.seconds
        if result.failed:
            total.failure = result
            total.examples_to_catch = before + (result.examples_to_catch or result.examples)
            if result.seconds_to_catch is not None:
                search = min(result.seconds, result.seconds_to_catch)
            total.shrink_seconds += result.seconds - search
            total.shrink_cut = result.shrink_cut
        total.seconds += search
        if progress is not None:
            of = "" if budget is None else f" of {budget:.0f}"
            shrink = f" (+{total.shrink_seconds:.0f} s shrinking)" if total.shrink_seconds >= 0.5 else ""
            if total.shrink_cut:
                shrink += f"; shrinking stopped at its limit of {self.shrink_budget:g} s (the trace is not minimal)"
            progress(f"{total.examples} examples, {total.steps} ops, {total.seconds:.0f} s{of}{shrink}")
        return total


def campaign(kind: str, mode: str, inplace: bool, budget: float, seed: int, factories: dict[str, Any] | None = None,
             batch: int = 25, steps: int = 40, target: Any = None,
             progress: Any = None, reach: tuple[str, ...] = (), reach_budget: float = 0.0,
             shrink: bool = True, fit: bool = False) -> CampaignReport:
    """Run seeded batches until ``budget`` seconds of search are spent or
    one fails; at least one batch, so a campaign never checks nothing.
    Shrinking a failure is timed apart (``shrink_seconds``). ``target``
    (name or ``kvspec.fuzz.targets.Target``; None: ``impl``) picks the
    implementation under test; non-impl configs are labelled with it.
    ``progress(text)`` is called after every batch and when a failure is
    found. ``reach``: events (``stats`` labels) the campaign must reach;
    while one is missing it goes on past ``budget``, up to ``reach_budget``
    seconds in all (a slower device runs fewer examples in the same
    seconds: the H200 ran 10-20 in a verify campaign's 8 s). ``shrink=False``:
    a failure is reported as first found (a caller that needs only the
    verdict, such as a test run per mutant, skips the shrinking).
    ``fit=True``: the batch that would run past ``budget`` is cut to the
    examples that fit in the seconds left (at the seconds per example of
    the batches before it; at least one), so the search stops at its
    budget instead of running a whole batch past it; not while a ``reach``
    event is missing (the search then goes on in whole batches)."""
    run = Campaign(kind, mode, inplace, seed, factories, batch, steps, target, progress, shrink=shrink)

    def missing() -> bool:
        return any(not run.report.stats.get(label) for label in reach)

    per_batch = len(run.sweep[1]) if run.sweep is not None else 1  # a sweep runs batch // values examples
    while run.report.batches == 0 or (not run.failed and (run.report.seconds < budget or (
            missing() and run.report.seconds < reach_budget))):
        if fit and run.report.examples and not missing():
            each = run.report.seconds / run.report.examples
            need = -(-max(budget - run.report.seconds, 0.0) // each) if each > 0 else batch
            run.batch_size = int(max(per_batch, min(batch, need * per_batch)))
        run.batch(budget)
    return run.report


def interleaved(runs: list[Campaign], budget: float, progress: Any = None) -> list[CampaignReport]:
    """Share ``budget`` seconds of search among ``runs`` round-robin, one
    batch of each in turn, each stopping at its slice (``budget / len(runs)``)
    or its first failure: every configuration runs within the first seconds,
    whatever its place in the list (a bug of the last one is not left for
    the end of the budget). ``progress(campaign)`` is called before each
    batch."""
    share = budget / max(len(runs), 1)
    while True:
        live = [r for r in runs if r.report.batches == 0 or (not r.failed and r.report.seconds < share)]
        if not live:
            return [r.report for r in runs]
        for r in live:
            interrupt.check()
            if progress is not None:
                progress(r)
            r.batch(share)


class FoundInWorker(Exception):
    """A failure found in a pool worker, carried back as its text (the
    harness's own exceptions are not all picklable)."""


def run_share(runs: list[tuple[str, str, bool, int]], budget: float, bug: str | None = None,
              target: str | None = None, database: str | None = None,
              shrink_budget: float | None = None, engine: str | None = None) -> list[CampaignReport]:
    """A process-pool worker of ``kvspec fuzz -j``: the campaigns ``runs``
    (``(kind, mode, inplace, seed)``) interleaved over ``budget`` seconds
    of search, on the injected bug ``bug`` (a catalog name) and the target
    ``target`` (a name; None: impl), sharing the example database
    ``database`` (:func:`open_database`) with every other worker, each
    failure shrunk for at most ``shrink_budget`` seconds, on ``engine``
    (:data:`ENGINES`; None: :func:`default_engine`). Failures
    come back as :class:`FoundInWorker` with their trace."""
    from kvspec.fuzz.bugs import by_name
    from kvspec.fuzz.device import select
    from kvspec.fuzz.replay import failure_status

    select(None)  # the parent's device (KVSPEC_DEVICE), in this worker too
    factories = by_name(bug).factories if bug else None
    db = open_database(database)
    camps = [Campaign(k, m, ip, seed, factories, target=target, database=db, shrink_budget=shrink_budget,
                      engine=engine) for k, m, ip, seed in runs]
    reports = interleaved(camps, budget)
    for rep in reports:
        if rep.failure is not None and rep.failure.error is not None:
            carried = FoundInWorker(str(rep.failure.error))
            carried.status = failure_status(rep.failure.error)  # type: ignore[attr-defined]
            rep.failure.error = carried
    return reports


class Catch(NamedTuple):
    """What :func:`catch_bug` found."""

    caught: bool
    seconds: float
    examples: int
    path: Path | None
    #: why the catch does not count (a harness fault, a trace the real
    #: implementation fails), or None
    alarm: str | None
    #: the divergence was seen once and Hypothesis could not replay it
    #: (``RunResult.flaky``, both answers): a tool failure, not a catch
    #: (``alarm`` says so too)
    flaky: str | None = None


def catch_bug(bug, seed: int, max_examples: int, out_dir: Path, fixed: dict | None = None,
              check_inplace: bool = True, stem: str | None = None, shrink: bool = True) -> Catch:
    """Fuzz one injected bug; returns a :class:`Catch`: (caught, seconds,
    examples, trace path, false alarm message or None, flaky note or None).
    ``fixed`` pins cache fields and
    ``check_inplace=False`` leaves only isolation to catch unsafe writes.
    The trace is the first failing run as found, shrunk op by op
    (:func:`shrink_run`, bounded by replays: the same trace on an idle or a
    loaded machine), or with ``shrink=False`` that run as found, up to the
    failing op; either way it is replayed on the real implementation, where
    it must pass."""
    machine = machine_for(bug.kind, bug.modes[0], bug.inplace, bug.factories, check_inplace, fixed)
    result = run_machine(machine, seed, max_examples=max_examples, shrink=shrink, ops_shrink=True)
    if not result.failed:
        return Catch(False, result.seconds, result.examples, None, None)
    if result.examples_to_catch is None and result.error is not None:
        # failed outside a rule (e.g. in an invariant): count the whole run
        result.examples_to_catch, result.seconds_to_catch = result.examples, result.seconds
    if result.error is not None and not isinstance(result.error, (Divergence, AssertionError)):
        # the state machine itself raised (a harness fault, kvspec.fuzz.failures):
        # no check caught the bug, whether or not a trace was kept
        cause = result.error.error if isinstance(result.error, HarnessFailure) else result.error
        what = (str(cause).splitlines() or [""])[0]
        path = None
        if result.trace is not None:
            result.trace.title = f"injected bug {bug.name}: the harness raised {type(cause).__name__}: {what}"[:400]
            path = save_failure(result.trace, out_dir, stem or bug.name)
        alarm = (f"the harness raised {type(cause).__name__}: {what}" + (f" (trace {path})" if path else "")
                 + "; that is not a divergence, so it does not count as catching the bug")
        return Catch(True, result.seconds_to_catch, result.examples_to_catch, path, alarm, result.flaky)
    if result.trace is None:
        return Catch(False, result.seconds, result.examples, None, None)
    first = str(result.error).splitlines()[0] if result.error is not None else ""
    result.trace.title = f"injected bug {bug.name} ({bug.clause}): {bug.description}. Caught at {first}"[:400]
    path = save_failure(result.trace, out_dir, stem or bug.name)
    clean = replay(result.trace)
    alarm = None if clean.ok else clean_replay_failure(path, clean.divergence)
    return Catch(True, result.seconds_to_catch, result.examples_to_catch, path, alarm, result.flaky)


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
