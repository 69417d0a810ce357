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

Times are medians of repeated runs on this machine; only ratios mean
anything across machines. Each row ends with the ratio of its last context
to its first (32k / 1k by default): about 1 for an O(1) operation, about the
context ratio for an O(context) one.
"""

from __future__ import annotations

import json
import statistics
import time

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from fuzz.bugs.dense import PhysicalTrimFp16
from impl.dense import KVCache

HEADS, DIM = 8, 128


def _rows(n: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
    mx.eval(k)
    return k, k


def _decode_seconds(context: int, inplace: bool, steps: int = 64) -> float:
    cache = KVCache("fp16", step=256, inplace=inplace)
    cache.update_and_fetch(*_rows(context))
    one = _rows(1)
    held = cache.update_and_fetch(*one)
    mx.eval(*held)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        # The previous step's window stays alive until this step is
        # evaluated, as in a pipelined decoder. (Rebinding `held` before the
        # eval would let MLX donate the buffer and hide the copy's cost.)
        out = cache.update_and_fetch(*one)
        mx.eval(*out)
        times.append(time.perf_counter() - start)
        held = out
    del held
    return statistics.median(times)


def _rollback_seconds(cls: type[KVCache], context: int, k: int = 4, rounds: int = 64) -> float:
    cache = cls("fp16", step=256, inplace=True)
    cache.update_and_fetch(*_rows(context))
    block = _rows(k)
    times = []
    for _ in range(rounds):
        mx.eval(*cache.update_and_fetch(*block))  # the draft step's keys and values, consumed
        start = time.perf_counter()
        cache.trim(k)
        # the verified block's keys and values, consumed; nothing holds the
        # window afterwards (a rollback loop keeps no view of the old step)
        mx.eval(*cache.update_and_fetch(*block))
        times.append(time.perf_counter() - start)
        cache.trim(k)
    return statistics.median(times)


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
    cols = []
    for n in contexts:
        err.print(f"bench: context {n} ...", markup=False)
        inplace, copy = _decode_seconds(n, True), _decode_seconds(n, False)
        logical, physical = _rollback_seconds(KVCache, n), _rollback_seconds(PhysicalTrimFp16, n)
        cols.append({"context": n, "decode_inplace_ms": inplace * 1e3, "decode_copy_ms": copy * 1e3,
                     "rollback_logical_ms": logical * 1e3, "rollback_physical_ms": physical * 1e3})
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
