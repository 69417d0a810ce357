"""kvspec.impl.masks, kvspec.spec.rotating.make_masks_spec and kvspec.fuzz.masks.check_ring_masks:
the classes of bugs tests/test_impl_masks.py and the fuzzer leave open
(each class found by injecting bugs the earlier tests and the fuzzer missed).

* The spec's several-window helper is each window on its own, in the order
  asked, whatever the order, repeats or sizes of the windows: checked
  against an independent statement of the ring rule and against the ring.
* The harness's ring mask check asks the cache for every window of
  ``ring_windows`` and compares each answer with that window's own
  matrix: a cache wrong at any one window is caught.
* Each build runs in its own namespace, for every cache kind and both mask
  functions: the host build touches MLX only to wrap the finished matrix,
  the device build touches NumPy not at all.
* The namespace is read at every call (the backend may change between
  calls, also within one test process).
* Every cache kind (dense Fp16/Int8/Turbo, paged, ring) returns, on both
  builds, a bool ``[N, L]`` array, ``L`` the keys the append then returns,
  equal to the spec, including after a front trim (live_len < offset).
"""

from __future__ import annotations

import itertools
import sys

import mlx.core as mx
import numpy as np
import pytest

import kvspec.impl.masks as M
from kvspec.fuzz import masks as fm
from kvspec.fuzz.lockstep import Divergence
from kvspec.impl.paged import make_paged_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import make_cache
from kvspec.spec import dense as sd
from kvspec.spec import rotating as sr

BACKENDS = ("cpu", "metal", "cuda")


def _rows(k: int, d: int = 8) -> mx.array:
    return mx.zeros((1, 1, k, d), dtype=mx.float16)


def _ring_pair(w: int, keep: int, appends: tuple[int, ...]):
    """An impl ring and a spec ring after the same appends."""
    c = RotatingKVCache(max_size=w, keep=keep, step=2)
    s = sr.new_cache(w, keep, 2)
    token = 0
    for k in appends:
        c.update_and_fetch(_rows(k), _rows(k))
        _, s = sr.append(s, tuple(range(token, token + k)))
        token += k
    return c, s


def _ring_rule(s: sr.RotatingCache, n: int, window: int | None) -> np.ndarray:
    """The ring's rule stated here on its own (not through kvspec.spec.rotating's
    mask helpers): query ``offset + i`` sees key ``p`` iff ``p <= q`` and
    ``p < keep`` or ``q - p < window - keep`` (window None: max_size)."""
    result, _ = sr.append(s, tuple(range(-n, 0)))
    w = s.max_size if window is None else window
    pos = list(result.positions)
    return np.array([[p <= s.offset + i and (p < s.keep or s.offset + i - p < w - s.keep) for p in pos]
                     for i in range(n)], dtype=bool).reshape(n, len(pos))


RINGS = [(w, keep, appends) for w, keep in ((2, 0), (3, 1), (4, 0), (4, 2), (5, 1))
         for appends in ((), (1,), (2, 1), (3, 3), (1, 1, 1, 1, 1, 1, 1), (6,), (2, 5, 1))]


def _window_orders(w: int, keep: int) -> list[tuple[int | None, ...]]:
    base = fm.ring_windows(w, keep)
    return [
        tuple(base),
        tuple(reversed(base)),
        tuple(base[1:] + base[:1]),  # None last
        (w + 2, 1, None, w + 2, keep + 1, 1),  # repeats, wider than the ring first
        (1,),
        (None,),
        (),
        (w + 5, w + 1, w),
    ]


@pytest.mark.parametrize("w, keep, appends", RINGS)
def test_make_masks_spec_is_each_window_on_its_own_in_the_order_asked(w, keep, appends):
    """Order, repeats, None among the windows, windows wider than the ring,
    one window, none: entry ``i`` is window ``i``'s matrix, the rule's and
    the ring's (its array form)."""
    c, s = _ring_pair(w, keep, appends)
    for n in (1, 2, 3):
        for windows in _window_orders(w, keep):
            got = sr.make_masks_spec(s, n, windows)
            assert isinstance(got, tuple) and len(got) == len(windows), (windows, n)
            for window, want in zip(windows, got):
                rule = _ring_rule(s, n, window)
                ring = np.array(c.make_mask(n, window_size=window, return_array=True))
                spec = np.array(want, dtype=bool).reshape(rule.shape)
                assert np.array_equal(spec, rule), (w, keep, appends, n, windows, window)
                assert np.array_equal(ring, rule), (w, keep, appends, n, window)
            # the one-window form is the same matrix
            for window in windows:
                one = np.array(sr.make_mask_spec(s, n, window), dtype=bool).reshape(-1, _ring_rule(s, n, window).shape[1])
                assert np.array_equal(one, _ring_rule(s, n, window)), (window, n)


