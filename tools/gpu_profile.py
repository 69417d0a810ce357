"""A short profile of the decode hot paths, for a GPU session (tools/gpu_session.sh).

For each path (dense in place, ring warm-up, paged beside a fork, Int8,
Turbo4, rollback k=1, each beside mlx-lm's cache where it has one; Int8 and
Turbo4 also with their window's elementwise chains run op by op, ``op by
op``, beside the fused default of impl.fused) and each context: one decoder
step over ``--layers`` layers, the write then attention per layer, split
into

* ``host_ms``: building the step (every layer's ``update_and_fetch`` and
  attention call, nothing evaluated): Python work and any host reads or
  synchronisations the cache makes;
* ``step_ms``: the whole step, evaluated;
* ``moved``: how many layers' first buffer changed memory across the step
  (read outside the timing): a private buffer copied whole where MLX could
  have reused it shows as every layer moving at every step.

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
    from impl.dense import data_pointer

    return 0 if a is None else data_pointer(a)


def paths(context: int) -> dict[str, Any]:
    from mlx_lm.models import cache as mc

    from impl.dense import KVCache
    from impl.paged import PagedKVCache
    from impl.rotating import RotatingKVCache
    from impl.turbo import TurboKVCache

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
    from impl import fused

    fused.ENABLED = not name.endswith("op by op")  # the window's elementwise chains fused on CUDA, or not
    try:
        return _profile(name, make, context, layers, rounds)
    finally:
        fused.ENABLED = True


def _profile(name: str, make: Any, context: int, layers: int, rounds: int) -> dict[str, float]:
    from fuzz.commands.bench_decoder import DIM, KV_HEADS, Q_HEADS, _attend

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from fuzz.device import select
    from impl.write import backend, inplace_mechanism

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
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
