"""kvspec.impl.cells: CellCache against kvspec.spec.cells (each op, each refusal, and a
seeded differential loop with rows named by (token, pos)), the RoPE
re-rotation of shifted K rows (lazy, accumulated), bfloat16 stored exactly,
refusals that change nothing, snapshots that alias nothing."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl.cells import CellCache, CellsSnapshot, rope_shift, to_host
from kvspec.spec import cells as spec
from kvspec.spec.errors import InvalidArgumentError, KVCacheError

H, D = 2, 8
_NP = {"float16": np.float16, "float32": np.float32}


@functools.cache
def raw_row(token: int) -> np.ndarray:
    """The un-rotated K (and V) row of ``token``: ``(H, D)`` float32."""
    return np.random.default_rng(1000 + token).standard_normal((H, D)).astype(np.float32)


@functools.cache
def k_ref(token: int, pos: int) -> np.ndarray:
    """The K row of ``token`` at ``pos``, float32 (rotated in float32)."""
    return np.array(rope_shift(mx.array(raw_row(token)[None]), [pos]))[0]


def rows(tokens, pos0: int, dtype: str = "float32") -> tuple[mx.array, mx.array]:
    """K rows rotated for positions ``pos0..``, V rows un-rotated, in ``dtype``."""
    dt = getattr(mx, dtype)
    raw = mx.array(np.stack([raw_row(t) for t in tokens])).astype(dt)
    return rope_shift(raw, list(range(pos0, pos0 + len(tokens)))), raw


class Named:
    """A CellCache driven as a CellsTarget: tokens in, rows named back."""

    def __init__(self, dtype: str = "float32", tol: float = 1e-4, **cfg):
        self.c = CellCache(kv_heads=H, head_dim=D, dtype=dtype, **cfg)
        self.dtype, self.tol = dtype, tol
        self.tokens: set[int] = set()
        self.stores = self.c.stores

    def decode(self, seqs, tokens, pos0) -> bool:
        self.tokens |= set(tokens)
        k, v = rows(tokens, max(pos0, 0), self.dtype)
        return self.c.decode(seqs, k, v, pos0)

    def __getattr__(self, name: str):
        return getattr(self.c, name)  # the position ops, save and restore take the same arguments

    def name_k(self, k: np.ndarray, pos: int):
        k = k.astype(np.float32)
        for t in self.tokens:
            ref = k_ref(t, pos)
            if np.max(np.abs(k - ref)) <= self.tol * max(1.0, float(np.max(np.abs(ref)))):
                return (t, pos)
        return None

    def name_v(self, v: np.ndarray):
        for t in self.tokens:
            if np.array_equal(v, raw_row(t).astype(_NP[self.dtype])):
                return t
        return None

    def observe(self):
        return {s: [(p, ss, self.name_k(k, p), self.name_v(v)) for p, ss, k, v in self.c.cells(s)]
                for s in self.stores}

    def observe_snapshot(self, snap: CellsSnapshot):
        out = {}
        for s in snap.stores:
            pos, k, v = snap.cells[s]
            out[s] = [(int(p), self.name_k(k[i], int(p)), self.name_v(v[i])) for i, p in enumerate(pos)]
        return out


def key(obs_cell):
    p, ss, k, v = obs_cell
    return (p, sorted(ss), k, v)


def same_store(a, b):
    return sorted(map(key, a)) == sorted(map(key, b))


# -- rope_shift ------------------------------------------------------------------------------


def test_rope_shift_is_mlx_rotate_half_rope():
    # an independent reference: MLX's own RoPE kernel, rotate-half (traditional=False), at offset p
    x = mx.array(np.random.default_rng(0).standard_normal((1, H, 1, D)).astype(np.float32))
    for p in (1, 5, 123):
        ref = mx.fast.rope(x, D, traditional=False, base=10000.0, scale=1.0, offset=p)[0, :, 0]
        assert float(mx.max(mx.abs(rope_shift(x[0, :, 0][None], [p])[0] - ref))) < 1e-5


def test_rope_shift_composes_and_rejects_bad_input():
    raw = mx.array(raw_row(3)[None])
    a = rope_shift(rope_shift(raw, [5]), [-2])
    assert np.allclose(np.array(a), k_ref(3, 3), atol=1e-5)
    assert np.allclose(np.array(rope_shift(raw, [0])), raw_row(3), atol=0)
    # V-like norm kept: a rotation
    assert np.allclose(np.linalg.norm(np.array(rope_shift(raw, [7]))), np.linalg.norm(raw_row(3)), rtol=1e-5)
    with pytest.raises(InvalidArgumentError, match="one integer per row"):
        rope_shift(raw, [1, 2])
    with pytest.raises(InvalidArgumentError, match="head_dim must be even"):
        rope_shift(mx.zeros((1, 3)), [1])


# -- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"n_cells": 0}, "n_cells must be >= 1"),
    ({"head_dim": 7}, "head_dim must be even"),
    ({"dtype": "int8"}, "dtype must be float16, bfloat16 or float32"),
    ({"stores": ("window", "full")}, "stores must be one of"),
    ({"stores": ("full", "window")}, "window must be an integer >= 1"),
    ({"stores": ("window",), "window": 0}, "window must be >= 1"),
    ({"window": 3}, "window must be None without a window store"),
    ({"n_seq": True}, "n_seq must be an integer"),
    ({"rope_base": 0}, "rope_base must be a number > 0"),
])
def test_construction_refusals(kw, match):
    args = {"n_cells": 4, "kv_heads": H, "head_dim": D, **kw}
    with pytest.raises(InvalidArgumentError, match=match):
        CellCache(**args)


def test_nbytes():
    assert CellCache(5, H, D, "float16", window=2, stores=("full", "window")).nbytes == 2 * 2 * 5 * H * D * 2
    assert CellCache(5, H, D, "float32").nbytes == 2 * 5 * H * D * 4


# -- each op against the spec ----------------------------------------------------------------


def both(**cfg):
    return Named(**cfg), spec.CellsMemory(**cfg)


def agree(t: Named, m, ops):
    """Run ``ops`` (method name, args) on both; results and refusal classes
    equal, then observations, pos_min/pos_max equal after each."""
    for name, *args in ops:
        res = []
        for side in (t, m):
            try:
                res.append(("ok", getattr(side, name)(*args)))
            except KVCacheError as e:
                res.append((type(e).__name__, None))
        assert res[0][0] == res[1][0], (name, args, res)
        if name not in ("save",):
            assert res[0] == res[1], (name, args, res)
        ot, om = t.observe(), m.observe()
        for s in t.stores:
            assert same_store(ot[s], om[s]), (name, args, s, ot[s], om[s])
        for s in range(m.config.n_seq):
            assert (t.c.pos_min(s), t.c.pos_max(s)) == (m.pos_min(s), m.pos_max(s)), (name, args, s)


def test_decode_share_and_refusals():
    t, m = both(n_cells=6, n_seq=3)
    agree(t, m, [
        ("decode", (0, 1), (5, 6), 0),
        ("decode", (0,), (7,), 2),
        ("decode", (0, 1), (8,), 3),      # pos_max differs: refused
        ("decode", (1,), (8,), 3),        # not consecutive: refused
        ("decode", (), (8,), 0),          # empty group
        ("decode", (1, 1), (8,), 2),      # repeated
        ("decode", (3,), (8,), 0),        # out of range
        ("decode", (2,), (8,), -1),       # pos0 < 0
        ("decode", (2,), (1, 2, 3, 4), 0),  # 3 free cells: no slot
        ("decode", (2,), (1, 2, 3), 0),
        ("decode", (1,), (9,), 2),        # full store: no slot
    ])
    assert t.c.pos_max(2) == 2 and t.c.decode((1,), *rows([9], 2), 2) is False


def test_decode_row_refusals():
    c = CellCache(4, H, D, "float16")
    k, v = rows([1, 2], 0, "float16")
    with pytest.raises(InvalidArgumentError, match="dtype must be the cache's float16"):
        c.decode((0,), k.astype(mx.float32), v, 0)
    with pytest.raises(InvalidArgumentError, match="shape"):
        c.decode((0,), k[:, :1], v, 0)
    with pytest.raises(InvalidArgumentError, match="same number of rows"):
        c.decode((0,), k, v[:1], 0)
    c2 = CellCache(4, H, D, "float16", window=2, stores=("full", "window"))
    with pytest.raises(InvalidArgumentError, match="missing 'window'"):
        c2.decode((0,), {"full": k}, {"full": v}, 0)
    assert c2.decode((0,), {"full": k, "window": k}, {"full": v, "window": v}, 0)


def test_window_reuse_lost_and_the_window_rule():
    t, m = both(n_cells=4, window=2, stores=("full", "window"), n_seq=2)
    agree(t, m, [("decode", (0,), (1, 2, 3), 0)])
    # the full store has 1 free cell left
    agree(t, m, [("decode", (0,), (4, 5), 3)])  # full store: no slot
    t, m = both(n_cells=4, window=2, stores=("window",), n_seq=2)
    agree(t, m, [("decode", (0,), (1, 2, 3, 4), 0),
                 ("decode", (0,), (5, 6), 4)])   # reuses positions 0 and 1 (droppable)
    assert t.c.lost(0) == {0, 1} and spec.lost(m.state, 0) == {0, 1}
    agree(t, m, [("decode", (0,), (7, 8, 9), 6)])  # only 0..4 droppable: 2, 3, 4
    assert t.c.lost(0) == {0, 1, 2, 3, 4}
    assert t.c.seq_rm(0, 5, None) is False    # left up to 4: lost 4 > 4 + 1 - 2 lies in the next window
    agree(t, m, [("seq_rm", 0, 5, None),
                 ("seq_rm", 0, 6, None),      # left up to 5: lost 4 is out of the next window (5 + 1 - 4 >= 2)
                 ("seq_rm", 0, 0, 3),         # partial, lost 3, 4 stay out of the window of 5
                 ("seq_rm", 0, 4, 5),         # a hole: lost 4 goes, positions 3 (lost), 5 left
                 ("seq_rm", 0, -1, -1)])      # the whole sequence: never refused
    assert t.c.lost(0) == frozenset() and t.c.pos_max(0) == -1


def test_seq_cp_keep_shift_div_against_spec():
    t, m = both(n_cells=10, n_seq=3)
    agree(t, m, [
        ("decode", (0,), (1, 2, 3, 4), 0),
        ("seq_cp", 0, 1, 0, 2),
        ("seq_cp", 0, 1, 1, 3),      # dst already holds 1 (the same cell): only 2 is added
        ("seq_cp", 0, 0, 0, None),   # src == dst: no-op
        ("decode", (2,), (5, 6), 0),
        ("seq_cp", 0, 2, 0, None),   # dst 2 holds 0, 1 already in other cells: refused
        ("seq_cp", 9, 1, 0, None),
        ("seq_add", 0, 2, None, 3),  # 2,3 -> 5,6 (for seq 1 too: shared cell at 2)
        ("seq_add", 0, 0, 1, -1),    # position 0 -> -1: freed
        ("seq_add", 1, 0, None, -1),  # seq 1: 1 -> 0, 5 -> 4: shared 5 moves for seq 0 onto 4? 0 holds 4? no
        ("seq_add", 0, 0, None, 0),
        ("seq_div", 0, 0, None, 0),  # d < 1
        ("seq_div", 0, 0, None, 2),  # collisions: refused
        ("seq_div", 2, 1, 2, 2),     # 1 -> 0 collides with 0: refused
        ("seq_div", 0, 6, None, 3),  # 6 -> 2
        ("seq_keep", 1),
        ("seq_keep", 5),
        ("seq_rm", 7, 0, None),
        ("clear",),
    ])


def test_save_restore_against_spec():
    t, m = both(n_cells=6, window=2, stores=("full", "window"), n_seq=3)
    agree(t, m, [("decode", (0,), (1, 2, 3), 0), ("seq_add", 0, 1, None, 2)])
    st, sm = t.c.save(0), m.save(0)
    assert t.observe_snapshot(st) == spec.observe_snapshot(sm)
    assert st.positions("full") == [0, 3, 4] and st.positions("window") == [3, 4]  # live window: 4 - pos < 2
    assert t.c.restore(st, 1) and m.restore(sm, 1)
    assert t.c.lost(1) == {0} == spec.lost(m.state, 1)
    agree(t, m, [("seq_rm", 1, 3, None)])  # lost 0 in the next window of logical pos_max 0: refused on both
    assert t.c.lost(1) == {0} and t.c.pos_max(1) == 4
    assert t.c.restore(st, 2) is False and m.restore(sm, 2) is False  # 0 free cells in the full store
    agree(t, m, [("seq_rm", 0, -1, -1)])
    assert t.c.restore(st, 2) and m.restore(sm, 2)
    agree(t, m, [("decode", (2,), (9,), 5)])
    other = CellCache(6, H, D, "float16", window=2, stores=("full", "window"))
    with pytest.raises(InvalidArgumentError, match="cannot be restored"):
        other.restore(st, 0)
    with pytest.raises(InvalidArgumentError, match="must be a CellsSnapshot"):
        t.c.restore(sm, 0)


# -- rows ------------------------------------------------------------------------------------


def test_bfloat16_stored_exactly():
    c = CellCache(4, H, D, "bfloat16", window=3, stores=("full", "window"))
    k, v = rows([1, 2, 3], 0, "bfloat16")
    assert c.decode((0,), k, v, 0)
    bits_k, bits_v = to_host(k), to_host(v)
    for store in c.stores:
        got = sorted(c.cells(store), key=lambda r: r[0])
        assert np.array_equal(np.stack([r[2] for r in got]), bits_k)
        assert np.array_equal(np.stack([r[3] for r in got]), bits_v)
        vk, vv, pos = c.view(0, store)
        assert vk.dtype == mx.bfloat16 and pos == (0, 1, 2)
        assert np.array_equal(to_host(vk), bits_k) and np.array_equal(to_host(vv), bits_v)
    snap = c.save(0)
    c.seq_rm(0, -1, -1)
    assert c.restore(snap, 1)
    vk, vv, _ = c.view(1, "full")
    assert np.array_equal(to_host(vk), bits_k) and np.array_equal(to_host(vv), bits_v)


def _rel(a, b):
    return float(np.max(np.abs(a.astype(np.float32) - b)) / np.max(np.abs(b)))


def test_shift_then_view_gives_rows_at_new_positions_fp16():
    c = CellCache(8, H, D, "float16")
    toks = [3, 4, 5, 6, 7]
    assert c.decode((0,), *rows(toks, 0, "float16"), 0)
    c.seq_add(0, 2, None, 40)
    assert sorted(p for p, _, _ in c.pending_shifts("full")) == [42, 43, 44]
    k, v, pos = c.view(0, "full")
    assert pos == (0, 1, 42, 43, 44) and c.pending_shifts("full") == []
    for i, (t, p) in enumerate(zip(toks, pos)):
        assert _rel(np.array(k[i].astype(mx.float32)), k_ref(t, p)) < 2e-3
        assert np.array_equal(np.array(v[i]), raw_row(t).astype(np.float16))  # V never moves


def test_two_shifts_accumulate_before_a_read():
    # #3825: the second shift must add to the first, not replace it
    c = CellCache(8, H, D, "float32")
    assert c.decode((0,), *rows([3, 4, 5], 0), 0)
    c.seq_add(0, 0, None, 3)
    c.seq_add(0, 0, None, 4)
    c.seq_div(0, 0, None, 1)
    assert sorted(d for _, _, d in c.pending_shifts("full")) == [7, 7, 7]
    k, _, pos = c.view(0, "full")
    assert pos == (7, 8, 9)
    for i, t in enumerate([3, 4, 5]):
        assert _rel(np.array(k[i]), k_ref(t, pos[i])) < 1e-5
    # seq_div's move (new - old) is a shift too, adding to a pending one
    c2 = CellCache(8, H, D, "float32")
    assert c2.decode((0,), *rows([3], 0), 0) and c2.decode((0,), *rows([4], 1), 1)
    c2.seq_rm(0, 0, 1)
    c2.seq_add(0, 0, None, 9)   # 1 -> 10
    c2.seq_div(0, 0, None, 4)   # 10 -> 2: pending 9 + (2 - 10) = 1
    assert c2.pending_shifts("full") == [(2, frozenset({0}), 1)]
    k, _, pos = c2.view(0, "full")
    assert pos == (2,) and _rel(np.array(k[0]), k_ref(4, 2)) < 1e-5


def test_save_applies_pending_shifts():
    c = CellCache(8, H, D, "float16")
    assert c.decode((0,), *rows([3, 4], 0, "float16"), 0)
    c.seq_add(0, 0, None, 5)
    snap = c.save(0)
    pos, k, _ = snap.cells["full"]
    assert list(pos) == [5, 6]
    for i, t in enumerate([3, 4]):
        assert _rel(k[i], k_ref(t, int(pos[i]))) < 2e-3


# -- refusals change nothing; snapshots alias nothing ----------------------------------------


def _state(c: CellCache):
    out = []
    for s in c.stores:
        st = c._st[s]
        out.append((s, list(st.pos), list(st.seqs), list(st.shift), sorted(st.lost, key=lambda x: (x[0], sorted(x[1]))),
                    st.head, to_host(st.k).tobytes(), to_host(st.v).tobytes()))
    return out


def test_refusals_leave_buffers_and_metadata_unchanged():
    c = CellCache(5, H, D, "float16", window=2, stores=("full", "window"), n_seq=3)
    assert c.decode((0,), *rows([1, 2, 3], 0, "float16"), 0)
    assert c.decode((1,), *rows([4], 0, "float16"), 0)
    snap = c.save(0)
    c.seq_add(0, 1, None, 1)   # seq 0 at 0, 2, 3; two K rows with a pending shift
    assert len(c.pending_shifts("full")) == 2
    before = _state(c)
    refusals = [
        lambda: c.decode((0, 1), *rows([9], 5, "float16"), 5),
        lambda: c.decode((0,), *rows([9], 7, "float16"), 7),
        lambda: c.decode((0,), *rows([9], 4, "float32"), 4),
        lambda: c.decode((2,), *rows([1, 2, 3], 0, "float16"), 0),  # no slot: returns False
        lambda: c.seq_cp(0, 1, 0, None),
        lambda: c.seq_add(0, 0, 2, 3),
        lambda: c.seq_div(0, 0, None, 2),
        lambda: c.seq_rm(5, 0, None),
        lambda: c.restore(snap, 2),        # 1 free cell: returns False
        lambda: c.restore(snap, 7),
        lambda: c.seq_keep(-1),
    ]
    for f in refusals:
        try:
            assert f() is False
        except InvalidArgumentError:
            pass
        assert _state(c) == before
    # the window rule refuses, nothing changes
    w = CellCache(4, H, D, "float16", window=2, stores=("window",))
    assert w.decode((0,), *rows([1, 2, 3, 4], 0, "float16"), 0)
    assert w.decode((0,), *rows([5, 6], 4, "float16"), 4)
    w.seq_add(0, 4, None, 1)
    before = _state(w)
    assert w.seq_rm(0, 2, None) is False  # lost 1 > new pos_max 1 + 1 - 2
    assert _state(w) == before


def test_snapshot_aliases_nothing():
    c = CellCache(6, H, D, "float32")
    assert c.decode((0,), *rows([1, 2], 0), 0)
    snap = c.save(0)
    held = [a.copy() for a in snap.cells["full"]]
    for a in snap.cells["full"][1:]:
        assert a.flags.owndata and a.flags.writeable
    c.seq_add(0, 0, None, 3)
    assert c.decode((0,), *rows([3], 5), 5)
    c.update()
    for a, b in zip(snap.cells["full"], held):
        assert np.array_equal(a, b)
    # writing into the snapshot leaves the cache alone
    before = _state(c)
    snap.cells["full"][1][...] = 0
    assert _state(c) == before
    # a copy is independent of its source
    d = c.copy()
    d.seq_rm(0, -1, -1)
    assert c.pos_max(0) == 5 and d.pos_max(0) == -1
    assert _state(c) == before


# -- the differential loop -------------------------------------------------------------------


def _random_op(rng: random.Random, m, n_seq: int):
    s = rng.randrange(n_seq)
    kind = rng.choices(["decode", "seq_rm", "seq_cp", "seq_add", "seq_div", "seq_keep", "save", "restore", "clear",
                        "bad"], [10, 4, 3, 3, 1, 0.3, 1.5, 1.5, 0.2, 0.5])[0]
    r = lambda: rng.choice([-1, 0, 1, 2, 3, 5, 8])
    p1 = lambda: rng.choice([None, -1, 2, 4, 6, 9])
    if kind == "decode":
        group = (s,) if rng.random() < 0.8 else tuple(rng.sample(range(n_seq), 2))
        top = spec.logical_pos_max(m.state, group[0])
        pos0 = top + 1 if rng.random() < 0.95 else rng.randrange(0, 6)
        return ("decode", group, tuple(rng.randrange(20) for _ in range(rng.choice([1, 1, 2, 3]))), pos0)
    if kind == "seq_rm":
        return ("seq_rm", rng.choice([s, s, -1]), r(), p1())
    if kind == "seq_cp":
        return ("seq_cp", s, rng.randrange(n_seq), r(), p1())
    if kind == "seq_add":
        return ("seq_add", s, r(), p1(), rng.choice([-3, -1, 1, 2, 4]))
    if kind == "seq_div":
        return ("seq_div", s, r(), p1(), rng.choice([1, 2, 3]))
    if kind == "seq_keep":
        return ("seq_keep", s)
    if kind == "save":
        return ("save", s)
    if kind == "restore":
        return ("restore", None, s)
    if kind == "clear":
        return ("clear",)
    return rng.choice([("seq_rm", n_seq, 0, None), ("seq_div", s, 0, None, 0), ("decode", (s,), (1,), -2)])


def _gone(target_after, spec_before, spec_after):
    """The keys (pos, seqs, token) of the spec's windowed cells before a
    decode that the target no longer holds after it, when the target's
    window differs from the spec's; else ([], None)."""
    if same_store(target_after, spec_after):
        return [], None
    held = {(p, ss, k) for p, ss, k, _ in target_after}
    return [(p, ss, k[0]) for p, ss, k, _ in spec_before if (p, ss, k) not in held], held