class _Lock:
    """The parts of a lockstep kvspec.fuzz.masks uses, checking at once (no defer)."""

    current_index = 0

    def __init__(self) -> None:
        self.reached_marks: list[str] = []

    def reached(self, what: str) -> None:
        self.reached_marks.append(what)


class _Recording:
    """A ring whose make_mask calls are recorded and whose array answer for
    one window (``wrong_at``; ``"none"`` for the default window) has one
    entry flipped."""

    def __init__(self, cache: RotatingKVCache, wrong_at: object = None) -> None:
        self.cache, self.wrong_at, self.calls = cache, wrong_at, []

    def make_mask(self, n, window_size=None, return_array=False):
        self.calls.append((window_size, return_array))
        mask = self.cache.make_mask(n, window_size=window_size, return_array=return_array)
        key = "none" if window_size is None else window_size
        if return_array and key == self.wrong_at:
            flipped = np.array(mask)
            flipped[-1, -1] = not flipped[-1, -1]
            return mx.array(flipped)
        return mask


@pytest.mark.parametrize("w, keep, appends", [(4, 1, (2, 3)), (3, 0, (1, 1, 1, 1)), (5, 2, ()), (4, 2, (6,))])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_check_ring_masks_compares_every_window_with_its_own_matrix(w, keep, appends, n):
    """A correct ring passes, every window of ring_windows is asked for in
    both forms, and a ring wrong at any single window is caught (so no
    window is dropped, shifted onto another's matrix or given another's)."""
    op = {"op": "append", "n": n}
    c, s = _ring_pair(w, keep, appends)
    windows = fm.ring_windows(w, keep)
    for narrow, asked in ((True, windows), (False, [None])):
        rec = _Recording(c)
        lock = _Lock()
        fm.check_ring_masks(lock, op, s, rec, narrow)  # the correct ring passes
        assert lock.reached_marks == ["masks checked"]
        assert sorted(rec.calls, key=repr) == sorted(
            [(win, form) for win in asked for form in (True, False)], key=repr), narrow
        for wrong in asked:
            rec = _Recording(c, "none" if wrong is None else wrong)
            with pytest.raises(Divergence):
                fm.check_ring_masks(_Lock(), op, s, rec, narrow)


class _Refuse:
    """A module stand-in: any attribute but those allowed raises."""

    def __init__(self, real, allowed: tuple[str, ...] = ()) -> None:
        self._real, self._allowed = real, allowed

    def __getattr__(self, name):
        if name in self._allowed:
            return getattr(self._real, name)
        raise AssertionError(f"wrong namespace: {self._real.__name__}.{name}")


def _kinds() -> dict:
    """name -> (cache, want(n, window)): every cache kind with keys in it,
    the dense and paged ones also after a front trim (live_len < offset),
    each with its spec matrix for the next append."""
    out = {}
    for mode in ("fp16", "int8", "turbo4"):
        c = make_cache(mode, step=2)
        for k in (2, 3):
            c.update_and_fetch(_rows(k), _rows(k))
        out[mode] = c
    for mode in ("fp16", "int8"):
        c = make_cache(mode, step=2)
        c.update_and_fetch(_rows(6), _rows(6))
        c.trim_front_keep_sink(3, keep=1)
        out[mode + "-front-trimmed"] = c
    paged = make_paged_prompt_cache(1, block_size=2)[0]
    for k in (2, 3):
        paged.update_and_fetch(_rows(k), _rows(k))
    out["paged"] = paged
    paged = make_paged_prompt_cache(1, block_size=2)[0]
    paged.update_and_fetch(_rows(7), _rows(7))
    paged.trim_front(4)
    out["paged-front-trimmed"] = paged
    kinds = {name: (c, lambda n, w, c=c: _dense_want(c, n, w)) for name, c in out.items()}
    ring, s = _ring_pair(4, 1, (2, 3))
    kinds["ring"] = (ring, lambda n, w: _ring_rule(s, n, w))
    return kinds


def _builders():
    """(name, build(n, window)) for both mask functions and every kind."""
    ring = _ring_pair(4, 1, (2, 3))[0]

    def ring_mask(n, w):
        positions = np.asarray(ring._next_positions(n), dtype=np.int64)
        return M.ring_mask(positions, ring.offset, n, ring.keep, ring.max_size if w is None else w)

    out = [("causal_mask", lambda n, w: M.causal_mask(4, n, w)), ("ring_mask", ring_mask)]
    for name, (cache, _) in _kinds().items():
        out.append((name, lambda n, w, cache=cache: cache.make_mask(n, window_size=w, return_array=True)))
    return out


