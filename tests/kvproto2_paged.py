"""A kvproto/2 adapter of the paged kind (docs/kvproto.md) in plain Python:
a block pool with block tables by absolute position, refcounts, a free
list, copy-on-write, forks, releases and front trims, several sequences
on one pool.

The pool is ``kvspec.spec.paged``'s model run as an engine would run its own:
the adapter applies each op to it, reads every window back from the
pool's blocks (``kvspec.spec.paged.gather``: what sits in the slots the table
names, not what should), serializes those rows as the portable rows of
``kvspec.spec.rows`` in the trace's dtype (``windows: bytes``), and answers the
masks an append asks for with the dense rule over the sequence's visible
rows. It takes the identity of the first row from ``first``, as any
adapter must.

``--fault NAME`` plants one fault (:data:`FAULTS`); none: the correct
control. ``--no-inplace`` leaves ``inplace`` out of the observables (an
engine whose write path cannot be seen: kvspec then compares lengths,
starts and windows, and checks the pool invariants on what it reports)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvspec.spec import paged as sp
from kvspec.spec.dense import dense_make_mask
from kvspec.spec.errors import InvalidArgumentError, StateError, UnsupportedOperationError
from kvspec.spec.rows import element_bits

#: fault -> what it does (at most one is planted per process)
FAULTS = {
    "no_cow": "a write into a block another sequence shares goes in place (no copy-on-write)",
    "refcount": "the refcount of block 0 is reported one too high once it is shared",
    "mask": "make_mask's window admits one key too many",
    "copied": "an append reports no copy-on-write",
    "table": "a forked sequence reports its source's table reversed",
    "fresh_order": "an append reports the blocks it allocated in reverse order",
    "free_order": "the free list reported in another order than blocks are taken from it (reversed)",
}
OPS = ["append", "fetch", "hold", "release_hold", "trim", "trim_to", "trim_front", "fork", "release", "snapshot",
       "restore", "drop", "copy", "reload", "handle_reuse", "state_assign"]
FIELDS = ["kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim", "v_head_dim", "dtype", "inplace",
          "rows", "block_size", "max_blocks", "chunk"]
CATEGORY = ((InvalidArgumentError, "invalid_argument"), (StateError, "state"),
            (UnsupportedOperationError, "unsupported"))


class Pool:
    def __init__(self, cache: dict, wide: bool, fault: str | None):
        self.h = cache["kv_heads"]
        self.dk = cache.get("k_head_dim", cache["head_dim"])
        self.dv = cache.get("v_head_dim", cache["head_dim"])
        self.dtype = cache.get("dtype", "float16")
        self.wide, self.fault = wide, fault
        self.world = sp.new_world(cache["block_size"], cache.get("max_blocks") or None, cache.get("chunk", 1),
                                  cache.get("inplace", True))
        self.memo: dict[tuple[int, int], bytes] = {}

    def _row(self, t: int | None, kv: int) -> bytes:
        """One token's K or V elements as ``[H, D]`` little-endian bytes (zero: nobody wrote the slot)."""
        d = self.dv if kv else self.dk
        width = 4 if self.dtype == "float32" else 2
        if t is None:
            return bytes(self.h * d * width)
        key = (t, kv)
        if key not in self.memo:
            self.memo[key] = b"".join(element_bits(t, kv, 0, h, c, self.dtype, self.wide).to_bytes(width, "little")
                                      for h in range(self.h) for c in range(d))
        return self.memo[key]

    def window(self, tokens) -> dict | None:
        if tokens is None:
            return None
        out = {"rows": len(tokens)}
        for side, kv, d in (("k", 0, self.dk), ("v", 1, self.dv)):
            width = (4 if self.dtype == "float32" else 2) * d
            rows = [self._row(t, kv) for t in tokens]
            out[side] = b"".join(r[i * width:(i + 1) * width] for i in range(self.h) for r in rows).hex()
        return out

    def state(self) -> dict:
        w = self.world
        seqs = {}
        for name, s in w.seqs.items():
            table = list(s.table)
            if self.fault == "table" and name != sp.MAIN and len(table) > 1:
                table.reverse()
            seqs[name] = {"table": table, "length": s.length, "start": s.start,
                          "window": self.window(sp.gather(w.pool, s))}
        refcounts = list(w.pool.refcounts)
        if self.fault == "refcount" and refcounts and refcounts[0] > 1:
            refcounts[0] += 1
        free = list(w.pool.free)[::-1] if self.fault == "free_order" else list(w.pool.free)
        return {"sequences": seqs, "refcounts": refcounts, "free": free,
                "held": self.window(w.held)}

    def masks(self, op: dict, windows: list) -> list | None:
        s = self.world.seqs.get(op.get("seq", sp.MAIN))
        if s is None or not isinstance(op.get("n"), int) or op["n"] < 1:
            return None
        out = []
        for window in windows:
            if self.fault == "mask" and window is not None:
                window += 1
            out.append(["".join("1" if x else "0" for x in row) for row in dense_make_mask(s.visible, op["n"], window)])
        return out

    def op(self, op: dict, first: int | None) -> dict:
        if first is not None:
            self.world = replace(self.world, next_token=first)
        try:
            result, self.world = sp.apply_op(self.world, op)
        except (InvalidArgumentError, StateError, UnsupportedOperationError) as exc:
            category = next(c for t, c in CATEGORY if isinstance(exc, t))
            return {"ok": False, "error": {"category": category, "message": str(exc)[:4000]}}
        out: dict = {"ok": True}
        if op["op"] == "append":
            s = self.world.seqs[op.get("seq", sp.MAIN)]
            out["result"] = self.window(sp.gather(self.world.pool, s))
            out["inplace"] = result.inplace
            out["fresh"] = list(result.fresh)[::-1] if self.fault == "fresh_order" else list(result.fresh)
            out["copied"] = [] if self.fault == "copied" else [list(c) for c in result.copied]
        elif isinstance(result, int) and not isinstance(result, bool):
            out["result"] = result
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fault", choices=sorted(FAULTS))
    ap.add_argument("--no-inplace", action="store_true")
    args = ap.parse_args()
    observables = ["sequences", "refcounts", "free", "capacity", *([] if args.no_inplace else ["inplace"]), "masks"]
    if args.fault == "no_cow":
        sp.needs_copy_on_write = lambda refcount: False  # looked up at call time by kvspec.spec.paged.append
    pool: Pool | None = None
    for line in sys.stdin:
        req = json.loads(line)
        rid, kind = req["id"], req["request"]
        if kind == "bye":
            break
        if kind == "hello":
            reply = {"id": rid, "kvproto": 2, "adapter": f"py-paged{'-' + args.fault if args.fault else ''}",
                     "version": "1", "windows": "bytes",
                     "kinds": {"paged": {"modes": ["fp16"], "dtypes": ["float16", "bfloat16", "float32"],
                                         "fields": FIELDS, "ops": OPS,
                                         "observables": observables}}}
        elif kind == "init":
            pool = Pool(req["cache"], req["wide"], args.fault)
            reply = {"id": rid, "ok": True, "state": pool.state()}
        else:
            masks = pool.masks(req["op"], req["masks"]) if "masks" in req and req["op"]["op"] == "append" else None
            reply = {"id": rid, **pool.op(req["op"], req.get("first")), "state": pool.state()}
            if masks is not None:
                reply["masks"] = masks
        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
