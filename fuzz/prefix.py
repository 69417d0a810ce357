"""The prefix kind's harness: prefix caching by content hash
(``kvspec.spec.prefix``) in lockstep with a prefix target, and its state machine.

A **prefix target** is anything that admits requests by their tokens, finds
the longest cached prefix of full blocks, decodes, frees, preempts and
resumes, and shows its blocks (:class:`PrefixTarget`, docs/prefix.md): our
MLX pool (``kvspec.impl.prefix.PrefixCachePool``, wrapped by :class:`OursTarget`)
or vLLM's KV-cache manager (``kvspec.fuzz.adapters.vllm``). The lockstep
(:class:`PrefixLockstep`) runs every op on the spec and on the target and
compares, after every op:

* the op's result: an admit's or a resume's ``admitted``, hit tokens and
  block table; a decode's or a reset's bool; a lookup's hit tokens; a
  refusal's category (ours: its type and words);
* the whole observable state (:meth:`PrefixTarget.observe`, the fields of
  :data:`VIEW_FIELDS` in that order): every request's table, token count and
  liveness; every block's refcount and key; the free queue front to back;
  the cached map (key -> block ids in insertion order); the row name of
  every written slot of a held or keyed block (K and V each read back from
  the target's storage and named); and where the target reads a request's
  rows through its own read path (ours: ``fetch``), every row it reads;
* on ours, after an op the spec says changes nothing (a refusal, an admit
  not admitted, a decode without room, a reset refused, a lookup), the
  pool's whole state (metadata and every slab byte) as it was before the op.

Names, not hashes: a **key** is ``(salt, tokens)``, the tokens of the first
``(i + 1) * B`` positions of a request and its extra key (``salt``: None or
a small int); a **row name** is ``(salt, tokens[:p + 1])``, the name of the
K/V row of position ``p`` (a row depends on every token before it and on
the extra key). A target keeps its own table from its hashes back to these.

Each divergence names the op index, the first differing field and the rule
it breaks (:data:`RULES`), e.g. ``block 3 key differs (rule 'key': ...)``
with the spec's value and the target's. A target may declare differences
the lockstep does not count (``declared``: rule -> reason); only
differences that leave both states equal can be declared for a refusal
(``"<op> refusal"``: the spec refuses, the target silently does nothing).

Plugging another engine in takes two calls (``kvspec.fuzz.prefix_runs``, a runner
above this module): ``prefix_campaign`` (a seeded campaign against
``target_factory(cache) -> PrefixTarget``, a failure shrunk to a minimal
kvtrace) and ``replay_prefix`` (one trace); both reach this lockstep through
the usual factories, ``{"prefix": {"target": target_factory}}``
(:func:`target_factories`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Protocol

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.lockstep import Outcome, error_text, same_value
from kvspec.fuzz.machine import KVMachine
from kvspec.fuzz.protocol import refusal_category
from kvspec.fuzz.trace import TraceFormatError
from kvspec.spec import prefix as sp
from kvspec.spec.errors import KVCacheError

__all__ = ["RULES", "VIEW_FIELDS", "OursTarget", "PrefixLockstep", "PrefixMachine", "PrefixRows", "PrefixTarget",
           "row_name", "spec_view", "target_factories"]

#: a key or a row name: ``(salt, tokens)``
Name = tuple[Any, tuple[int, ...]]


class PrefixTarget(Protocol):
    """A KV-cache manager with prefix caching, driven op by op (the
    ``prefix`` kind, docs/prefix.md). Request ids are strings, token ids
    ints >= 0, ``salt`` None or a small int. Bad arguments and ops out of
    turn raise ``kvspec.spec.errors.KVCacheError`` subclasses (another engine may
    raise its own: refusals are compared by category); a refusal changes
    nothing. The lockstep hands the target no rows: each target writes its
    own rows for the positions it allocated, as its model would (the row of
    position ``p`` named :func:`row_name` ``(salt, tokens, p)``), and names
    them back in :meth:`observe`."""

    #: differences the lockstep does not count, rule (a key of
    #: :data:`RULES`, or ``"<op> refusal"``) -> why the target differs
    declared: dict[str, str]

    def admit(self, req: str, tokens: tuple[int, ...], salt: Any = None) -> Any:
        """Admit a new request: hit the longest cached prefix, allocate the
        rest, write the rows of the positions past the hit. Returns an
        object with ``admitted``, ``hit_tokens`` and ``table`` (or a dict
        with ``admitted``, ``hit``, ``table``); not admitted: nothing
        changed."""

    def decode(self, req: str, tokens: tuple[int, ...]) -> bool:
        """Grow a live request by ``tokens`` (their rows written). False:
        no room, nothing changed."""

    def free(self, req: str) -> None: ...
    def preempt(self, req: str) -> None: ...

    def resume(self, req: str) -> Any:
        """Admit a preempted request again (its tokens and salt); as :meth:`admit`."""

    def lookup(self, tokens: tuple[int, ...], salt: Any = None) -> int:
        """Hit tokens an admit of ``tokens`` would get; changes nothing."""

    def free_blocks(self, blocks: tuple[int, ...]) -> None:
        """The block pool's own release of block ids (the harness calls it
        only where the spec refuses: a double-free guard probe)."""

    def reset(self) -> bool: ...

    def observe(self) -> dict[str, Any]:
        """The observable state, :data:`VIEW_FIELDS`: ``requests`` {req:
        {"table": [ids], "tokens": n, "live": bool}} (a preempted request:
        live False, table []); ``blocks`` [(refcount, key or None)] per
        block id 0 .. n_blocks - 1; ``free`` [ids] front to back;
        ``cached`` {key: [ids]} in insertion order; ``rows`` {(block,
        slot): row name or None} for at least every slot of a held or keyed
        block (None: no row the target wrote matches; K and V named apart
        disagree: any other value, shown as it is); optional ``reads``
        {req: [row names]}: the rows a live request reads through the
        target's own read path, position by position."""


#: the fields of a view, in the order they are compared
VIEW_FIELDS = ("requests", "blocks", "free", "cached", "rows", "reads")

#: the rule each check enforces: its name (a divergence's ``rule 'NAME'``,
#: a target's ``declared`` key) -> what the spec says
RULES = {
    "refusal": "kvspec.spec.errors: the spec's refusals (an unknown or out-of-turn request, bad tokens; free_blocks always)",
    "exhaustion": "kvspec.spec.prefix.admit: need > available: not admitted, nothing changed",
    "hit length": "kvspec.spec.prefix.hit_blocks: the cached chain of full blocks, at most (len - 1) // B",
    "block table": "kvspec.spec.prefix.admit: the hits (first block under each key), then pops from the queue's front",
    "decode room": "kvspec.spec.prefix.decode: False, nothing changed, when the free queue lacks the blocks",
    "reset": "kvspec.spec.prefix.reset: False while any block is held, else every key dropped",
    "requests": "kvspec.spec.prefix: the requests known, their token counts and liveness",
    "refcount": "kvspec.spec.prefix.refcounts_match_tables: refcount = live tables holding the block",
    "key": "kvspec.spec.prefix.keys_name_contents: a full block's key names its tokens; eviction and reset clear it",
    "free queue": "kvspec.spec.prefix.free: tail first, keyed to the back, unkeyed to the front; pops from the front",
    "cached map": "kvspec.spec.prefix.cached_map_exact: key -> blocks in insertion order, an evicted block removed",
    "rows": "kvspec.spec.prefix.keys_name_contents: each written slot holds the row its key or request names",
    "reads": "kvspec.spec.prefix.requests_read_their_rows: a live request reads its own rows through its table",
    "nothing changed": "a refusal, an admit not admitted, a decode without room, a reset refused, a lookup",
    "pool invariants": "the implementation's own broken_invariants(): none",
    "dtype": "the cache's dtype: the slabs and every fetch hold rows in it (bfloat16 is not float16)",
    "copy": "kvspec.spec.prefix.apply_op: a world is a value; a copy is untouched by ops on its original",
}


def row_name(salt: Any, tokens: Any, p: int) -> Name:
    """The name of position ``p``'s row: ``(salt, tokens[:p + 1])``."""
    return (salt, tuple(map(int, tokens[: p + 1])))


def norm_name(x: Any) -> Any:
    """A key or row name as the spec writes it (``(salt, tuple of ints)``),
    from a target's tuple, list or anything else (left as it is)."""
    if x is None:
        return None
    if type(x) is tuple and len(x) == 2 and type(x[1]) is tuple and _all_ints(x[1]):
        return x  # spec form already: (salt, a tuple of ints)
    try:
        salt, tokens = x
        return (salt, tuple(map(int, tokens)))
    except (TypeError, ValueError):
        return x


def _all_ints(tokens: tuple[Any, ...]) -> bool:
    """Whether every token is an ``int`` itself (not a bool, numpy
    integer or float: those :func:`norm_name` converts)."""
    return not tokens or set(map(type, tokens)) == {int}


