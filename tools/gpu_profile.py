"""A short profile of the decode hot paths, for a GPU session (tools/gpu_session.sh).

For each path (dense in place, ring warm-up, paged beside a fork, Int8,
Turbo4, rollback k=1, each beside mlx-lm's cache where it has one; Int8 and
Turbo4 also with their window's elementwise chains run op by op, ``op by
op``, beside the fused default of kvspec.impl.fused) and each context: one decoder
step over ``--layers`` layers, the write then attention per layer, split
into

* ``host_ms``: building the step (every layer's ``update_and_fetch`` and
  attention call, nothing evaluated): Python work and any host reads or
  synchronisations the cache makes;
* ``step_ms``: the whole step, evaluated;
* ``moved``: how many layers' first buffer changed memory across the step
  (read outside the timing): a private buffer copied whole where MLX could
  have reused it shows as every layer moving at every step.

Then, per context, the MLX primitives those paths are made of, alone
(:func:`primitives`: a copy, the paged gather, a Turbo-like table lookup, the
Hadamard transform), with the bandwidth each reaches: where a growing row
comes from a slow primitive rather than from the cache.

Medians over ``--rounds`` steps after a warm-up. One JSON object on stdout
(and ``--out``). Diagnostics, not the record: ``kvspec bench`` is.

Usage: python3 tools/gpu_profile.py [--contexts 1024 32768] [--layers 28]
[--rounds 10] [--device gpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx


def first_buffer(c: Any) -> mx.array | None:
    """The array whose memory says whether a write reused it."""
    store = getattr(c, "store", None)
    if isinstance(store, dict) and store:
        return next(iter(store.values()))
    if isinstance(getattr(c, "keys", None), mx.array):
        return c.keys
    if hasattr(c, "pool"):
        return c.pool.keys
    if hasattr(c, "buffers") and c.buffers is not None:
        return c.buffers.keys
    return None


def pointer(a: mx.array | None) -> int:
    from kvspec.impl.dense import data_pointer

    return 0 if a is None else data_pointer(a)


def paths(context: int) -> dict[str, Any]:
    from mlx_lm.models import cache as mc

    from kvspec.impl.dense import KVCache
    from kvspec.impl.paged import PagedKVCache
    from kvspec.impl.rotating import RotatingKVCache
    from kvspec.impl.turbo import TurboKVCache

    return {
        "dense in place: ours": lambda: KVCache("fp16", step=256, inplace=True),
        "dense: mlx-lm KVCache": mc.KVCache,
        "ring warm-up: ours": lambda: RotatingKVCache(max_size=2 * context + 4096, keep=4, step=256, inplace=True),
        "ring warm-up: mlx-lm RotatingKVCache": lambda: mc.RotatingKVCache(max_size=2 * context + 4096, keep=4),
        "paged beside a fork: ours": lambda: PagedKVCache(block_size=16, inplace=True),
        "int8: ours": lambda: KVCache("int8", step=256),
        "int8: ours, op by op": lambda: KVCache("int8", step=256),
        "turbo4: ours": lambda: TurboKVCache("turbo4", step=256),
        "turbo4: ours, op by op": lambda: TurboKVCache("turbo4", step=256),
        "rollback k=1: ours": lambda: KVCache("fp16", step=256, inplace=True),
        "rollback k=1: mlx-lm KVCache": mc.KVCache,
    }


def step_op(name: str):
    """What one layer does per step on path ``name``: an append, or (the
    rollback rows) trim 1 then append 1."""
    if name.startswith("rollback"):
        def rollback(c: Any, rows: mx.array) -> Any:
            c.trim(1)
            return c.update_and_fetch(rows, rows)
        return rollback
    return lambda c, rows: c.update_and_fetch(rows, rows)


def profile(name: str, make: Any, context: int, layers: int, rounds: int) -> dict[str, float]:
    from kvspec.impl import fused

    fused.ENABLED = not name.endswith("op by op")  # the window's elementwise chains fused on CUDA, or not
    try:
        return _profile(name, make, context, layers, rounds)
    finally:
        fused.ENABLED = True


def _profile(name: str, make: Any, context: int, layers: int, rounds: int) -> dict[str, float]:
    from kvspec.fuzz.commands.bench_decoder import DIM, KV_HEADS, Q_HEADS, _attend

    dtype = mx.float16
    pre = mx.random.normal((1, KV_HEADS, context, DIM), key=mx.random.key(1)).astype(dtype)
    one = mx.random.normal((1, KV_HEADS, 1, DIM), key=mx.random.key(3)).astype(dtype)
    q = mx.random.normal((1, Q_HEADS, 1, DIM), key=mx.random.key(2)).astype(dtype)
    mx.eval(pre, one, q)
    caches, forks = [], []
    for _ in range(layers):
        c = make()
        mx.eval(c.update_and_fetch(pre, pre))
        if hasattr(c, "fork"):
            forks.append(c.fork("held"))  # the fork shares every full block
        caches.append(c)
    del pre
    host, step, moved = [], [], 0
    op = step_op(name)
    for r in range(rounds + 3):
        before = [pointer(first_buffer(c)) for c in caches[:4]]
        t0 = time.perf_counter()
        outs = [_attend(q, c, op(c, one)) for c in caches]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        del outs
        after = [pointer(first_buffer(c)) for c in caches[:4]]
        if r >= 3:
            host.append((t1 - t0) * 1e3)
            step.append((t2 - t0) * 1e3)
            moved += sum(a != b for a, b in zip(before, after))
    return {"host_ms": statistics.median(host), "step_ms": statistics.median(step),
            "moved_of_4_layers_per_step": moved / rounds}


def primitives(context: int, layers: int, rounds: int) -> dict[str, dict[str, float]]:
    """The MLX operations the growing rows are made of, alone, over
    ``layers`` windows of ``context`` rows (fp16 ``[1, 8, T, 128]``): a
    contiguous copy (the bandwidth floor), the paged gather of whole blocks
    (``take`` on axis 0 of a ``[blocks, 16, 8, 128]`` slab by a table of two
    runs of consecutive blocks, then the transpose attention reads; and the
    same rows as slices of the runs joined by one concatenate), a per-byte table lookup like Turbo4's
    window decode (``take`` of a ``[256, 2]`` table by uint8 codes), and the
    Hadamard transform. Median ms, and GB/s over the bytes each must move."""
    from kvspec.fuzz.commands.bench_decoder import DIM, KV_HEADS

    T, bs = context, 16
    dtype = mx.float16
    win = [mx.random.normal((1, KV_HEADS, T, DIM), key=mx.random.key(i)).astype(dtype) for i in range(layers)]
    nb = (T + bs - 1) // bs
    slabs = [mx.random.normal((nb + 8, bs, KV_HEADS, DIM), key=mx.random.key(100 + i)).astype(dtype)
             for i in range(layers)]
    # a table of two runs of consecutive blocks, as a fork's sequence has (the
    # shared prefix, then blocks of its own elsewhere in the slab)
    half = nb // 2
    table_ids = list(range(half)) + list(range(half + 8, nb + 8))
    blocks = mx.array(table_ids, dtype=mx.int32)
    codes = [mx.random.randint(0, 256, (1, KV_HEADS, T, DIM // 2), key=mx.random.key(200 + i)).astype(mx.uint8)
             for i in range(layers)]
    table = mx.random.normal((256, 2)).astype(dtype)
    mx.eval(win, slabs, codes, table, blocks)
    window_bytes = KV_HEADS * T * DIM * 2
    ops = {
        "copy (floor)": (lambda i: mx.contiguous(win[i] * 1), 2 * window_bytes),
        "paged gather of blocks": (lambda i: mx.contiguous(
            mx.take(slabs[i], blocks, axis=0).reshape(-1, KV_HEADS, DIM)[:T].transpose(1, 0, 2)[None]),
            2 * window_bytes),
        "paged gather by runs (slices, one concatenate)": (lambda i: mx.contiguous(
            mx.concatenate([slabs[i][:half], slabs[i][half + 8:nb + 8]], axis=0)
            .reshape(-1, KV_HEADS, DIM)[:T].transpose(1, 0, 2)[None]), 2 * window_bytes),
        "table lookup by uint8 code": (lambda i: mx.take(table, codes[i].astype(mx.int32), axis=0),
                                       window_bytes // 4 + window_bytes),
        "hadamard transform": (lambda i: mx.hadamard_transform(win[i]), 2 * window_bytes),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (op, nbytes) in ops.items():
        times = []
        for r in range(rounds + 3):
            t0 = time.perf_counter()
            mx.eval([op(i) for i in range(layers)])
            if r >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        out[name] = {"ms": ms, "GB_per_s": layers * nbytes / (ms * 1e-3) / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from kvspec.fuzz.device import select
    from kvspec.impl.write import backend, inplace_mechanism

    select(args.device)
    doc: dict[str, Any] = {"backend": backend(), "inplace_mechanism": inplace_mechanism(), "mlx": mx.__version__,
                           "layers": args.layers, "rounds": args.rounds, "paths": {}}
    for name in paths(args.contexts[0]):
        for n in args.contexts:
            try:
                got = profile(name, paths(n)[name], n, args.layers, args.rounds)
            except Exception as exc:  # noqa: BLE001 - one path failing must not lose the others
                got = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            doc["paths"].setdefault(name, {})[str(n)] = got
            print(f"profile: {name} at {n}: {got}", file=sys.stderr, flush=True)
            mx.clear_cache()
    for n in args.contexts:
        try:
            doc.setdefault("primitives", {})[str(n)] = got = primitives(n, args.layers, args.rounds)
        except Exception as exc:  # noqa: BLE001 - the paths above are kept
            got = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        print(f"profile: primitives at {n}: {got}", file=sys.stderr, flush=True)
        mx.clear_cache()
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
