"""``kvspec bench --harness``: where a fuzz campaign's time goes, per campaign.

A campaign's throughput (ops per second, what ``kvspec verify``'s table
prints) is the sum of several costs per op: the fuzz engine drawing the op,
the spec running it, the implementation running it, the step's one MLX
evaluation reading every window back, and the lockstep's comparisons
(windows, refusals, results, sharing, the save/load round trip, masks). This
benchmark runs a campaign of ``kvspec verify`` (its fixed seed, ``batches``
batches), records every example it ran, and replays the very same ops
through ever less of the harness, each pass in this one process:

* ``campaign``: ops over search seconds of the batches after the first (the
  first pays for imports and cold caches; ``campaign_all`` counts it too, as
  ``verify``'s table does);
* ``lockstep``: the ops replayed through the whole lockstep (every check),
  with no fuzz engine;
* ``reads``: the spec and the implementation run each op, then one MLX
  evaluation reads the op's result and every window (the live one, every
  snapshot's and handle's, the held one) and nothing is compared: the least
  a check of every window after every op can cost;
* ``spec_impl``: the spec and the implementation run each op and the op's
  result is evaluated (as a decoder evaluates what it gets back): no
  checks, no reads of the holders;
* ``impl``: the implementation's share of ``spec_impl`` alone.

Each figure is ops over wall seconds (``time.perf_counter``); the two
floors run :data:`FLOOR_REPEATS` times each, alternated, and keep their
fastest run. They are one machine's figures, read as ratios within one
run; the ``reads`` column is a floor for a campaign that keeps every check
on this machine (only a faster implementation, or fewer reads, lowers it),
and the gap from ``lockstep`` to ``campaign`` is the engine's share. The
make-mask calls an append makes in the lockstep (its checks) are left out
of the three floors. A campaign that fails, or a floor that cannot run an
op the spec ran, stops the bench with RuntimeError: no figure is given for
ops that were not run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvspec.fuzz import kinds
from kvspec.fuzz import rows as rowgen
from kvspec.fuzz.campaign import Campaign
from kvspec.fuzz.replay import make_lockstep
from kvspec.spec.errors import KVCacheError

#: the columns, in the order the table prints them (``*_ops_s`` keys)
PASSES = ("campaign_all", "campaign", "lockstep", "reads", "spec_impl", "impl")
#: the table's header of each column (``config`` and ``ops`` first)
HEADERS = ("campaign", "ops", "all batches", "warm", "no engine", "reads only", "spec+impl", "impl")
#: runs of each floor pass (alternated, the fastest kept)
FLOOR_REPEATS = 3

Run = tuple[dict[str, Any], list[dict[str, Any]]]


@dataclass
class HarnessRow:
    """One campaign's figures: ``ops`` replayed in every pass (the same ops
    the campaign ran), ``*_ops_s`` ops per wall second of each pass
    (:data:`PASSES`), ``spec_ops_s`` the spec's share of ``spec_impl``; a
    rate is None where nothing was measured (no ops, or no time: ``campaign``
    with one batch), printed "-", never a figure."""

    config: str
    examples: int
    ops: int
    campaign_all_ops_s: float | None
    campaign_ops_s: float | None
    lockstep_ops_s: float | None
    reads_ops_s: float | None
    spec_impl_ops_s: float | None
    impl_ops_s: float | None
    spec_ops_s: float | None


def configs() -> list[tuple[str, str, bool]]:
    """Every registry campaign (``kvspec verify``'s), as (kind, mode, inplace)."""
    return [(k.kind, mode, inplace) for k in kinds.KINDS.values() for mode, inplace in k.campaigns]


def label(kind: str, mode: str, inplace: bool) -> str:
    return f"{kind}/{mode}/{'inplace' if inplace else 'copy'}"


def record_campaign(
    kind: str, mode: str, inplace: bool, batches: int, seed: int
) -> tuple[Any, list[Run], float | None]:
    """Run ``batches`` seeded batches of the campaign and keep every example
    it ran as (cache fields, ops). Returns the report, the runs and the ops
    per search second of the batches after the first (None when they ran no
    op or took no time: one batch measures no warm rate). Raises RuntimeError
    if the campaign fails (a divergence is a bug to replay, not a figure)."""
    # a failure stops the bench: it is not shrunk
    run = Campaign(kind, mode, inplace, seed, shrink=False)
    runs: list[Run] = []
    machine = run.machine
    own = machine.teardown

    def teardown(self: Any) -> None:
        own(self)
        cfg, ops = type(self).last_run
        runs.append((dict(cfg), list(ops)))

    machine.teardown = teardown  # type: ignore[method-assign]
    first_ops = first_seconds = 0.0
    for b in range(batches):
        rep = run.batch()
        if rep.failure is not None:
            raise RuntimeError(
                f"{label(kind, mode, inplace)}: the campaign failed "
                f"({str(rep.failure.error).splitlines()[0]}); replay its kvtrace with kvspec fuzz"
            )
        if b == 0:
            first_ops, first_seconds = rep.stats.get("ops", 0), rep.seconds
    warm_ops = rep.stats.get("ops", 0) - first_ops
    warm_seconds = rep.seconds - first_seconds
    return rep, runs, warm_ops / warm_seconds if warm_seconds > 0 and warm_ops > 0 else None


def replay_lockstep(runs: list[Run]) -> tuple[int, float]:
    """The runs' ops through the whole lockstep (every check): (ops, seconds).
    A divergence here is raised: the campaign passed the same ops."""
    ops = 0
    seconds = 0.0
    for cfg, program in runs:
        lock = make_lockstep(dict(cfg))
        start = time.perf_counter()
        for i, op in enumerate(program):
            lock.step(i, op)
        seconds += time.perf_counter() - start
        ops += len(program)
    return ops, seconds


def replay_floor(runs: list[Run], reads: bool) -> tuple[int, float, float]:
    """The runs' ops on the spec and the implementation alone, each op's
    result evaluated (``reads``: with every window, in the same one
    evaluation, after every op run, a refused one too), nothing compared and
    no masks made: (ops, spec seconds, implementation seconds). ``expect``
    ops are counted and not run. Raises RuntimeError when the implementation
    raises on an op the spec ran."""
    ops = 0
    spec_s = impl_s = 0.0
    for cfg, program in runs:
        lock = make_lockstep(dict(cfg))
        # the lockstep's mask checks (before an append, as a model calls
        # make_mask), not the op: dense, ring and list kinds make them in
        # before_append, the pool in check_mask
        lock.before_append = lock.check_mask = lambda op: None
        for op in program:
            ops += 1
            if op["op"] == "expect":
                continue
            start = time.perf_counter()
            try:
                _, world = lock.spec_apply(op)
            except KVCacheError:
                world = None
            mid = time.perf_counter()
            try:
                lazy = rowgen.mx_arrays(lock.impl_apply(op))
            except Exception as exc:
                if world is not None:
                    raise RuntimeError(
                        f"replay without checks: op {op} raised {exc!r} on the implementation, "
                        "which the spec ran: the floor would not measure the op"
                    ) from exc
                lazy = []  # refused by both: the checks still read every window after it
            if reads:
                lazy += rowgen.mx_arrays(lock.impl_views())
            if lazy:
                mx.eval(*lazy)
            end = time.perf_counter()
            if world is not None:
                lock.prev_world, lock.world = lock.world, world
            spec_s += mid - start
            impl_s += end - mid
    return ops, spec_s, impl_s


def measure(
    kind: str, mode: str, inplace: bool, batches: int = 3, seed: int | None = None
) -> HarnessRow:
    """Every pass for one campaign (module docstring). ``seed``: verify's
    fixed seed when None."""
    if seed is None:
        from kvspec.fuzz.commands.verify import CAMPAIGN_SEED

        seed = CAMPAIGN_SEED
    rep, runs, warm = record_campaign(kind, mode, inplace, batches, seed)
    ops, lock_s = replay_lockstep(runs)
    campaign_ops = rep.stats.get("ops", 0)
    if ops != campaign_ops:
        raise RuntimeError(
            f"{label(kind, mode, inplace)}: replayed {ops} ops of the campaign's {campaign_ops}"
        )
    # the floors are cheap and noisy: FLOOR_REPEATS of each, alternated
    # (neither always runs second), the fastest kept
    floors: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(FLOOR_REPEATS):
        for reads in (False, True):
            n, s_s, i_s = replay_floor(runs, reads=reads)
            if n != ops:
                raise RuntimeError(
                    f"{label(kind, mode, inplace)}: a floor replayed {n} ops of {ops}"
                )
            floors[reads].append((s_s, i_s))
    spec_s, impl_s = min(floors[False], key=sum)
    rspec_s, rimpl_s = min(floors[True], key=sum)

    def rate(seconds: float) -> float | None:
        return ops / seconds if seconds > 0 and ops > 0 else None

    return HarnessRow(
        label(kind, mode, inplace),
        rep.examples,
        ops,
        rate(rep.seconds),
        warm,
        rate(lock_s),
        rate(rspec_s + rimpl_s),
        rate(spec_s + impl_s),
        rate(impl_s),
        rate(spec_s),
    )


def _rate_cell(rate: float | None) -> str:
    """A table cell of ops/s: the figure, or "-" where none was measured."""
    return "-" if rate is None else f"{rate:,.0f}"


def run(only: list[str] | None = None, batches: int = 3, as_json: bool = False) -> int:
    """Measure every registry campaign (``only``: those whose label holds
    one of the words, e.g. ``layers`` or ``dense/int8``); print a table, or
    with ``as_json`` one object (docs/json.md). Returns 0, or 2 when
    ``only`` selects no campaign."""
    err = Console(stderr=True, highlight=False, emoji=False)
    every = [label(*c) for c in configs()]
    if only is not None and not all(word.strip() for word in only):
        err.print(
            f"error: --only {' '.join(map(repr, only))}: a word must not be empty (it would match "
            f"every campaign); campaigns: {', '.join(every)}",
            markup=False,
        )
        return 2
    chosen = [c for c in configs() if not only or any(word in label(*c) for word in only)]
    if not chosen:
        from kvspec.fuzz.commands.reports import suggest

        words = sorted({part for name in every for part in name.split("/")}) + every
        hints = "".join(f" {w!r}{suggest(w, words)}" for w in (only or []) if suggest(w, words))
        err.print(
            f"error: --only {' '.join(only or [])}: no campaign's label holds any of the words"
            f"{';' + hints if hints else ''}; campaigns: {', '.join(every)}",
            markup=False,
        )
        return 2
    rows = []
    for c in chosen:
        err.print(
            f"bench --harness: {label(*c)} ({batches} batches, then the replays) ...", markup=False
        )
        rows.append(measure(*c, batches=batches))
    if as_json:
        print(
            json.dumps(
                {"harness": [asdict(r) for r in rows], "batches": batches, "passes": list(PASSES)}
            )
        )
        return 0
    table = Table(
        title=f"kvspec bench --harness: ops/s per process, {batches} batches of verify's seed, "
        "the same ops replayed"
    )
    cells = [
        [r.config, f"{r.ops:,}", *(_rate_cell(getattr(r, p + "_ops_s")) for p in PASSES)]
        for r in rows
    ]
    for i, name in enumerate(HEADERS):
        # a column is never narrower than its longest cell or header word:
        # headers wrap at their spaces, no figure or label is cut
        width = max([len(row[i]) for row in cells] + [len(word) for word in name.split()])
        table.add_column(name, justify="left" if i == 0 else "right", min_width=width)
    for row in cells:
        table.add_row(*(escape(cell) for cell in row))
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        # into a file or a pipe the table is as wide as its one-line rows
        # (rich would otherwise fit 80 columns and cut the last cells)
        from rich.measure import Measurement

        console.width = max(
            80, Measurement.get(console, console.options.update(width=100_000), table).maximum
        )
    console.print(table)
    console.print(
        "all batches, warm: the campaign's ops over its search seconds (warm: after the first batch). The "
        "other columns replay the same ops: no engine, through every check without the fuzz engine; reads "
        "only, the spec and the implementation with one evaluation reading every window and nothing "
        "compared (the least a check of every window after every op costs); spec+impl, only the op's "
        "result evaluated; impl, the implementation's share of that.",
        soft_wrap=True,
    )
    return 0
