"""``kvspec bench``: the cost contract, measured as ratios in one run.

Two questions, each at growing context lengths:

* decode step: in-place write (ownership rule allows it) vs the copying write
  (``KV_INPLACE_WRITE=0``) while the previous step's window is held, as a
  pipelined decoder holds it;
* speculative rollback: trim k rows then append k rows, with the logical
  trim (ours) vs a physical re-slice (the ``physical_trim_fp16`` injected
  bug, i.e. the pre-#1209 behaviour).

Every step consumes the keys *and* the values the cache returns (both are
evaluated, as attention evaluates them): evaluating only the keys lets MLX
keep the values lazy, and from ~16k rows on the logical rollback then pays
for a values copy that a decoder never makes.

Times are medians of repeated runs on this machine, taken round-robin over
the contexts after a warm-up (so drift falls on every context alike); only
ratios mean anything across machines. Each row ends with the ratio of its last context
to its first (32k / 1k by default): about 1 for an O(1) operation, about the
context ratio for an O(context) one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from fuzz.bugs.dense import PhysicalTrimFp16
from impl.dense import KVCache

HEADS, DIM = 8, 128
#: timed rounds per operation and context (medians of these)
ROUNDS = 64


def _rows(n: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
    mx.eval(k)
    return k, k


def _decode_round(context: int, inplace: bool) -> Callable[[], float]:
    """A cache holding ``context`` rows; each call times one decode step."""
    cache = KVCache("fp16", step=256, inplace=inplace)
    cache.update_and_fetch(*_rows(context))
    one = _rows(1)
    held = [cache.update_and_fetch(*one)]
    mx.eval(*held[0])

    def tick() -> float:
        start = time.perf_counter()
        # The previous step's window stays alive until this step is
        # evaluated, as in a pipelined decoder. (Dropping it before the eval
        # would let MLX donate the buffer and hide the copy's cost.)
        out = cache.update_and_fetch(*one)
        mx.eval(*out)
        seconds = time.perf_counter() - start
        held[0] = out
        return seconds

    return tick


def _rollback_round(cls: type[KVCache], context: int, k: int = 4) -> Callable[[], float]:
    """A cache holding ``context`` rows; each call times one speculative
    rollback: trim ``k`` rows, then append the verified ``k`` rows."""
    cache = cls("fp16", step=256, inplace=True)
    cache.update_and_fetch(*_rows(context))
    block = _rows(k)

    def tick() -> float:
        mx.eval(*cache.update_and_fetch(*block))  # the draft step's keys and values, consumed
        start = time.perf_counter()
        cache.trim(k)
        # the verified block's keys and values, consumed; nothing holds the
        # window afterwards (a rollback loop keeps no view of the old step)
        mx.eval(*cache.update_and_fetch(*block))
        seconds = time.perf_counter() - start
        cache.trim(k)
        return seconds

    return tick


def _interleaved(ticks: list[Callable[[], float]], rounds: int, warmup: int = 4) -> list[float]:
    """Median seconds of each tick over ``rounds`` rounds, run round-robin
    (round r starts at a different tick) after ``warmup`` untimed calls of
    each: drift in the machine's load, clocks and caches then falls on
    every context alike instead of on whichever was measured first."""
    for tick in ticks:
        for _ in range(warmup):
            tick()
    times: list[list[float]] = [[] for _ in ticks]
    for r in range(rounds):
        for j in range(len(ticks)):
            i = (r + j) % len(ticks)
            times[i].append(ticks[i]())
    return [statistics.median(t) for t in times]


ROWS = (
    ("decode in place", "decode_inplace_ms"),
    ("decode copying", "decode_copy_ms"),
    ("rollback logical", "rollback_logical_ms"),
    ("rollback physical", "rollback_physical_ms"),
)


def run(contexts: list[int], as_json: bool = False) -> int:
    """Measure at each context length; print one row per operation with a
    column per context and the last/first ratio."""
    err = Console(stderr=True, highlight=False)
    makers = {
        "decode_inplace_ms": lambda n: _decode_round(n, True),
        "decode_copy_ms": lambda n: _decode_round(n, False),
        "rollback_logical_ms": lambda n: _rollback_round(KVCache, n),
        "rollback_physical_ms": lambda n: _rollback_round(PhysicalTrimFp16, n),
    }
    cols: list[dict[str, float]] = [{"context": n} for n in contexts]
    for key, make in makers.items():
        err.print(f"bench: {key.removesuffix('_ms').replace('_', ' ')} at {', '.join(map(str, contexts))} ...",
                  markup=False)
        ticks = [make(n) for n in contexts]
        for col, seconds in zip(cols, _interleaved(ticks, ROUNDS)):
            col[key] = seconds * 1e3
        del ticks
    first, last = cols[0], cols[-1]
    ratios = {key: last[key] / first[key] for _, key in ROWS}
    if as_json:
        print(json.dumps({"heads": HEADS, "head_dim": DIM, "contexts": contexts, "rows": cols,
                          "ratio_last_over_first": ratios}))
        return 0
    table = Table(title=f"kvspec bench (fp16, {HEADS} kv heads x {DIM}, medians in ms)")
    table.add_column("operation", no_wrap=True)
    for n in contexts:
        table.add_column(f"{n}", justify="right", no_wrap=True)
    table.add_column(f"{contexts[-1]} / {contexts[0]}", justify="right", no_wrap=True)
    for label, key in ROWS:
        table.add_row(label, *(f"{c[key]:.3f}" for c in cols), f"{ratios[key]:.1f}x")
    console = Console(highlight=False)
    console.print(table)
    console.print(f"copy / in place at {contexts[-1]}: {last['decode_copy_ms'] / last['decode_inplace_ms']:.1f}x; "
                  f"physical / logical rollback at {contexts[-1]}: "
                  f"{last['rollback_physical_ms'] / last['rollback_logical_ms']:.1f}x")
    return 0