@pytest.mark.parametrize("seed", range(9))
def test_differential_loop_against_spec(seed):
    rng = random.Random(seed)
    stores = [("full",), ("full", "window"), ("window",)][seed % 3]
    window = rng.choice([1, 2, 3]) if "window" in stores else None
    n_seq = 3
    cfg = {"n_cells": rng.choice([5, 7, 9]), "window": window, "stores": stores, "n_seq": n_seq}
    t, m = Named(**cfg), spec.CellsMemory(**cfg)
    saved: tuple | None = None
    counts = {"ok": 0, "refused": 0, "false": 0, "drops": 0}
    for _ in range(400):
        op = _random_op(rng, m, n_seq)
        if op[0] == "restore":
            if saved is None:
                continue
            op = ("restore", saved, op[2])
        res = []
        for side in (t, m):
            args = op[1:]
            if op[0] == "restore":
                args = (saved[0] if side is t else saved[1], op[2])
            before = m.state
            try:
                res.append(("ok", getattr(side, op[0])(*args)))
            except KVCacheError as e:
                res.append((type(e).__name__, None))
            if side is m and op[0] in ("decode", "restore") and res[0] == res[1] == ("ok", True) \
                    and "window" in stores:
                # adoption: where the target reused other droppable windowed cells than the spec
                # chose, the spec decodes (restores) again with the target's drops, checked on the
                # state its slot search saw
                gone, _ = _gone(t.observe()["window"], spec.observe(before)["window"], m.observe()["window"])
                if gone:
                    m.state = before
                    counts["drops"] += len(gone)
                    res[1] = ("ok", m.decode(*args, drops=gone) if op[0] == "decode" else
                              m.restore(*args, drops=[g for g in gone if op[2] not in g[1]]))
        assert res[0][0] == res[1][0], (op, res)
        if op[0] == "save":
            if res[0][0] == "ok":
                assert t.observe_snapshot(res[0][1]) == spec.observe_snapshot(res[1][1]), op
                saved = (res[0][1], res[1][1])
        else:
            assert res[0] == res[1], (op, res)
        counts["refused" if res[0][0] != "ok" else "false" if res[0][1] is False else "ok"] += 1
        ot, om = t.observe(), m.observe()
        for s in stores:
            assert all(k is not None and v is not None for _, _, k, v in ot[s]), (op, ot[s])
            assert same_store(ot[s], om[s]), (op, s, ot[s], om[s])
        for s in range(n_seq):
            assert (t.c.pos_min(s), t.c.pos_max(s)) == (m.pos_min(s), m.pos_max(s)), (op, s)
            assert t.c.lost(s) == spec.lost(m.state, s), (op, s)
    assert counts["ok"] > 100 and counts["refused"] > 5, counts