_BUILDERS = _builders()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, build", _BUILDERS, ids=[b[0] for b in _BUILDERS])
def test_each_build_stays_in_its_namespace(monkeypatch, backend, name, build):
    """cpu / metal: kvspec.impl.masks uses MLX only to wrap the finished NumPy
    matrix (``mx.array``); cuda: kvspec.impl.masks uses NumPy not at all (a ring's
    positions arrive as a NumPy vector and go straight to MLX)."""
    monkeypatch.setattr(M, "backend", lambda: backend)
    if backend == "cuda":
        monkeypatch.setattr(M, "np", _Refuse(np))
    else:
        monkeypatch.setattr(M, "mx", _Refuse(mx, ("array",)))
    for n, w in ((1, None), (2, None), (2, 2), (3, 1)):
        mask = build(n, w)
        assert isinstance(mask, mx.array) and mask.dtype == mx.bool_, (name, backend, n, w)


def test_the_namespace_is_read_at_every_call(monkeypatch):
    """The backend changes between calls in one process (a default device
    moved): each call answers for the backend of that moment, and so does
    each build's first step."""
    seq = ["cpu", "cuda", "cpu", "metal", "cuda", "cuda", "cpu"]
    seen_first = []
    for b in seq:
        monkeypatch.setattr(M, "backend", lambda b=b: b)
        seen_first.append(M.mask_namespace())
    assert seen_first == [mx if b == "cuda" else np for b in seq]
    # through the builds: the device build refuses NumPy, the host build MLX ops
    for b in seq:
        monkeypatch.setattr(M, "backend", lambda b=b: b)
        with monkeypatch.context() as m:
            if b == "cuda":
                m.setattr(M, "np", _Refuse(np))
            else:
                m.setattr(M, "mx", _Refuse(mx, ("array",)))
            M.causal_mask(2, 2, 1)
            M.ring_mask(np.arange(4, dtype=np.int64), 2, 2, 1, 3)


def _dense_want(cache, n, window):
    return np.array(sd.dense_make_mask(cache.live_len, n, window), dtype=bool).reshape(n, cache.live_len + n)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_every_kind_returns_a_bool_matrix_over_the_keys_its_append_returns(monkeypatch, backend):
    """make_mask(N, window, return_array=True) before an append: an mx.array
    of dtype bool and shape (N, L), L the keys that append returns, equal to
    the spec; and the short form (no return_array) denotes the same matrix.
    Every kind: Int8/Turbo (through KVCache.make_mask), paged, the ring, and
    front-trimmed caches (their live_len, not their offset, counts keys)."""
    monkeypatch.setattr(M, "backend", lambda: backend)
    for n, window in itertools.product((1, 2, 3), (None, 1, 2, 3, 4, 9)):
        for name, (cache, want_of) in _kinds().items():
            want = want_of(n, window)
            mask = cache.make_mask(n, window_size=window, return_array=True)
            short = cache.make_mask(n, window_size=window)
            assert isinstance(mask, mx.array) and mask.dtype == mx.bool_, (name, n, window, mask.dtype)
            keys, _ = cache.update_and_fetch(_rows(n), _rows(n))
            assert mask.shape == (n, keys.shape[2]) == want.shape, (name, n, window)
            assert np.array_equal(np.array(mask), want), (name, n, window)
            denoted = fm.mask_matrix(short, n, want.shape[1])
            assert denoted is not None and np.array_equal(denoted, want), (name, n, window, short)
            if isinstance(short, mx.array):
                assert short.dtype == mx.bool_, (name, n, window)


@pytest.mark.parametrize("backend, window", [
    ("cpu", 2**31 - 1),
    ("cpu", sys.maxsize),
    ("cuda", 2**31 - 1),
    ("cuda", sys.maxsize),
    ("cuda", 2**64),
])
def test_a_huge_window_hides_nothing(monkeypatch, backend, window):
    """check_window_size accepts any integer >= 1; a window wider than the
    cache hides no causal key (the spec's matrix: plain causal for the dense
    kinds, the sinks-and-latest rule for the ring), on both builds. Found by
    a breaker: the dense and paged masks came back with
    keys hidden, or MLX raised ValueError on the device build, before the
    window was clamped to the cache's length (kvspec.impl.masks)."""
    monkeypatch.setattr(M, "backend", lambda: backend)
    for name, (cache, want_of) in _kinds().items():
        mask = np.array(cache.make_mask(2, window_size=window, return_array=True))
        assert np.array_equal(mask, want_of(2, window)), (name, backend, window)
        if name != "ring":
            assert np.array_equal(mask, _dense_want(cache, 2, None)), (name, backend, window)
