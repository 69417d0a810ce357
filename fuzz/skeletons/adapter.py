#!/usr/bin/env python3
"""A kvproto/1 cache adapter (written by `kvspec adapter new --lang python`).

kvspec starts this program, writes one JSON request per line on its stdin
and reads one JSON reply per line from its stdout (docs/targets.md, "The
line protocol"). As written it is a correct dense cache (mode fp16: rows
kept as given, logical trim, copied snapshots, a held window), so

    kvspec adapter check ./adapter.py          # the protocol, every problem in a sentence
    kvspec fuzz --target exec:./adapter.py     # the contract, fuzzed against the spec

both pass before you change anything. Then put your engine's cache behind
the class `Cache` below (search for "YOUR CACHE"): build it in `__init__`,
write the rows `first .. first + n - 1` with its own append, and read its
windows back as bytes. Only the standard library is used; stdout carries
protocol lines only (log to stderr).
"""

from __future__ import annotations

import json
import sys

# -- what the adapter declares (hello) ------------------------------------------
# Declare only what your cache does: an op left out is never sent (kvspec skips
# it and says so), an observable left out is not compared, a cache field left
# out is never sent (your cache runs at that field's default). Add "inplace"
# to FIELDS (and to OBSERVABLES) only if your cache has an in-place write switch.
ADAPTER = "my-dense-cache"
DTYPES = ["float16", "bfloat16", "float32"]
FIELDS = ["kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim", "v_head_dim", "dtype", "rows"]
OPS = ["append", "fetch", "hold", "release_hold", "trim", "trim_to", "snapshot", "restore", "drop"]
OBSERVABLES = ["offset", "live_start", "live_len"]


# -- the portable row function (docs/kvtrace.md "Portable rows") -----------------
# kvspec never sends row contents: row t of the trace is computed here, bit for
# bit, from its identity t. Copy this part as it is.
def mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def element_bits(t: int, kv: int, b: int, h: int, c: int, dtype: str, wide: bool) -> int:
    """The bit pattern of element [b, h, c] of token t's K (kv=0) or V (kv=1) row."""
    place = ((kv * 64 + b) * 64 + h) * 1024 + c
    z = (t * 0x9E3779B1) & 0xFFFFFF
    z ^= z >> 12
    salt = mix32(place)
    u = ((z >> (12 * ((kv + b + h + c) & 1))) & 0xFFF) ^ (salt & 0xFFF)
    x = mix32(salt ^ t) >> 16
    sign, e, m = u >> 11, (u >> 7) & 15, u & 127
    if dtype == "float16":
        return (sign << 15) | ((7 + e) << 10) | (m << 3) | (x >> 13)
    exp = 119 + e + (24 if wide and t % 5 == 2 else 0)
    if dtype == "bfloat16":
        return (sign << 15) | (exp << 7) | m
    return (sign << 31) | (exp << 23) | (m << 16) | x