# -- a group validated before reuse; a smaller window store; restore reuses droppable cells; words -------------


def test_a_coupled_group_is_validated_before_a_members_cell_is_reused():
    t, m = both(n_cells=6, window=2, stores=("window",), n_seq=2)
    agree(t, m, [("decode", (0,), (1, 2, 3), 0), ("decode", (1,), (4, 5, 6), 0),
                 ("decode", (0, 1), (7,), 3)])  # the window store is full: a member's old cell is reused
    assert t.c.lost(0) | t.c.lost(1) == {0}


def test_window_cells_sizes_the_window_store():
    c = CellCache(8, H, D, "float32", window=2, stores=("full", "window"), window_cells=3)
    assert c.nbytes == 2 * (8 + 3) * H * D * 4 and c.window_cells == 3
    assert CellCache(5, H, D).window_cells == 5
    for bad in (0, 9, 2.0):
        with pytest.raises(InvalidArgumentError, match="window_cells"):
            CellCache(8, H, D, window=2, stores=("full", "window"), window_cells=bad)
    with pytest.raises(InvalidArgumentError, match="window_cells"):
        CellCache(8, H, D, stores=("full",), window_cells=4)
    t, m = both(n_cells=8, window=2, stores=("full", "window"), n_seq=2, window_cells=3)
    agree(t, m, [("decode", (0,), (1, 2, 3), 0), ("decode", (0,), (4,), 3),  # window reuses position 0
                 ("seq_rm", 0, 1, None),  # lost 0 back in the next window: refused
                 ("decode", (1,), (5,), 0),  # the window reuses 0's position 1
                 ("decode", (1,), (6, 7, 8), 1)])  # no slot in the window store
    assert t.c.lost(0) == {0, 1}


