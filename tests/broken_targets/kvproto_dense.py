"""A kvproto/1 adapter (docs/targets.md "The line protocol") in plain Python:
a small dense cache (mode fp16: logical trim, copied snapshots, a held
window) whose rows are token identities, serialized as the portable rows of
``kvspec.spec.rows`` in the trace's dtype (``windows: bytes``).

``--fault NAME`` plants one fault (:data:`FAULTS`); none: the correct
control. ``--observables a,b`` declares only those observables (default
``offset,live_start,live_len``), ``--no-batch`` leaves the ``batch`` field
undeclared, ``--max-batch N`` refuses to build a cache of a larger batch
(a configuration the adapter cannot run after all). It reads no row from kvspec: it computes every row itself, as
any adapter must."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvspec.spec.rows import element_bits

#: fault -> what it does (exactly one is planted per process)
FAULTS = {
    "trim_front": "trim(n) drops the oldest n rows instead of the newest (wrong rows after trim)",
    "offset_never_drops": "the reported offset counts every row ever appended (wrong offset after a trim)",
    "live_len_stale": "live_len is not lowered by trim_to (wrong live window length)",
    "live_start": "live_start reports the rows trimmed so far (wrong live window start)",
    "v_layout": "V is laid out with the keys' head dim: columns past Dk read as zero (unequal head dims only)",
    "bf16_through_f16": "bfloat16 rows are stored through float16 (wide rows become inf)",
    "f32_through_bf16": "float32 rows are stored through bfloat16 (the low mantissa bits are lost)",
    "batch": "every sequence of a batch gets the rows of sequence 0 (batch > 1 only)",
    "crash_on_refusal": "dies where the spec refuses trim_to (a crash, not a refusal)",
    "refuses_trim_to_offset": "refuses trim_to(offset), which the spec runs (a no-op)",
    "wrong_category": "refuses a bad trim_to as a state error, not an invalid argument",
    "snapshot_alias": "snapshot keeps the live list itself, so later appends show in it",
    "restore_noop": "restore answers ok and changes nothing",
    "refusal_mutates": "a refused trim_to still drops a row",
}
OBSERVABLES = ("offset", "live_start", "live_len")


class Dense:
    def __init__(self, cache: dict, wide: bool, fault: str | None):
        self.b = cache.get("batch", 1)
        self.h = cache["kv_heads"]
        self.dk = cache.get("k_head_dim", cache["head_dim"])
        self.dv = cache.get("v_head_dim", cache["head_dim"])
        self.dtype = cache.get("dtype", "float16")
        self.wide, self.fault = wide, fault
        self.rows: list[int] = []
        self.returned: list[int] | None = None
        self.held: list[int] | None = None
        self.holders: dict[str, list[int]] = {}
        self.appended = 0
        self.trimmed = 0
        self.stale_len: int | None = None
        self.memo: dict[tuple[int, int], bytes] = {}

    # -- rows --------------------------------------------------------------------
    def _bits(self, t: int, kv: int, b: int, h: int, c: int) -> int:
        f = self.fault
        if f == "batch":
            b = 0
        if f == "v_layout" and kv == 1 and c >= self.dk:
            return 0
        if f == "bf16_through_f16" and self.dtype == "bfloat16":
            import numpy as np  # only here: an adapter process starts per example, numpy's import is slow
            x = np.array([element_bits(t, kv, b, h, c, "bfloat16", self.wide) << 16], np.uint32).view(np.float32)
            with np.errstate(over="ignore"):
                y = x.astype(np.float16).astype(np.float32)
            return int(y.view(np.uint32)[0]) >> 16
        if f == "f32_through_bf16" and self.dtype == "float32":
            return element_bits(t, kv, b, h, c, "float32", self.wide) & 0xFFFF0000
        return element_bits(t, kv, b, h, c, self.dtype, self.wide)

    def _row(self, t: int, kv: int) -> bytes:
        """One token's K or V elements as ``[B, H, D]`` little-endian bytes."""
        key = (t, kv)
        if key not in self.memo:
            d = self.dv if kv else self.dk
            width = 4 if self.dtype == "float32" else 2
            self.memo[key] = b"".join(self._bits(t, kv, b, h, c).to_bytes(width, "little")
                                      for b in range(self.b) for h in range(self.h) for c in range(d))
        return self.memo[key]

    def window(self, tokens: list[int] | None):
        if tokens is None:
            return None
        out = {"rows": len(tokens)}
        for side, kv, d in (("k", 0, self.dk), ("v", 1, self.dv)):
            width = (4 if self.dtype == "float32" else 2) * d
            rows = [self._row(t, kv) for t in tokens]
            # [B, H, n, D] in C order: for each (b, h), the rows one after another
            out[side] = b"".join(r[i * width:(i + 1) * width] for i in range(self.b * self.h) for r in rows).hex()
        return out

    def state(self, observables: tuple[str, ...]) -> dict:
        offset = self.appended if self.fault == "offset_never_drops" else len(self.rows)
        live_len = self.stale_len if self.stale_len is not None else len(self.rows)
        live_start = self.trimmed if self.fault == "live_start" else 0
        obs = {"offset": offset, "live_start": live_start, "live_len": live_len}
        st = {k: obs[k] for k in observables}
        st["cache"] = self.window(list(self.rows))
        st["held"] = self.window(self.held)
        st["holders"] = {n: self.window(list(w)) for n, w in self.holders.items()}
        return st

    # -- ops ---------------------------------------------------------------------
    def op(self, op: dict, first: int | None):
        """(ok, result, error category or None)."""
        name, f = op["op"], self.fault
        if name == "append":
            n = op["n"]
            if n < 1:
                return False, None, "invalid_argument"
            self.rows.extend(range(first, first + n))  # in place: a snapshot that aliases the list sees it
            self.appended += n
            self.stale_len = None
            self.returned = list(self.rows)
            return True, self.window(self.returned), None
        if name == "fetch":
            return True, None, None
        if name == "trim":
            return True, self._trim(op["n"]), None
        if name == "trim_to":
            length = op["len"]
            if f == "refuses_trim_to_offset" and length == len(self.rows) and self.rows:
                return False, None, "invalid_argument"
            if not 0 <= length <= len(self.rows):
                if f == "crash_on_refusal":
                    raise SystemExit(3)
                if f == "refusal_mutates" and self.rows:
                    self.rows.pop()
                return False, None, "state" if f == "wrong_category" else "invalid_argument"
            before = len(self.rows)
            out = self._trim(len(self.rows) - length)
            if f == "live_len_stale" and out:
                self.stale_len = before
            return True, out, None
        if name == "hold":
            if self.returned is None:
                return False, None, "state"
            self.held = self.returned
            return True, None, None
        if name == "release_hold":
            self.held = None
            return True, None, None
        if name in ("snapshot", "restore", "drop"):
            key = op["name"]
            if name == "snapshot":
                if key in self.holders:
                    return False, None, "state"
                self.holders[key] = self.rows if f == "snapshot_alias" else list(self.rows)
                return True, None, None
            if key not in self.holders:
                return False, None, "state"
            if name == "restore":
                if f != "restore_noop":
                    self.rows = list(self.holders[key])
                    self.stale_len = None
            else:
                del self.holders[key]
            return True, None, None
        return False, None, "unsupported"

    def _trim(self, n: int) -> int:
        n = max(0, min(n, len(self.rows)))
        if n:
            if self.fault == "trim_front":
                del self.rows[:n]
            else:
                del self.rows[len(self.rows) - n:]
            self.trimmed += n
        return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fault", choices=sorted(FAULTS))
    ap.add_argument("--observables", default=",".join(OBSERVABLES))
    ap.add_argument("--no-batch", action="store_true")
    ap.add_argument("--max-batch", type=int, default=64,
                    help="refuse (unsupported) to build a cache of a larger batch, though batch is declared")
    args = ap.parse_args()
    observables = tuple(o for o in args.observables.split(",") if o)
    fields = ["kind", "mode", "step", "kv_heads", "head_dim", "k_head_dim", "v_head_dim", "dtype", "rows", "inplace"]
    if not args.no_batch:
        fields.append("batch")
    cache: Dense | None = None
    for line in sys.stdin:
        req = json.loads(line)
        rid, kind = req["id"], req["request"]
        if kind == "bye":
            break
        if kind == "hello":
            reply = {"id": rid, "kvproto": 1, "adapter": f"py-dense{'-' + args.fault if args.fault else ''}",
                     "version": "1", "windows": "bytes",
                     "kinds": {"dense": {"modes": ["fp16"], "dtypes": ["float16", "bfloat16", "float32"],
                                         "fields": fields,
                                         "ops": ["append", "fetch", "hold", "release_hold", "trim", "trim_to",
                                                 "snapshot", "restore", "drop"],
                                         "observables": list(observables)}}}
        elif kind == "init" and req["cache"].get("batch", 1) > args.max_batch:
            cache = None
            reply = {"id": rid, "ok": False, "state": {"cache": {"rows": 0, "k": "", "v": ""}, "held": None, "holders": {}},
                     "error": {"category": "unsupported", "message": f"batch > {args.max_batch}"}}
        elif kind == "init":
            cache = Dense(req["cache"], req["wide"], args.fault)
            reply = {"id": rid, "ok": True, "state": cache.state(observables)}
        else:
            ok, result, category = cache.op(req["op"], req.get("first"))
            reply = {"id": rid, "ok": ok, "state": cache.state(observables)}
            if ok:
                reply["result"] = result
            else:
                reply["error"] = {"category": category, "message": f"{req['op']['op']} refused"}
        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