class Refused(Exception):
    """A refusal: ``category`` is invalid_argument, state or unsupported (the
    spec's error types); the message is free text kvspec never compares."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


# -- YOUR CACHE ------------------------------------------------------------------
class Cache:
    """A dense cache of rows [B, H, D] per token. Replace the list of rows by
    your engine's cache: keep the method names, and everything below them
    (the protocol loop) works unchanged."""

    def __init__(self, cache: dict, wide: bool):
        # YOUR CACHE: build your engine's cache here from the trace's fields
        # (those FIELDS declares; the rest are at their defaults).
        self.b = cache.get("batch", 1)
        self.h = cache.get("kv_heads", 2)
        self.dk = cache.get("k_head_dim") or cache.get("head_dim", 8)
        self.dv = cache.get("v_head_dim") or cache.get("head_dim", 8)
        self.dtype = cache.get("dtype", "float16")
        self.width = 4 if self.dtype == "float32" else 2
        self.wide = wide
        self.rows: list[tuple[bytes, bytes]] = []     # the live rows, oldest first: (K [B,H,Dk], V [B,H,Dv])
        self.returned: list[tuple[bytes, bytes]] | None = None  # what the last append returned
        self.held: list[tuple[bytes, bytes]] | None = None
        self.snapshots: dict[str, list[tuple[bytes, bytes]]] = {}

    def _row(self, t: int, kv: int) -> bytes:
        d = self.dv if kv else self.dk
        return b"".join(element_bits(t, kv, b, h, c, self.dtype, self.wide).to_bytes(self.width, "little")
                        for b in range(self.b) for h in range(self.h) for c in range(d))

    # the observables (declare the ones you report in OBSERVABLES)
    def offset(self) -> int:
        return len(self.rows)

    def live_start(self) -> int:
        return 0  # no front trim: the live window starts at row 0

    def live_len(self) -> int:
        return len(self.rows)

    # the ops (docs/dense.md; a refusal must change nothing)
    def append(self, n: int, first: int) -> list[tuple[bytes, bytes]]:
        if n < 1:
            raise Refused("invalid_argument", f"append: n must be >= 1, got {n}")
        # YOUR CACHE: hand these rows to your engine's append (update_and_fetch)
        self.rows = self.rows + [(self._row(t, 0), self._row(t, 1)) for t in range(first, first + n)]
        self.returned = list(self.rows)  # the window a model would attend over
        return self.returned

    def trim(self, n: int) -> int:
        n = max(0, min(n, len(self.rows)))  # clamped to [0, live_len]
        self.rows = self.rows[: len(self.rows) - n]
        return n

    def trim_to(self, length: int) -> int:
        if not 0 <= length <= len(self.rows):
            raise Refused("invalid_argument", f"trim_to: len must satisfy 0 <= len <= offset ({len(self.rows)}), "
                                              f"got {length}")
        return self.trim(len(self.rows) - length)

    def hold(self) -> None:
        if self.returned is None:
            raise Refused("state", "hold: no append has returned a window yet")
        self.held = self.returned

    def release_hold(self) -> None:
        self.held = None

    def snapshot(self, name: str) -> None:
        if name in self.snapshots:
            raise Refused("state", f"snapshot: name {name!r} is already in use")
        self.snapshots[name] = list(self.rows)  # a copy: later writes must never show in it

    def restore(self, name: str) -> None:
        if name not in self.snapshots:
            raise Refused("state", f"restore: no snapshot named {name!r}")
        self.rows = list(self.snapshots[name])

    def drop(self, name: str) -> None:
        if name not in self.snapshots:
            raise Refused("state", f"drop: no snapshot named {name!r}")
        del self.snapshots[name]

    # -- windows as the protocol reports them -----------------------------------
    def window(self, rows: list[tuple[bytes, bytes]] | None) -> dict | None:
        """K and V as [B, H, n, D] in C order, little-endian, lowercase hex.
        YOUR CACHE: read your engine's tensors back here (their bytes)."""
        if rows is None:
            return None
        out: dict = {"rows": len(rows)}
        for side, kv, d in (("k", 0, self.dk), ("v", 1, self.dv)):
            size = d * self.width
            out[side] = b"".join(r[kv][i * size:(i + 1) * size] for i in range(self.b * self.h) for r in rows).hex()
        return out

    def state(self) -> dict:
        observables = {"offset": self.offset(), "live_start": self.live_start(), "live_len": self.live_len()}
        st = {k: observables[k] for k in OBSERVABLES}
        st["cache"] = self.window(self.rows)
        st["held"] = self.window(self.held)
        st["holders"] = {name: self.window(rows) for name, rows in self.snapshots.items()}
        return st


# -- the protocol loop (no change needed) ------------------------------------------
def run_op(cache: Cache, op: dict, first: int | None) -> tuple[object, bool]:
    """(result, whether it is a window)."""
    name = op.get("op")
    if name == "append":
        return cache.window(cache.append(op["n"], first or 0)), True
    if name == "fetch":
        return None, False
    if name == "trim":
        return cache.trim(op["n"]), False
    if name == "trim_to":
        return cache.trim_to(op["len"]), False
    if name in ("hold", "release_hold"):
        getattr(cache, name)()
        return None, False
    if name in ("snapshot", "restore", "drop"):
        getattr(cache, name)(op["name"])
        return None, False
    raise Refused("unsupported", f"{name}: not an op of this adapter")


def main() -> int:
    cache: Cache | None = None
    for line in sys.stdin:
        req = json.loads(line)
        rid, what = req.get("id"), req.get("request")
        if what == "bye":
            break
        if what == "hello":
            reply = {"id": rid, "kvproto": 1, "adapter": ADAPTER, "version": "0.1", "windows": "bytes",
                     "kinds": {"dense": {"modes": ["fp16"], "dtypes": DTYPES, "fields": FIELDS, "ops": OPS,
                                         "observables": OBSERVABLES}}}
        elif what == "init":
            cache = Cache(req["cache"], bool(req.get("wide")))
            reply = {"id": rid, "ok": True, "state": cache.state()}
        elif what == "op" and cache is not None:
            try:
                result, _ = run_op(cache, req["op"], req.get("first"))
                reply = {"id": rid, "ok": True, "result": result}
            except Refused as exc:
                reply = {"id": rid, "ok": False, "error": {"category": exc.category, "message": str(exc)}}
            reply["state"] = cache.state()
        else:
            reply = {"id": rid, "ok": False, "error": {"category": "state", "message": "send init first"},
                     "state": {"cache": [], "held": None, "holders": {}}}
        sys.stdout.write(json.dumps(reply, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
