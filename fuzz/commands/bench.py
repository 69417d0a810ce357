"""``kvspec bench``: the cost contract, measured as ratios in one run.

Two questions, each at growing context lengths:

* decode step: in-place write (ownership rule allows it) vs the copying write
  (``KV_INPLACE_WRITE=0``) while the previous step's window is held, as a
  pipelined decoder holds it;
* speculative rollback: trim k rows then append k rows, with the logical
  trim (ours) vs a physical re-slice (the ``physical_trim_fp16`` injected
  bug, i.e. the pre-#1209 behaviour).

Times are medians of repeated runs on this machine; only the ratios within a
row mean anything across machines.
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


def _rollback_seconds(cls: type[KVCache], context: int, k: int = 4, rounds: int = 32) -> float:
    cache = cls("fp16", step=256, inplace=True)
    cache.update_and_fetch(*_rows(context))
    block = _rows(k)
    times = []
    for _ in range(rounds):
        cache.update_and_fetch(*block)
        mx.eval(cache.buffers.keys)  # type: ignore[union-attr]
        start = time.perf_counter()
        cache.trim(k)
        out = cache.update_and_fetch(*block)
        mx.eval(*out)
        times.append(time.perf_counter() - start)
        cache.trim(k)
    return statistics.median(times)


def run(contexts: list[int], as_json: bool = False) -> int:
    rows = []
    for n in contexts:
        inplace, copy = _decode_seconds(n, True), _decode_seconds(n, False)
        logical, physical = _rollback_seconds(KVCache, n), _rollback_seconds(PhysicalTrimFp16, n)
        rows.append({"context": n, "decode_inplace_ms": inplace * 1e3, "decode_copy_ms": copy * 1e3,
                     "decode_speedup": copy / inplace, "rollback_logical_ms": logical * 1e3,
                     "rollback_physical_ms": physical * 1e3, "rollback_speedup": physical / logical})
    if as_json:
        print(json.dumps({"heads": HEADS, "head_dim": DIM, "rows": rows}))
        return 0
    table = Table(title=f"kvspec bench (fp16, {HEADS} kv heads x {DIM}, medians)")
    for col in ("context", "decode in place ms", "decode copy ms", "copy / in place",
                "rollback logical ms", "rollback physical ms", "physical / logical"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["context"]), f"{r['decode_inplace_ms']:.3f}", f"{r['decode_copy_ms']:.3f}",
                      f"{r['decode_speedup']:.1f}x", f"{r['rollback_logical_ms']:.3f}",
                      f"{r['rollback_physical_ms']:.3f}", f"{r['rollback_speedup']:.1f}x")
    Console(highlight=False).print(table)
    return 0