def show(x: Any) -> str:
    """A key, name, list or table as a divergence shows it: Python's repr,
    tuples and all (``(None, (1, 2))``)."""
    return repr(x)


# -- rows ---------------------------------------------------------------------


class PrefixRows:
    """The K and V rows of every row name for one configuration, and their
    names back. A row is ``(kv_heads, head_dim)`` values ``m * 2**e`` (``m``
    in [1, 2), random signs) from a generator seeded by a stable hash
    (BLAKE2b, never Python's salted ``hash``) of ``(which, name)``, cast to
    the dtype, spread over the dtype's range so that storing them in a
    narrower dtype changes a row's name: ``e`` in [-8, 8] for float16, in
    [-20, 20] for bfloat16 and float32 with the first value's ``e`` in [16,
    20] (float16 cannot hold it), float32 values with their lowest mantissa
    bit set (neither 16-bit dtype holds them);
    names are found by the row's exact float32 bytes (bfloat16, float16 and
    float32 values are all exact in float32) in a table of every row made."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: str, v_head_dim: int | None = None):
        self.kv_heads, self.dtype = kv_heads, dtype
        self.dims = {"k": head_dim, "v": v_head_dim or head_dim}
        self._rows: dict[tuple[str, Any], np.ndarray] = {}
        #: which ("k" or "v") -> a row's float32 bytes -> its name (the first made)
        self._names: dict[str, dict[bytes, Any]] = {"k": {}, "v": {}}
        #: the same, by the row's bytes in ``dtype`` itself (:meth:`stored_slot_names`)
        self._stored: dict[str, dict[bytes, Any]] = {"k": {}, "v": {}}

    @staticmethod
    def seed(which: str, name: Any) -> int:
        digest = hashlib.blake2b(repr((which, name)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def _cast(self, x: np.ndarray) -> np.ndarray:
        from kvspec.fuzz.rows import round_to_bfloat16

        if self.dtype == "float16":
            return x.astype(np.float16).astype(np.float32)
        if self.dtype == "bfloat16":
            return round_to_bfloat16(x.astype(np.float32))
        return x.astype(np.float32)

    def row(self, name: Any, which: str) -> np.ndarray:
        """``(kv_heads, head_dim)`` float32 holding ``dtype`` values."""
        key = (which, name)
        got = self._rows.get(key)
        if got is None:
            rng = np.random.default_rng(self.seed(which, name))
            shape = (self.kv_heads, self.dims[which])
            lo, hi = (-8, 8) if self.dtype == "float16" else (-20, 20)
            exp = rng.integers(lo, hi + 1, shape)
            if self.dtype != "float16":
                exp.flat[0] = rng.integers(16, 21)
            mag = rng.uniform(1.0, 2.0, shape) * np.exp2(exp.astype(np.float64))
            sign = np.where(rng.integers(0, 2, shape) == 0, -1.0, 1.0)
            got = self._cast(mag * sign)
            if self.dtype == "float32":
                got = (got.view(np.uint32) | np.uint32(1)).view(np.float32)
            self._rows[key] = got
            self._names.setdefault(which, {}).setdefault(got.tobytes(), name)
            self._stored.setdefault(which, {}).setdefault(self.stored_bytes(got), name)
        return got

    def stored_bytes(self, x: np.ndarray) -> bytes:
        """The bytes of float32 ``x`` (holding ``dtype`` values) stored in
        ``dtype``: float16 and float32 as NumPy writes them, bfloat16 as
        the high half of each float32 (exact: the low half is zero)."""
        if self.dtype == "float16":
            return x.astype(np.float16).tobytes()
        if self.dtype == "bfloat16":
            return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return np.ascontiguousarray(x, dtype=np.float32).tobytes()

    def rows(self, names: list[Any], which: str) -> np.ndarray:
        """``(n, kv_heads, head_dim)`` float32: the rows of ``names``."""
        return np.stack([self.row(n, which) for n in names])

    def name(self, row: Any, which: str) -> Any:
        """The name whose row ``row`` is (exactly), or None."""
        return self._names.get(which, {}).get(np.ascontiguousarray(row, dtype=np.float32).tobytes())

    def slot_name(self, k: Any, v: Any) -> Any:
        """The name of a slot from its K and V rows: the name both give;
        None when neither names a row; ``"K <name> / V <name>"`` when they
        disagree (a K row without its V row)."""
        nk, nv = self.name(k, "k"), self.name(v, "v")
        return nk if nk == nv else f"K {nk!r} / V {nv!r}"

    def stored_slot_names(self, kb: bytes, vb: bytes, n: int) -> list[Any]:
        """The slot names of ``n`` rows from the raw bytes of K and V
        arrays in ``dtype`` ``[>= n, kv_heads, head_dim]`` (C order): the
        same names :meth:`slot_names` gives their float32 forms (each
        dtype widens to float32 exactly and one to one; no row made holds
        a NaN)."""
        size = 2 if self.dtype in ("float16", "bfloat16") else 4  # bytes a value (stored_bytes)
        rk, rv = self.kv_heads * self.dims["k"] * size, self.kv_heads * self.dims["v"] * size
        return _names_of_rows(self._stored, kb, vb, rk, rv, n)

    def slot_names(self, k: Any, v: Any, n: int) -> list[Any]:
        """``[slot_name(k[i], v[i]) for i in range(n)]``, each array turned
        to float32 bytes once and cut into rows (``k``, ``v``: host arrays
        ``[>= n, ...]``; anything else goes row by row, raising as
        :meth:`slot_name` does)."""
        k, v = np.asarray(k), np.asarray(v)
        if n <= 0 or k.ndim < 1 or v.ndim < 1 or k.shape[0] < n or v.shape[0] < n:
            return [self.slot_name(k[i], v[i]) for i in range(n)]
        kb = np.ascontiguousarray(k[:n], dtype=np.float32).tobytes()
        vb = np.ascontiguousarray(v[:n], dtype=np.float32).tobytes()
        return _names_of_rows(self._names, kb, vb, len(kb) // n, len(vb) // n, n)


def _names_of_rows(names: dict[str, dict[bytes, Any]], kb: bytes, vb: bytes, rk: int, rv: int, n: int) -> list[Any]:
    """:meth:`PrefixRows.slot_name`'s rule for ``n`` rows cut from K bytes
    ``kb`` (``rk`` bytes a row) and V bytes ``vb`` (``rv``), named through
    ``names["k"]`` and ``names["v"]`` (row bytes -> name)."""
    kn, vn = names["k"], names["v"]
    out = []
    for i in range(n):
        nk, nv = kn.get(kb[i * rk:(i + 1) * rk]), vn.get(vb[i * rv:(i + 1) * rv])
        out.append(nk if nk == nv else f"K {nk!r} / V {nv!r}")
    return out


def dtype_name(d: Any) -> str:
    """``mx.bfloat16`` (or numpy's) as ``"bfloat16"``."""
    return str(d).rsplit(".", 1)[-1]


def _host(a: Any) -> np.ndarray:
    from kvspec.fuzz.rows import host

    return np.asarray(host(a), dtype=np.float32)


def _host_all(arrays: list[Any]) -> list[np.ndarray]:
    """``[_host(a) for a in arrays]`` in one round trip: the MLX arrays'
    read forms (``kvspec.fuzz.rows.read_forms``, the device asked once)
    evaluated in one ``mx.eval``, then each turned to NumPy and float32."""
    import mlx.core as mx

    from kvspec.fuzz.rows import read_forms

    at = [i for i, a in enumerate(arrays) if isinstance(a, mx.array)]
    forms = list(arrays)
    if at:
        for i, f in zip(at, read_forms([arrays[i] for i in at]), strict=True):
            forms[i] = f
        mx.eval(*(forms[i] for i in at))
    return [np.asarray(np.asarray(f), dtype=np.float32) for f in forms]


# -- our implementation as a target ---------------------------------------------


def _impl() -> Any:
    from kvspec.impl import prefix

    return prefix


def admit_fields(result: Any) -> tuple[Any, Any, Any]:
    """``(admitted, hit tokens, table)`` of an admit's or a resume's
    result: an object with ``admitted``, ``hit_tokens`` and ``table``, or a
    mapping with ``admitted``, ``hit`` (or ``hit_tokens``) and ``table``.
    Raises TypeError for anything else."""
    if isinstance(result, dict):
        hit = result["hit"] if "hit" in result else result["hit_tokens"]
        return result["admitted"], hit, list(result["table"])
    return result.admitted, result.hit_tokens, list(result.table)


def result_json(op: str, result: Any) -> Any:
    """A spec result as a trace's ``returns`` writes it: an admit's or a
    resume's ``{"admitted", "hit", "table"}``, else the value."""
    if op in ("admit", "resume") and result is not None:
        admitted, hit, table = admit_fields(result)
        return {"admitted": bool(admitted), "hit": int(hit), "table": [None if b is None else int(b) for b in table]}
    return result


class OursTarget:
    """``kvspec.impl.prefix.PrefixCachePool`` (or an injected bug's subclass,
    ``factory``) as a :class:`PrefixTarget`: after every admit, decode and
    resume the rows of the pending positions (``pool.pending(req)``) are
    written as :class:`PrefixRows` makes them for their names, and
    :meth:`observe` names the slabs' rows back."""

    name = "impl"
    declared: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: dict[str, Any], factory: Any = None):
        import mlx.core as mx

        cls = factory or _impl().PrefixCachePool
        self.cfg = cfg
        self.block_size, self.n_blocks = cfg["block_size"], cfg["n_blocks"]
        self.dtype = cfg.get("dtype", "float16")
        self._mx_dtype = getattr(mx, self.dtype)
        self.pool = cls(self.block_size, self.n_blocks, cfg["kv_heads"], cfg["head_dim"], window=cfg.get("window"))
        self.rows = PrefixRows(cfg["kv_heads"], cfg["head_dim"], self.dtype)
        #: req -> (tokens, salt) as handed in (what the model computed rows for)
        self.seqs: dict[str, tuple[tuple[int, ...], Any]] = {}

    # -- ops ---------------------------------------------------------------
    def _write_pending(self, req: str) -> None:
        import mlx.core as mx

        first, end = self.pool.pending(req)
        if end <= first:
            return
        tokens, salt = self.seqs[req]
        names = [row_name(salt, tokens, p) for p in range(first, end)]
        keys = mx.array(self.rows.rows(names, "k")).astype(self._mx_dtype)
        values = mx.array(self.rows.rows(names, "v")).astype(self._mx_dtype)
        self.pool.write(req, keys, values)

    def admit(self, req: str, tokens: tuple[int, ...], salt: Any = None) -> Any:
        got = self.pool.admit(req, tokens, salt)
        if admit_fields(got)[0]:
            self.seqs[req] = (tuple(tokens), salt)
            self._write_pending(req)
        return got

    def decode(self, req: str, tokens: tuple[int, ...]) -> bool:
        got = self.pool.decode(req, tokens)
        if got is True:
            old, salt = self.seqs[req]
            self.seqs[req] = (old + tuple(tokens), salt)
            self._write_pending(req)
        return got

    def free(self, req: str) -> None:
        got = self.pool.free(req)
        self.seqs.pop(req, None)
        return got

    def preempt(self, req: str) -> None:
        return self.pool.preempt(req)

    def resume(self, req: str) -> Any:
        got = self.pool.resume(req)
        if admit_fields(got)[0]:
            self._write_pending(req)
        return got

    def lookup(self, tokens: tuple[int, ...], salt: Any = None) -> int:
        return self.pool.lookup(tokens, salt)

    def free_blocks(self, blocks: tuple[int, ...]) -> None:
        return self.pool.free_blocks(blocks)

    def reset(self) -> bool:
        return self.pool.reset()

    # -- what it shows -------------------------------------------------------
    def copy(self) -> OursTarget:
        """A target over ``pool.copy()`` (the rows it writes and the
        sequences it knows copied too)."""
        new = OursTarget.__new__(OursTarget)
        new.__dict__.update(self.__dict__)
        new.pool, new.seqs = self.pool.copy(), dict(self.seqs)
        return new

    def _block_rows(self) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Every block's K and V rows in host form (None: no slab yet): the
        raw slabs in one round trip where they are MLX arrays, else each
        block read through ``pool.block_rows(b)``."""
        import mlx.core as mx

        if self.pool.dtype is None:  # no slab before the first write
            return [None] * self.n_blocks
        keys, values = getattr(self.pool, "keys", None), getattr(self.pool, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            # the slabs [n_blocks, B, H, D] read in one round trip (block_rows(b) evaluates one block a call)
            hk, hv = _host_all([keys, values])
            return [(hk[b], hv[b]) for b in range(self.n_blocks)]
        got = self._read_blocks()
        hosts = iter(_host_all([a for kv in got if kv is not None for a in (kv[0], kv[1])]))
        return [None if kv is None else (next(hosts), next(hosts)) for kv in got]

    def _read_blocks(self) -> list[Any]:
        """Every block's K and V as ``pool.block_rows(b)`` returns them,
        evaluated (None: no slab yet); their dtypes noted."""
        import mlx.core as mx

        if self.pool.dtype is None:  # no slab before the first write
            return [None] * self.n_blocks
        got = [self.pool.block_rows(b) for b in range(self.n_blocks)]
        arrays = [a for kv in got if kv is not None for a in kv]
        if arrays:
            mx.eval(*arrays)
            self._seen_dtypes["block_rows"] = sorted({dtype_name(d) for d in {a.dtype for a in arrays}})
        return got

    def _in_stored_form(self, a: Any, which: str) -> bool:
        """Whether ``a`` is an MLX array ``[n, kv_heads, head_dim]`` of the
        cache's dtype (its own bytes are what :class:`PrefixRows` stores)."""
        import mlx.core as mx

        return (isinstance(a, mx.array) and a.dtype == self._mx_dtype and a.ndim == 3
                and tuple(a.shape[1:]) == (self.rows.kv_heads, self.rows.dims[which]))

    def _name_reads(self, reads: list[tuple[Any, Any, int | None]]) -> list[list[Any]]:
        """The slot names of each read ``(K, V, n)``: its first ``n`` rows
        (None: as many as K holds), as :meth:`PrefixRows.slot_names` names
        their host forms. On the CPU (where a read needs no device read)
        arrays in the cache's dtype and shape are named from their own bytes
        (:meth:`PrefixRows.stored_slot_names`: the same names, no
        conversion); the rest are turned to host form together, in one
        round trip."""
        from kvspec.fuzz.device import current

        out: list[list[Any]] = [[] for _ in reads]
        hosted = []
        cpu = current() == "cpu"
        for i, (k, v, n) in enumerate(reads):
            if cpu and self._in_stored_form(k, "k") and self._in_stored_form(v, "v"):
                m = k.shape[0] if n is None else n
                if m <= k.shape[0] and m <= v.shape[0]:
                    # a memoryview reads an MLX array's bytes as they are, C order
                    out[i] = self.rows.stored_slot_names(memoryview(k).tobytes(), memoryview(v).tobytes(), m)
                    continue
            hosted.append(i)
        hosts = iter(_host_all([a for i in hosted for a in reads[i][:2]]))
        for i in hosted:
            hk, hv = next(hosts), next(hosts)
            n = reads[i][2]
            out[i] = self.rows.slot_names(hk, hv, hk.shape[0] if n is None else n)
        return out

    def observe(self) -> dict[str, Any]:
        p = self.pool
        requests = {r: {"table": list(p.table(r)), "tokens": int(n), "live": bool(live)}
                    for r, (n, live) in p.requests().items()}
        blocks = [(p.refcount(b), norm_name(p.key(b))) for b in range(self.n_blocks)]
        #: the dtypes the pool's storage and read paths hold, by path
        self._seen_dtypes: dict[str, list[str]] = {}
        if p.dtype is not None:
            self._seen_dtypes["slabs"] = sorted({dtype_name(a.dtype) for a in (p.keys, p.values)})
        bs = self.block_size
        got = self._read_blocks()  # every block through the pool's own read path
        fetched: list[tuple[str, Any, Any]] = []
        for r, q in requests.items():
            if q["live"]:
                k, v = p.fetch(r)
                self._seen_dtypes.setdefault("fetch", [])
                self._seen_dtypes["fetch"] = sorted({*self._seen_dtypes["fetch"], dtype_name(k.dtype),
                                                     dtype_name(v.dtype)})
                fetched.append((r, k, v))
        named = iter(self._name_reads([(kv[0], kv[1], bs) for kv in got if kv is not None]
                                      + [(k, v, None) for _, k, v in fetched]))
        rows: dict[tuple[int, int], Any] = {}
        for b, kv in enumerate(got):
            names = [None] * bs if kv is None else next(named)
            for s in range(bs):
                rows[(b, s)] = names[s]
        reads = {r: next(named) for r, _, _ in fetched}
        return {"requests": requests, "blocks": blocks, "free": list(p.free_queue()),
                "cached": {norm_name(k): list(ids) for k, ids in p.cached().items()}, "rows": rows, "reads": reads,
                "dtypes": dict(self._seen_dtypes)}

    def state(self) -> dict[str, Any]:
        """Everything observable on the pool, raw (the slabs as bytes):
        what an op that changes nothing must leave as it was."""
        p = self.pool
        reqs = p.requests()
        return {"requests": dict(reqs), "tables": {r: tuple(p.table(r)) for r in reqs},
                "refcounts": [p.refcount(b) for b in range(self.n_blocks)],
                "keys": [p.key(b) for b in range(self.n_blocks)], "free queue": tuple(p.free_queue()),
                "cached": {k: tuple(v) for k, v in p.cached().items()}, "slabs": self._slab_bytes()}

    def _slab_bytes(self) -> list[tuple[bytes, bytes] | None]:
        """Every block's K and V bytes (None: no slab yet): the slabs'
        own bytes, in their dtype (every slab byte: no widening to compare
        through), cut into blocks; slabs that are not ``[n_blocks, ...]`` MLX
        arrays read as :meth:`_block_rows` reads them."""
        import mlx.core as mx

        keys, values = getattr(self.pool, "keys", None), getattr(self.pool, "values", None)
        n = self.n_blocks
        if self.pool.dtype is None or not (isinstance(keys, mx.array) and isinstance(values, mx.array)
                                           and keys.ndim >= 1 and keys.shape[0] == n
                                           and values.ndim >= 1 and values.shape[0] == n):
            return [None if kv is None else (kv[0].tobytes(), kv[1].tobytes()) for kv in self._block_rows()]
        # a memoryview of an MLX array reads it as it is (bfloat16 too), C order, in one call
        kb, vb = memoryview(keys).tobytes(), memoryview(values).tobytes()
        sk, sv = len(kb) // n, len(vb) // n
        return [(kb[b * sk:(b + 1) * sk], vb[b * sv:(b + 1) * sv]) for b in range(n)]

    def broken_invariants(self) -> tuple[str, ...]:
        return tuple(self.pool.broken_invariants())