def test_restore_reuses_droppable_window_cells():
    cfg = {"n_cells": 8, "window": 2, "stores": ("full", "window"), "n_seq": 2, "window_cells": 4}
    t, m = both(**cfg)
    agree(t, m, [("decode", (1,), (1, 2), 0)])
    snaps = (t.c.save(1), m.save(1))
    agree(t, m, [("seq_rm", 1, -1, -1), ("decode", (0,), (1, 2, 3, 4), 0)])
    for side, snap in zip((t.c, m), snaps, strict=True):
        assert side.restore(snap, 1) is True  # 0's positions 0 and 1 (droppable) reused
    agree(t, m, [])
    assert t.c.lost(0) == spec.lost(m.state, 0) == {0, 1}
    ot, om = t.observe(), m.observe()
    assert same_store(ot["window"], om["window"]) and same_store(ot["full"], om["full"])
    big = (CellCache(8, H, D, "float32", **{k: v for k, v in cfg.items() if k != "n_cells"}), None)
    big[0].decode((0,), *rows([1, 2, 3, 4], 0), 0)
    full_snap = big[0].save(0)  # 4 window cells: positions 2, 3 live (w = 2): 2 cells
    assert full_snap.positions("window") == [2, 3]


@pytest.mark.parametrize("call", [
    lambda x, k: x.decode((0, 1), *k((9,), 2), 2),   # coupled sequences disagree
    lambda x, k: x.decode((0,), *k((9,), 5), 5),     # not consecutive
    lambda x, k: x.decode((0,), *k((9,), 0), -1),    # pos0 < 0
    lambda x, k: x.decode((0,), *k((), 2), 2),       # no token
    lambda x, k: x.decode((), *k((9,), 0), 0),
    lambda x, k: x.decode((0, 0), *k((9,), 2), 2),
    lambda x, k: x.decode((3,), *k((9,), 0), 0),
    lambda x, k: x.seq_rm(3, 0, None),
    lambda x, k: x.seq_rm(0, "a", None),
    lambda x, k: x.seq_rm(0, 0, 1.5),
    lambda x, k: x.seq_rm("0", 0, None),
    lambda x, k: x.seq_cp(0, 1, 0, None),             # 1 already holds position 0
    lambda x, k: x.seq_cp(0, 5, 0, None),
    lambda x, k: x.seq_keep(-1),
    lambda x, k: x.seq_add(0, 1, None, -1),           # onto position 0
    lambda x, k: x.seq_add(0, 0, None, 1.0),
    lambda x, k: x.seq_div(0, 0, None, 2),            # 0, 1 -> 0, 0
    lambda x, k: x.seq_div(0, 0, None, 0),
    lambda x, k: x.seq_div(0, 0, None, "2"),
    lambda x, k: x.pos_min(7),
    lambda x, k: x.pos_max(-1),
    lambda x, k: x.save(2),
])
def test_refusal_words_match_the_spec(call):
    c = CellCache(6, H, D, "float32", window=2, stores=("full", "window"), n_seq=2)
    m = spec.CellsMemory(n_cells=6, window=2, stores=("full", "window"), n_seq=2)
    c.decode((0,), *rows([1, 2], 0), 0)
    c.decode((1,), *rows([3], 0), 0)
    m.decode((0,), (1, 2), 0)
    m.decode((1,), (3,), 0)

    def tok_rows(tokens, pos0):
        if not tokens:
            z = mx.zeros((0, H, D), mx.float32)
            return z, z
        return rows(tokens, max(pos0, 0))

    with pytest.raises(KVCacheError) as mine:
        call(c, tok_rows)
    with pytest.raises(KVCacheError) as theirs:
        call(m, lambda tokens, pos0: (tuple(tokens),))
    assert type(mine.value) is type(theirs.value)
    assert str(mine.value) == str(theirs.value)


def test_a_collision_with_lost_cells_is_reported_at_its_lowest_position_on_both_sides():
    # found by the cells campaign once words were compared: the first hit depended on each side's cell order
    c = CellCache(6, H, D, "float32", window=2, stores=("window",), n_seq=2)
    m = spec.CellsMemory(n_cells=6, window=2, stores=("window",), n_seq=2)
    for seqs, toks, pos0 in (((0,), (3, 0, 0), 0), ((0,), (0, 0, 0), 3), ((1,), (0,), 0), ((1,), (0, 0, 0), 1)):
        assert c.decode(seqs, *rows(toks, pos0), pos0) == m.decode(seqs, toks, pos0)
    with pytest.raises(InvalidArgumentError) as mine:
        c.seq_add(0, 3, None, -3)
    with pytest.raises(InvalidArgumentError) as theirs:
        m.seq_add(0, 3, None, -3)
    assert str(mine.value) == str(theirs.value) and "position 0" in str(theirs.value)


# -- recorded drops (a trace's choice of window cells) and independent copies ------------------------------------


def _window_positions(c: CellCache, seq: int) -> list[int]:
    return sorted(p for p, ss, _, _ in c.cells("window") if seq in ss)


def test_decode_and_restore_follow_recorded_drops_and_refuse_one_not_droppable():
    c = CellCache(4, H, D, dtype="float32", window=2, stores=("window",), n_seq=2)
    assert c.decode((0,), *rows([1, 2, 3, 4], 0), 0)
    before = (c.cells("window", apply_shifts=False), c.lost(0))
    with pytest.raises(KVCacheError, match="may not be dropped"):
        c.decode((0,), *rows([5], 4), 4, drops=[(3, frozenset({0}), 4)])  # position 3 is in the window
    after = (c.cells("window", apply_shifts=False), c.lost(0))
    assert [x[:2] for x in after[0]] == [x[:2] for x in before[0]] and after[1] == before[1]
    assert c.decode((0,), *rows([5], 4), 4, drops=[[1, [0], 2]])  # the trace's choice, not the lowest (0)
    assert c.lost(0) == {1} and _window_positions(c, 0) == [0, 2, 3, 4]
    snap = c.save(0)
    assert c.restore(snap, 1, drops=[[2, [0], 3], [3, [0], 4]])
    assert c.lost(0) == {1, 2, 3} and _window_positions(c, 0) == [0, 4] and _window_positions(c, 1) == [3, 4]
    ref = spec.CellsMemory(spec.CellsConfig(4, 2, ("window",), 2))
    ref.decode((0,), (1, 2, 3, 4), 0)
    ref.decode((0,), (5,), 4, drops=[[1, [0], 2]])
    ref.restore(ref.save(0), 1, drops=[[2, [0], 3], [3, [0], 4]])
    assert all(spec.lost(ref.state, s) == c.lost(s) for s in range(2))


def test_a_highest_first_cache_declares_its_policy_and_a_copy_keeps_its_lost_cells():
    from kvspec.fuzz.cells_choosy import HighestFirstCellCache

    assert CellCache.drop_policy == spec.DROP_POLICY and HighestFirstCellCache.drop_policy != spec.DROP_POLICY
    c = HighestFirstCellCache(4, H, D, dtype="float32", window=2, stores=("window",), n_seq=2)
    assert c.decode((0,), *rows([1, 2, 3, 4], 0), 0)
    copy = c.copy()
    assert c.decode((0,), *rows([5], 4), 4)
    assert c.lost(0) == {2} and copy.lost(0) == frozenset()  # highest droppable position; the copy untouched
    assert _window_positions(copy, 0) == [0, 1, 2, 3]