# -- the spec side (kvspec.spec.prefix: frozen worlds, each op a new world) -------------


def spec_world(cache: dict[str, Any]) -> Any:
    """The spec's empty world for a trace's cache fields."""
    return sp.new_world(cache["block_size"], cache["n_blocks"], cache.get("window"))


def cached_items(world: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """The spec world's cached map as ``(key, ids)`` pairs in its order."""
    got = world.cached
    items = got.items() if hasattr(got, "items") else got
    return [(k, tuple(ids)) for k, ids in items]


def spec_view(world: Any) -> dict[str, Any]:
    """The spec world as a target's :meth:`PrefixTarget.observe` shows it;
    ``rows`` only for the slots of held or keyed blocks, ``reads`` for
    every live request."""
    requests = {r: {"table": list(q.table), "tokens": len(q.tokens), "live": bool(q.live)}
                for r, q in world.requests.items()}
    blocks = [(b.refcount, b.key) for b in world.blocks]
    rows = {(i, s): name for i, b in enumerate(world.blocks) if b.refcount > 0 or b.key is not None
            for s, name in enumerate(b.rows)}
    reads = {r: [row_name(q.salt, q.tokens, p) for p in range(first_position(q, world.block_size), len(q.tokens))]
             for r, q in world.requests.items() if q.live}
    return {"requests": requests, "blocks": blocks, "free": list(world.free),
            "cached": {k: list(ids) for k, ids in cached_items(world)}, "rows": rows, "reads": reads}


def first_position(q: Any, block_size: int) -> int:
    """The first position a live request's table still holds: ``B`` times
    its leading None entries (a sliding window's released blocks; 0 under
    full attention). A target reads its rows from there on."""
    nulls = 0
    while nulls < len(q.table) and q.table[nulls] is None:
        nulls += 1
    return nulls * block_size


def chain_blocks(world: Any, salt: Any, tokens: tuple[int, ...], cap: bool = True) -> int:
    """How many leading full blocks of ``tokens`` (with ``salt``) are
    cached: the hit length in blocks (``cap``: at most ``(len - 1) // B``,
    the spec's rule) or the whole-prompt match (``cap=False``). The
    machine's reach bookkeeping, not a rule the lockstep checks."""
    bs = world_block_size(world)
    keys = {k for k, _ in cached_items(world)}
    limit = (len(tokens) - 1) // bs if cap else len(tokens) // bs
    j = 0
    while j < limit and (salt, tuple(tokens[: (j + 1) * bs])) in keys:
        j += 1
    return j


def world_block_size(world: Any) -> int:
    return world.block_size


#: the ops of the prefix kind (kvtrace), besides ``expect``
PREFIX_OPS = ("admit", "decode", "free", "preempt", "resume", "lookup", "free_blocks", "reset")
#: every op a prefix trace may hold
ALL_PREFIX_OPS = (*PREFIX_OPS, "expect")
#: ops naming a request that an earlier admit must have introduced
NAMED_OPS = frozenset({"decode", "free", "preempt", "resume"})


# -- the lockstep -----------------------------------------------------------------


class PrefixLockstep:
    """The spec (``kvspec.spec.prefix``) and a :class:`PrefixTarget` in step, op
    by op (the module's doc lists what is compared). ``factory``: None (our
    ``kvspec.impl.prefix.PrefixCachePool``), a subclass of it (an injected bug),
    or ``{"target": target_factory}`` with ``target_factory(cache) ->
    PrefixTarget`` (another engine). :meth:`step` raises
    :class:`Divergence` at the first disagreement, TraceFormatError for a
    trace it cannot run."""

    spec_module = sp
    #: set by kvspec.fuzz.targets for our implementation: refusals compared by type
    #: and words (another target's by category)
    compare_messages = False
    check_inplace = True
    check_sharing = False
    #: ours: each op checked against a ``copy()`` of the pool taken before it
    #: (:meth:`check_copy`)
    check_copies = True
    impl_name = "impl"
    #: ops whose refusals the implementation words its own way (only its
    #: type is compared): none, kvspec.impl.prefix words every refusal as
    #: kvspec.spec.prefix does
    OWN_WORDED_OPS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, cache: dict[str, Any], factory: Any = None):
        self.cfg = cache
        if isinstance(factory, dict) and "target" in factory:
            self.target: Any = factory["target"](cache)
            self.ours = False
            self.impl_name = getattr(self.target, "name", "target")
        else:
            self.target = OursTarget(cache, factory)
            self.ours = True
        self.declared: dict[str, str] = dict(getattr(self.target, "declared", {}) or {})
        self.world = spec_world(cache)
        self.stats: dict[str, int] = {}
        self.refusals: list[tuple[int, str]] = []
        self.refused = False
        #: declared rules a comparison skipped (replay reports them)
        self.not_compared: set[str] = set()
        #: every request id an admit of the trace named so far
        self.known: set[str] = set()
        self._index = -1

    @classmethod
    def check_cache(cls, cache: dict[str, Any]) -> None:
        """The cache fields the schema cannot judge (TraceFormatError
        naming the field): ``window`` is null (full attention) or an integer
        >= 1."""
        w = cache.get("window")
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise TraceFormatError(f"field cache.window: {w!r}: a prefix cache's window is null (full attention) "
                                   "or the sliding window in tokens, an integer >= 1")

    def reached(self, event: str) -> None:
        self.stats[event] = self.stats.get(event, 0) + 1

    # -- the two sides -----------------------------------------------------------
    def spec_apply(self, op: dict[str, Any]) -> tuple[Any, Any]:
        """The op on the spec: (result, new world); nothing changes here."""
        return sp.apply_op(self.world, _spec_op(op))

    def target_apply(self, op: dict[str, Any]) -> Any:
        t, name = self.target, op["op"]
        if name == "admit":
            return t.admit(op["req"], tuple(op["tokens"]), op.get("salt"))
        if name == "decode":
            return t.decode(op["req"], tuple(op["tokens"]))
        if name in ("free", "preempt", "resume"):
            return getattr(t, name)(op["req"])
        if name == "lookup":
            return t.lookup(tuple(op["tokens"]), op.get("salt"))
        if name == "free_blocks":
            return t.free_blocks(tuple(op["blocks"]))
        if name == "reset":
            return t.reset()
        raise TraceFormatError(f"op {self._index} field 'op': kind prefix has no op {name!r}")

    def impl_apply(self, op: dict[str, Any]) -> Any:
        """The op on the target alone (``kvspec bench harness``'s floor)."""
        return self.target_apply(op)

    # -- what kvspec render draws (kvspec.fuzz.render.timeline) ---------------------------
    def spec_views(self) -> dict[str, list[int]]:
        """Per request the trace has admitted (``req:<id>``) its tokens, the
        rows it reads (a preempted request keeps them; a freed one has
        none)."""
        reqs = self.world.requests
        return {f"req:{r}": list(reqs[r].tokens) if r in reqs else [] for r in sorted(self.known | set(reqs))}

    def impl_views(self) -> dict[str, list[Any]]:
        """Per live request, the last token of each row name it reads."""
        got = self.target.observe().get("reads") or {}
        return {f"req:{r}": [n[1][-1] if isinstance(n, tuple) and n[1] else "?" for n in names]
                for r, names in sorted(got.items())}

    def identify(self, view: Any, mode: Any = None) -> list[Any]:
        return list(view)

    def view_mode(self, name: str) -> None:
        return None

    def spec_observables(self) -> dict[str, Any]:
        w = self.world
        return {"free": list(w.free), "refcounts": [b.refcount for b in w.blocks],
                "cached keys": len(cached_items(w))}

    # -- the step -----------------------------------------------------------------
    def step(self, index: int, op: dict[str, Any]) -> None:
        """Run ``op`` on both sides and compare (Divergence on the first
        difference; its second line names :attr:`impl_name`)."""
        try:
            self._step(index, op)
        except Divergence as d:
            if self.impl_name != "impl":
                d.labels = tuple(f"{self.impl_name} did" if lab == "impl did" else lab  # type: ignore[assignment]
                                 for lab in d.labels)
            raise

    def check_names(self, index: int, op: dict[str, Any]) -> None:
        """A request an op names must have been named by an earlier admit
        of the trace (a typo is the trace's fault, exit 2; a request freed
        since is the spec's to refuse)."""
        name = op["op"]
        if name == "admit":
            self.known.add(op["req"])
        elif (name in NAMED_OPS or (name == "expect" and "req" in op)) and op["req"] not in self.known:
            known = ", ".join(repr(r) for r in sorted(self.known)) or "none"
            raise TraceFormatError(f"op {index} field 'req': request {op['req']!r} is not admitted before this "
                                   f"op (a trace introduces each request by an admit; admitted so far: {known})")

    def _step(self, index: int, op: dict[str, Any]) -> None:
        self._index = index
        self.reached("ops")
        name = op["op"]
        if name not in ALL_PREFIX_OPS:
            raise TraceFormatError(f"op {index} field 'op': kind prefix has no op {name!r}; its ops: "
                                   f"{', '.join(ALL_PREFIX_OPS)}")
        self.check_names(index, op)
        if name == "expect":
            self.check_expect(index, op)
            return
        before = self.world
        try:
            s_result, s_world = self.spec_apply(op)
            spec_out = Outcome(result=s_result)
        except KVCacheError as exc:
            spec_out, s_world = Outcome(error=exc), None
        saved = None
        if self.ours and changes_nothing(name, spec_out):
            saved = self.target.state()
        dup = dup_state = None
        if self.ours and self.check_copies:
            dup = self.target.copy()
            dup_state = dup.state()
        try:
            impl_out = Outcome(result=self.target_apply(op))
        except TraceFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a refusal, or the target's crash (compared below)
            impl_out = Outcome(error=exc)
        self.compare_refusal(index, op, spec_out, impl_out)
        self.refused = spec_out.error is not None
        if self.refused:
            self.reached("refused " + name)
            self.refusals.append((index, str(spec_out.error)))
        if op.get("error") is True and spec_out.error is None:
            raise Divergence(index, op, "trace expects a refusal", spec_out.describe(), "a refusal",
                             ("spec says", "trace expects"))
        if op.get("error") is False and spec_out.error is not None:
            raise Divergence(index, op, "trace expects success", spec_out.describe(), "success",
                             ("spec says", "trace expects"))
        if s_world is not None:
            self.world = s_world
            if impl_out.error is None:
                self.compare_result(index, op, spec_out.result, impl_out.result)
            self.check_value(index, op, spec_out.result)
        self.compare_view(index, op)
        if saved is not None:
            self.compare_unchanged(index, op, saved)
        if dup is not None:
            self.check_copy(index, op, dup, dup_state, impl_out)
        if self.ours:
            broken = self.target.broken_invariants()
            if broken:
                raise Divergence(index, op, "the pool's own invariants broken (rule 'pool invariants')", "none",
                                 "; ".join(broken))
        broken = tuple(sp.broken_invariants(self.world))
        if broken:
            raise AssertionError(f"prefix lockstep: op {index}: the spec's world breaks its invariants: "
                                 f"{'; '.join(broken)}")
        self.note(op, before, spec_out)

    def _diverge(self, index: int, op: dict[str, Any], field: str, rule: str, spec: Any, impl: Any) -> Divergence:
        return Divergence(index, op, f"{field} differs (rule {rule!r}: {RULES[rule]})", spec, impl)

    def compare_refusal(self, index: int, op: dict[str, Any], spec_out: Outcome, impl_out: Outcome) -> None:
        """Both refuse or neither; ours with the spec's type (and, with
        :attr:`compare_messages`, words), another target in the same
        category (kvspec.fuzz.protocol.refusal_category; its own exception types
        through its ``refusal_categories``). A target that declares
        ``"<op> refusal"`` may do nothing where the spec refuses (the views
        are compared after it all the same)."""
        s_err, i_err = spec_out.error, impl_out.error
        if s_err is None and i_err is None:
            return
        rule = f"{op['op']} refusal"
        if s_err is not None and i_err is None and rule in self.declared:
            self.reached(f"declared: {rule}")
            self.not_compared.add(rule)
            return
        what = f"refusal differs (rule 'refusal': {RULES['refusal']})"
        if (s_err is None) != (i_err is None):
            raise Divergence(index, op, what, spec_out.describe(), impl_out.describe())
        if self.ours:
            if type(s_err) is not type(i_err):
                raise Divergence(index, op, what, spec_out.describe(), impl_out.describe())
            if self.compare_messages and str(s_err) != str(i_err) and op["op"] not in self.OWN_WORDED_OPS:
                raise Divergence(index, op, "refusal message differs (rule 'refusal': the spec's words)",
                                 spec_out.describe(), impl_out.describe())
            return
        cats = getattr(self.target, "refusal_categories", None)
        if refusal_category(s_err) != refusal_category(i_err, cats):  # type: ignore[arg-type]
            raise Divergence(index, op, "refusal category differs (rule 'refusal')", spec_out.describe(),
                             f"{impl_out.describe()} ({refusal_category(i_err, cats) or 'not a refusal: a crash'})")

    def compare_result(self, index: int, op: dict[str, Any], spec: Any, impl: Any) -> None:
        """The op's result: an admit's or a resume's fields in turn
        (admitted, hit tokens, table), a decode's, reset's or lookup's
        value, nothing for the rest."""
        name = op["op"]
        if name in ("admit", "resume"):
            s_adm, s_hit, s_table = admit_fields(spec)
            try:
                i_adm, i_hit, i_table = admit_fields(impl)
            except (AttributeError, KeyError, TypeError) as exc:
                raise Divergence(index, op, f"{name} result unreadable (fields admitted, hit_tokens, table)",
                                 result_json(name, spec), f"{impl!r} ({error_text(exc)})") from None
            for field, rule, s, i in (("admitted", "exhaustion", s_adm, i_adm), ("hit tokens", "hit length", s_hit, i_hit),
                                      ("table", "block table", s_table, i_table)):
                if field == "table":
                    same = len(s) == len(i) and all(same_value(a, b) for a, b in zip(s, i))
                else:
                    same = same_value(s, i)
                if not same:
                    raise self._diverge(index, op, f"{name} result: {field}", rule, show(s), show(i))
            return
        rule = {"decode": "decode room", "reset": "reset", "lookup": "hit length"}.get(name)
        if rule is None:
            return
        if not same_value(spec, impl):
            raise self._diverge(index, op, f"{name} result", rule, show(spec), show(impl))

    def check_value(self, index: int, op: dict[str, Any], result: Any) -> None:
        """The trace's own check on the spec: an op's ``returns``."""
        if "returns" in op:
            got = result_json(op["op"], result)
            if got != op["returns"]:
                raise Divergence(index, op, "trace's 'returns' check fails", json.dumps(got), json.dumps(op["returns"]),
                                 ("spec says", "trace expects"))

    def observe(self, index: int, op: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.target.observe()
        except Exception as exc:  # noqa: BLE001 - a target that cannot show its state is the divergence
            raise Divergence(index, op, "observe() raised", "the state", error_text(exc)) from None

    def compare_view(self, index: int, op: dict[str, Any]) -> None:
        """The spec's view against the target's, field by field in
        :data:`VIEW_FIELDS` order; the first difference is the divergence."""
        want, got = spec_view(self.world), self.observe(index, op)
        skip = self.declared

        def check(field: str, rule: str, s: Any, i: Any) -> None:
            if rule in skip:
                self.not_compared.add(rule)
                return
            if s != i:
                raise self._diverge(index, op, field, rule, show(s), show(i))

        # the dtypes a target reports (ours: its slabs, block_rows and fetch) against the cache's
        if got.get("dtypes") and self.cfg.get("dtype"):
            for path, names in sorted(got["dtypes"].items()):
                check(f"dtype of {path}", "dtype", [self.cfg["dtype"]], list(names))
        # requests
        s_reqs, i_reqs = want["requests"], dict(got.get("requests") or {})
        check("requests known", "requests", sorted(s_reqs), sorted(i_reqs))
        for r in sorted(s_reqs):
            s, i = s_reqs[r], dict(i_reqs[r])
            check(f"request {r!r} live", "requests", s["live"], bool(i.get("live")))
            check(f"request {r!r} tokens", "requests", s["tokens"], i.get("tokens"))
            check(f"request {r!r} table", "block table", s["table"], list(i.get("table", ())))
        # blocks
        s_blocks, i_blocks = want["blocks"], list(got.get("blocks") or [])
        check("number of blocks", "refcount", len(s_blocks), len(i_blocks))
        for b, ((s_rc, s_key), (i_rc, i_key)) in enumerate(zip(s_blocks, i_blocks)):
            check(f"block {b} refcount", "refcount", s_rc, i_rc)
            check(f"block {b} key", "key", s_key, norm_name(i_key))
        # free queue, cached map
        check("free queue (front to back)", "free queue", want["free"], list(got.get("free") or []))
        i_cached = {norm_name(k): list(v) for k, v in (got.get("cached") or {}).items()}
        check("cached keys", "cached map", sorted(want["cached"], key=repr), sorted(i_cached, key=repr))
        for k in sorted(want["cached"], key=repr):
            check(f"cached[{k!r}]", "cached map", want["cached"][k], i_cached[k])
        # rows: every slot the spec says is written, of a held or keyed block
        i_rows = got.get("rows") or {}
        for (b, s), name in sorted(want["rows"].items()):
            if name is not None:
                check(f"block {b} slot {s} row", "rows", name, norm_name(i_rows.get((b, s))))
        # reads through the target's own read path, where it has one
        if "reads" in got and got["reads"] is not None:
            check("requests read (live)", "reads", sorted(want["reads"]), sorted(got["reads"]))
            for r in sorted(want["reads"]):
                have = [norm_name(n) for n in got["reads"].get(r, [])]
                s_names = want["reads"][r]
                if have != s_names:
                    at = next((p for p, (a, b) in enumerate(zip(s_names, have)) if a != b), min(len(s_names), len(have)))
                    check(f"request {r!r} read at position {at} (of {len(s_names)})", "reads",
                          s_names[at] if at < len(s_names) else "no row", have[at] if at < len(have) else "no row")

    def check_copy(self, index: int, op: dict[str, Any], dup: Any, dup_state: dict[str, Any], out: Outcome) -> None:
        """Ours: ``dup``, the pool's ``copy()`` taken before the op, is as it
        was after the op ran on the original (nothing shared: its slabs,
        refcounts, keys, cached map, free queue, requests); at every odd op
        the op then runs on ``dup`` too, which must end in the original's
        state, and the lockstep goes on with ``dup`` (the spec's world is a
        value: both continue from it)."""
        now = dup.state()
        for part, was in dup_state.items():
            if was != now[part]:
                shown = ("bytes changed" if part == "slabs" else show(was),
                         "bytes changed" if part == "slabs" else show(now[part]))
                raise self._diverge(index, op, f"a copy's {part} after an op on its original", "copy", *shown)
        if index % 2 == 0:
            return
        original = self.target
        try:
            self.target = dup
            try:
                self.target_apply(op)
                raised = None
            except Exception as exc:  # noqa: BLE001 - compared with the original's outcome
                raised = type(exc).__name__
        finally:
            self.target = original
        if raised != (None if out.error is None else type(out.error).__name__):
            raise self._diverge(index, op, "the op on a copy", "copy", out.describe(), str(raised))
        theirs, ours = dup.state(), original.state()
        for part, want in ours.items():
            if want != theirs[part]:
                shown = ("bytes differ" if part == "slabs" else show(want),
                         "bytes differ" if part == "slabs" else show(theirs[part]))
                raise self._diverge(index, op, f"a copy's {part} after the same op as its original", "copy", *shown)
        self.target = dup

    def compare_unchanged(self, index: int, op: dict[str, Any], saved: dict[str, Any]) -> None:
        """Ours: an op the spec says changes nothing left every part of the
        pool's state as it was (:meth:`OursTarget.state`)."""
        now = self.target.state()
        for part, was in saved.items():
            if was != now[part]:
                shown = ("bytes changed" if part == "slabs" else show(was),
                         "bytes changed" if part == "slabs" else show(now[part]))
                raise self._diverge(index, op, f"the pool's {part} after an op that changes nothing",
                                    "nothing changed", *shown)

    def check_expect(self, index: int, op: dict[str, Any]) -> None:
        """``expect`` (the trace's own assertion): ``req`` with ``window``
        (the request's tokens: on the target, the rows a live request reads
        through its table, from :func:`first_position` on, are named by
        them) and/or ``table`` (its block
        table); ``free`` (the free queue, front to back). Checked on the
        spec, then on the target."""
        view = None
        if "req" in op:
            q = self.world.requests.get(op["req"])
            if q is None:
                raise Divergence(index, op, "trace's 'expect' fails on the spec", f"request {op['req']!r} unknown",
                                 "a known request", ("spec says", "trace expects"))
            view = self.observe(index, op)
            got = dict((view.get("requests") or {}).get(op["req"], {}))
            if "window" in op:
                if list(q.tokens) != list(op["window"]):
                    raise Divergence(index, op, "trace's 'expect' (window) fails on the spec", list(q.tokens),
                                     op["window"], ("spec says", "trace expects"))
                if got.get("tokens") != len(q.tokens):
                    raise Divergence(index, op, "trace's 'expect' (window) fails on the implementation",
                                     f"{len(q.tokens)} tokens", f"{got.get('tokens')} tokens")
                if q.live:  # from the first position its table holds (a sliding window releases the rest)
                    bs = self.cfg["block_size"]
                    first = first_position(q, bs)
                    want = [row_name(q.salt, q.tokens, p) for p in range(first, len(q.tokens))]
                    table, rows = list(got.get("table", ())), view.get("rows") or {}
                    have = [norm_name(rows.get((table[p // bs], p % bs))) if p // bs < len(table) else None
                            for p in range(first, len(q.tokens))]
                    if have != want:
                        raise Divergence(index, op, "trace's 'expect' (window) fails on the implementation: rows read "
                                         "through its table", show(want), show(have))
            if "table" in op:
                if list(q.table) != list(op["table"]):
                    raise Divergence(index, op, "trace's 'expect' (table) fails on the spec", list(q.table),
                                     op["table"], ("spec says", "trace expects"))
                if list(got.get("table", ())) != list(op["table"]):
                    raise Divergence(index, op, "trace's 'expect' (table) fails on the implementation", op["table"],
                                     list(got.get("table", ())))
        if "free" in op:
            if list(self.world.free) != list(op["free"]):
                raise Divergence(index, op, "trace's 'expect' (free) fails on the spec", list(self.world.free),
                                 op["free"], ("spec says", "trace expects"))
            view = view or self.observe(index, op)
            if list(view.get("free") or []) != list(op["free"]):
                raise Divergence(index, op, "trace's 'expect' (free) fails on the implementation", op["free"],
                                 list(view.get("free") or []))

    # -- reach ---------------------------------------------------------------------
    def note(self, op: dict[str, Any], before: Any, out: Outcome) -> None:
        """The events a campaign counts (``must_reach`` in fuzz/kinds.py)."""
        name = op["op"]
        if out.error is not None:
            if name == "free_blocks":
                self.reached("free_blocks refused")
            return
        after = self.world
        if name in ("admit", "resume", "lookup"):
            if name == "resume":
                q = before.requests[op["req"]]
                tokens, salt = tuple(q.tokens), q.salt
            else:
                tokens, salt = tuple(op["tokens"]), op.get("salt")
            others = [s for s in (None, 0, 1) if s != salt]
            if tokens and any(chain_blocks(before, s, tokens) > chain_blocks(before, salt, tokens) for s in others):
                self.reached("salted miss")
        if name in ("admit", "resume"):
            admitted, hit, table = admit_fields(out.result)
            if not admitted:
                self.reached("admit refused")
            else:
                self.reached("admits")
                if hit:
                    self.reached("hits")
                    bs = world_block_size(before)
                    if hit >= 2 * bs:
                        self.reached("hit of two blocks or more")
                    if salt is not None:
                        self.reached("salted hit")
                    if getattr(before, "window", None) is None and hit // bs < (len(tokens) - 1) // bs:
                        self.reached("chain stopped by a miss after a hit")
                    if name == "resume":
                        self.reached("preempt then resume hit")
                    bs = world_block_size(before)
                    if any(b is not None and before.blocks[b].refcount == 0 for b in table[: hit // bs]):
                        self.reached("cached-free block hit")
                    if getattr(before, "window", None) is not None:
                        self.reached("windowed hits")
                        if chain_blocks(before, salt, tokens) < hit // bs:
                            self.reached("windowed hit past a gap")
                if chain_blocks(before, salt, tokens, cap=False) * world_block_size(before) > hit:
                    self.reached("whole-prompt hit capped")
        elif name == "decode":
            self.reached("decodes" if out.result else "decode refused")
            q0, q1 = before.requests.get(op["req"]), after.requests.get(op["req"])
            if out.result and q0 is not None and q1 is not None and world_block_size(before) > 1 and \
                    len(q1.table) - len(q0.table) >= 2:
                self.reached("decode of two new blocks")
            if out.result and q0 is not None and q1 is not None and \
                    sum(b is None for b in q1.table) > sum(b is None for b in q0.table):
                self.reached("window releases")
        elif name == "reset":
            self.reached("reset" if out.result else "reset refused")
        elif name == "lookup":
            self.reached("lookup hits" if out.result else "lookup misses")
        else:
            self.reached(name)
        if name in ("admit", "decode", "resume"):
            gone = [b for b, blk in enumerate(before.blocks)
                    if blk.key is not None and blk.refcount == 0 and after.blocks[b].key != blk.key]
            if gone:
                self.reached("evictions")
                if any(len(before.blocks[b].key[1]) > world_block_size(before) for b in gone):
                    self.reached("eviction of a non-root block")
        if any(len(ids) > 1 for _, ids in cached_items(after)):
            self.reached("duplicate keys")

    # -- kvtrace annotations (kvspec.fuzz.campaign.annotate) --------------------------------
    def predictions(self, op: dict[str, Any], result: Any) -> dict[str, Any]:
        if op["op"] in ("admit", "resume", "decode", "lookup", "reset"):
            return {"returns": result_json(op["op"], result)}
        return {}

    def expect_ops(self) -> list[dict[str, Any]]:
        """``expect`` ops pinning every request's tokens and table, and the
        free queue."""
        out: list[dict[str, Any]] = []
        for r, q in sorted(self.world.requests.items()):
            out.append({"op": "expect", "req": r, "window": list(q.tokens), "table": list(q.table)})
        out.append({"op": "expect", "free": list(self.world.free)})
        return out


def changes_nothing(name: str, out: Outcome) -> bool:
    """Whether the spec says the op changed nothing: refused, an admit or
    resume not admitted, a decode without room, a reset refused, a lookup."""
    if out.error is not None or name == "lookup":
        return True
    if name in ("admit", "resume"):
        return not admit_fields(out.result)[0]
    if name in ("decode", "reset"):
        return out.result is False
    return False


def _spec_op(op: dict[str, Any]) -> dict[str, Any]:
    """An op as ``kvspec.spec.prefix.apply_op`` takes it: token and block lists as tuples."""
    out = dict(op)
    for k in ("tokens", "blocks"):
        if k in out and isinstance(out[k], list):
            out[k] = tuple(out[k])
    return out


# -- the state machine ----------------------------------------------------------

#: request ids the machine uses (at most :data:`MAX_LIVE` live at once)
NAMES = ("a", "b", "c", "d", "e")
MAX_LIVE = 3
#: token ids the machine draws (a small vocabulary: decodes repeat prompts' tokens)
VOCAB = 4


class PrefixMachine(KVMachine):
    """A prefix cache's life, biased to its edges: block size 1 to 4, 4 to
    12 blocks, full attention or a sliding window of 1 to 5 tokens (small
    ones most often), 2 or 3 base prompts sharing a root (one sometimes a prefix of
    another, lengths often whole blocks); at most 3 live requests admitting
    a base prompt, a prefix of one or one a token longer, salted sometimes;
    decodes of 1, 2, B, B + 1 or 2B + 1 tokens (often a prompt's own continuation: duplicate
    keys), frees (a double free refused), preempt and resume, lookups,
    resets (refused while blocks are held), free_blocks probes drawn only
    as calls the spec refuses; and composite rules that reach the rare
    edges within a few examples: a prompt shared by two requests, a freed
    prompt hit again from the free queue, a preempted request resumed,
    exhaustion of admits and decodes, a reset after everything is
    released, and a salted admit of a cached prompt."""

    kind = "prefix"
    # the rules of the one-sequence kinds: not ops of a prefix cache
    fetch = hold = release_hold = trim = trim_to = snapshot = restore = drop = branch = misuse_name = None  # type: ignore[assignment]

    def setup(self, **cfg: Any) -> None:
        from kvspec.fuzz.kinds import get as kind_entry

        type(self).runs += 1
        entry = kind_entry(self.kind, self.mode)
        self.cfg = {**entry.defaults(), "kind": self.kind, "mode": self.mode, "inplace": self.inplace, **cfg,
                    **self.fixed}
        if self.make_lockstep is None:
            raise TypeError(f"{type(self).__name__}: build machines with kvspec.fuzz.campaign.machine_for")
        self.lock = self.make_lockstep(self.cfg, self.factories, self.check_inplace, self.target)
        self.without = entry.without

    @initialize(data=st.data())
    def init(self, data: st.DataObject) -> None:
        bs = data.draw(st.integers(1, 4), label="block_size")
        cfg: dict[str, Any] = {
            "block_size": bs,
            "n_blocks": data.draw(st.integers(4, 12), label="n_blocks"),
            "kv_heads": data.draw(st.integers(1, 2), label="kv_heads"),
            "head_dim": data.draw(st.sampled_from([8, 8, 16]), label="head_dim"),
            "dtype": data.draw(st.sampled_from(["float16", "float16", "bfloat16", "float32"]), label="dtype"),
            # None: full attention; a sliding window of 1 to 5 tokens, small ones most often
            "window": data.draw(st.sampled_from([None, None, None, 1, 2, 2, 3, 3, 4, 5]), label="window"),
        }
        self.setup(**cfg)
        bs = self.cfg["block_size"]
        # a root every prompt shares, whole blocks long or a token past them
        root = self.draw_tokens(data, data.draw(st.sampled_from([bs, bs, 2 * bs, bs + 1, 1]), label="root"))
        prompts = [root + self.draw_tokens(data, data.draw(st.sampled_from([bs, 0, 1, 2 * bs]), label="tail"))]
        for i in range(1, data.draw(st.integers(2, 3), label="prompts")):
            if data.draw(st.booleans(), label="extends"):  # a longer prompt through the first
                prompts.append(prompts[0] + self.draw_tokens(data, data.draw(st.sampled_from([bs, 1]), label="more")))
            else:  # a sibling: the root, then its own token
                tail = self.draw_tokens(data, data.draw(st.sampled_from([bs - 1, bs, 2 * bs - 1]), label="tail"))
                prompts.append(root + [(root[-1] + i) % VOCAB] + tail)
        self.prompts = prompts
        #: every request id admitted so far (a freed one may be freed again: refused)
        self.admitted: set[str] = set()

    # -- what the spec holds now ---------------------------------------------------
    @property
    def world(self) -> Any:
        return self.lock.world

    @property
    def bs(self) -> int:
        return self.cfg["block_size"]

    def live(self) -> list[str]:
        return sorted(r for r, q in self.world.requests.items() if q.live)

    def preempted(self) -> list[str]:
        return sorted(r for r, q in self.world.requests.items() if not q.live)

    def idle(self) -> list[str]:
        """Request ids free to admit (unknown to the spec)."""
        return [r for r in NAMES if r not in self.world.requests]

    def draw_tokens(self, data: st.DataObject, n: int) -> list[int]:
        return [data.draw(st.integers(0, VOCAB - 1), label="token") for _ in range(n)]

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        """A base prompt whole (most often), cut to whole blocks or to a
        token past them, or a token longer."""
        p = list(self.prompts[data.draw(st.integers(0, len(self.prompts) - 1), label="prompt")])
        how = data.draw(st.sampled_from(["whole", "whole", "blocks", "longer", "blocks+1"]), label="cut")
        if how == "blocks" and len(p) > self.bs:
            p = p[: (len(p) // self.bs) * self.bs]
        elif how == "blocks+1" and len(p) > self.bs + 1:
            p = p[: (len(p) - 1) // self.bs * self.bs + 1]
        elif how == "longer":
            p = p + [data.draw(st.integers(0, VOCAB - 1), label="token")]
        return p

    def draw_salt(self, data: st.DataObject) -> Any:
        return data.draw(st.sampled_from([None, None, None, None, 0, 1]), label="salt")

    def admit_op(self, req: str, tokens: list[int], salt: Any = None) -> None:
        self.admitted.add(req)
        op: dict[str, Any] = {"op": "admit", "req": req, "tokens": list(tokens)}
        if salt is not None:
            op["salt"] = salt
        self.do(op)

    def continuation(self, req: str, n: int, data: st.DataObject) -> list[int]:
        """``n`` tokens for a live request: its base prompt's next tokens
        where it follows one (two requests decoding alike: duplicate keys),
        else drawn."""
        q = self.world.requests[req]
        toks = list(q.tokens)
        for p in self.prompts:
            if len(p) > len(toks) and p[: len(toks)] == toks:
                return (p[len(toks):] + [0] * n)[:n]
        return self.draw_tokens(data, n)

    # -- rules ------------------------------------------------------------------
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """A new request (a prompt, salted sometimes); with 3 live, an
        admit of a live one (refused); now and then an empty prompt
        (refused)."""
        idle = self.idle()
        if len(self.live()) >= MAX_LIVE or not idle:
            if self.live():
                self.admit_op(self.live()[0], self.draw_prompt(data))
            return
        req = idle[0]
        tokens = self.draw_prompt(data)
        if data.draw(st.integers(0, 15), label="empty") == 15:
            tokens = []
        self.admit_op(req, tokens, self.draw_salt(data))

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:  # type: ignore[override]
        """1, 2, B, B + 1 or 2B + 1 tokens for a live request (one block
        boundary crossed, or two; its prompt's continuation most often)."""
        live = self.live()
        if not live:
            return
        req = live[data.draw(st.integers(0, len(live) - 1), label="req")]
        bs = self.bs
        n = data.draw(st.sampled_from([1, 2, bs, bs + 1, 2 * bs + 1]), label="n")
        if data.draw(st.booleans(), label="drawn"):
            tokens = self.draw_tokens(data, n)
        else:
            tokens = self.continuation(req, n, data)
        self.do({"op": "decode", "req": req, "tokens": tokens})

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """Free a live request; sometimes one freed before (refused)."""
        live = self.live()
        gone = sorted(self.admitted - set(self.world.requests))
        if gone and (not live or data.draw(st.integers(0, 5), label="double") == 0):
            self.do({"op": "free", "req": gone[0]})
        elif live:
            self.do({"op": "free", "req": live[data.draw(st.integers(0, len(live) - 1), label="req")]})

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        live = self.live()
        if live:
            self.do({"op": "preempt", "req": live[data.draw(st.integers(0, len(live) - 1), label="req")]})

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """Resume a preempted request; sometimes a live one (refused)."""
        waiting, live = self.preempted(), self.live()
        if waiting and len(live) < MAX_LIVE:
            self.do({"op": "resume", "req": waiting[data.draw(st.integers(0, len(waiting) - 1), label="req")]})
        elif live:
            self.do({"op": "resume", "req": live[0]})

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        op: dict[str, Any] = {"op": "lookup", "tokens": self.draw_prompt(data)}
        salt = self.draw_salt(data)
        if salt is not None:
            op["salt"] = salt
        self.do(op)

    @rule()
    def reset(self) -> None:
        self.do({"op": "reset"})

    @rule(data=st.data())
    def probe_free_blocks(self, data: st.DataObject) -> None:
        """The pool's own release, only as calls the spec refuses: a held
        block twice, a block in the free queue, an id out of range."""
        held = sorted({b for r in self.live() for b in self.world.requests[r].table if b is not None})
        free = list(self.world.free)
        how = data.draw(st.sampled_from(["twice", "free", "out of range"]), label="how")
        if how == "twice" and held:
            b = held[data.draw(st.integers(0, len(held) - 1), label="block")]
            self.do({"op": "free_blocks", "blocks": [b, b]})
        elif how == "free" and free:
            self.do({"op": "free_blocks", "blocks": [free[data.draw(st.integers(0, len(free) - 1), label="block")]]})
        else:
            self.do({"op": "free_blocks", "blocks": [self.cfg["n_blocks"]]})

    # -- composite rules: the rare edges within a few examples -----------------------
    def _make_room(self, want: int = 1) -> bool:
        """Free live requests (the first ones) until ``want`` more may go
        live; False when that cannot be done (a preempted request that no
        resume admits: under a sliding window a request may grow past the
        pool, and its resume needs every block of its tokens)."""
        while self.live() and (len(self.live()) + want > MAX_LIVE or len(self.idle()) < want):
            self.do({"op": "free", "req": self.live()[0]})
        while len(self.idle()) < want and self.preempted():
            waiting = self.preempted()[0]
            self.do({"op": "resume", "req": waiting})
            if not self.world.requests[waiting].live:
                return False
            self.do({"op": "free", "req": waiting})
        return len(self.idle()) >= want

    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        """One prompt admitted by two requests: the second hits the first's
        full blocks (a whole-block prompt: capped one block short, its last
        block cached twice)."""
        if not self._make_room(2):
            return
        tokens = self.draw_prompt(data)
        salt = self.draw_salt(data)
        first, second = self.idle()[:2]
        self.admit_op(first, tokens, salt)
        self.admit_op(second, tokens, salt)

    @rule(data=st.data())
    def churn(self, data: st.DataObject) -> None:
        """A prompt admitted and freed (its full blocks cached-free at the
        back of the queue), then another prompt and the first again: the
        second evicts from the front, the third hits what is left."""
        if not self._make_room(1):
            return
        a = self.draw_prompt(data)
        req = self.idle()[0]
        self.admit_op(req, a)
        if req in self.world.requests:
            self.do({"op": "free", "req": req})
        self.admit_op(req, self.draw_prompt(data))
        if req in self.world.requests:
            self.do({"op": "free", "req": req})
        self.admit_op(req, a)

    @rule(data=st.data())
    def preempt_resume(self, data: st.DataObject) -> None:
        """A request preempted (its blocks released, cached-free) and
        resumed: it hits its own blocks, unless another admit took them."""
        if not self._make_room(1):
            return
        req = self.idle()[0]
        self.admit_op(req, self.draw_prompt(data))
        if req not in self.world.requests:
            return
        if self.world.requests[req].live:
            self.do({"op": "decode", "req": req, "tokens": self.continuation(req, 1, data)})
        self.do({"op": "preempt", "req": req})
        if data.draw(st.booleans(), label="between") and self.idle():
            other = self.idle()[0]
            self.admit_op(other, self.draw_prompt(data))
        self.do({"op": "resume", "req": req})

    @rule(data=st.data())
    def exhaust(self, data: st.DataObject) -> None:
        """Admits of the longest prompt until one is not admitted (or 3
        are live), then decodes of a live request until one finds no
        room."""
        longest = max(self.prompts, key=len)
        salt = self.draw_salt(data)
        for _ in range(MAX_LIVE):
            if len(self.live()) >= MAX_LIVE or not self.idle():
                break
            req = self.idle()[0]
            self.admit_op(req, longest + self.draw_tokens(data, 1), salt)
            if req not in self.world.requests:  # not admitted
                break
        live = self.live()
        if not live:
            return
        req = live[-1]
        for _ in range(self.cfg["n_blocks"] * self.bs + 1):
            seen = self.lock.stats.get("decode refused", 0)
            self.do({"op": "decode", "req": req, "tokens": [data.draw(st.integers(0, VOCAB - 1), label="token")]})
            if self.lock.stats.get("decode refused", 0) > seen or not self.world.requests[req].live:
                break

    @rule(data=st.data())
    def reset_all(self, data: st.DataObject) -> None:
        """A reset while blocks are held (refused), then every live request
        freed or preempted and a reset (every key dropped)."""
        self.do({"op": "reset"})
        for req in self.live():
            self.do({"op": "preempt" if data.draw(st.booleans(), label="preempt") else "free", "req": req})
        self.do({"op": "reset"})

    @rule(data=st.data())
    def salted(self, data: st.DataObject) -> None:
        """A prompt admitted without a salt, then looked up and admitted
        with one (a miss: the extra key is part of every block's key)."""
        if not self._make_room(2):
            return
        tokens = self.draw_prompt(data)
        first, second = self.idle()[:2]
        self.admit_op(first, tokens)
        salt = data.draw(st.sampled_from([0, 1]), label="salt")
        self.do({"op": "lookup", "tokens": list(tokens), "salt": salt})
        self.admit_op(second, tokens, salt)

    @precondition(lambda self: self.lock is not None and len(self.world.requests) > 0)
    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        """The trace's own assertion on a request (its tokens and table)
        or on the free queue, as a recorded trace carries them."""
        reqs = sorted(self.world.requests)
        r = reqs[data.draw(st.integers(0, len(reqs) - 1), label="req")]
        q = self.world.requests[r]
        self.do({"op": "expect", "req": r, "window": list(q.tokens), "table": list(q.table)})
        self.do({"op": "expect", "free": list(self.world.free)})


def target_factories(target_factory: Any) -> dict[str, Any] | None:
    """``kvspec.fuzz.replay.make_lockstep``'s factories for a prefix target: None
    (ours), a subclass of ``kvspec.impl.prefix.PrefixCachePool`` (an injected bug)
    or a callable ``cache -> PrefixTarget`` (another engine)."""
    if target_factory is None:
        return None
    if isinstance(target_factory, type) and issubclass(target_factory, _impl().PrefixCachePool):
        return {"prefix": target_factory}
    return {"prefix": {"target": target_factory}}
