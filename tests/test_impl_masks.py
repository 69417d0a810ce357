"""kvspec.impl.masks: the host build (CPU, Apple unified memory) and the device
build (MLX's CUDA backend, run here on the CPU) give the same matrices, the
dispatch picks by backend, and every cache's make_mask goes through it with
the same answer on both builds."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import kvspec.impl.masks as M
from kvspec.impl.dense import KVCache
from kvspec.impl.paged import PagedKVCache, make_paged_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec import dense as sd


def _bool(a: mx.array) -> np.ndarray:
    assert isinstance(a, mx.array) and a.dtype == mx.bool_
    return np.array(a)


@pytest.mark.parametrize("backend, want", [("cpu", np), ("metal", np), ("cuda", mx)])
def test_the_namespace_follows_the_backend(monkeypatch, backend, want):
    monkeypatch.setattr(M, "backend", lambda: backend)
    assert M.mask_namespace() is want


def test_causal_builds_agree_with_each_other_and_the_spec():
    for live, n, window in itertools.product(range(7), range(1, 5), (None, 1, 2, 3, 5, 9)):
        host = _bool(M.causal_mask(live, n, window, xp=np))
        device = _bool(M.causal_mask(live, n, window, xp=mx))
        want = np.array(sd.dense_make_mask(live, n, window), dtype=bool).reshape(n, live + n)
        assert host.shape == device.shape == (n, live + n)
        assert (host == want).all() and (device == want).all(), (live, n, window)


def test_ring_builds_agree_on_every_small_ring():
    """The two builds over the key positions real rings return (every
    W, keep, fill, chunk and window up to small sizes)."""
    seen = 0
    for W, keep, fill, n in itertools.product(range(2, 6), range(3), range(9), range(1, 4)):
        if keep >= W:
            continue
        c = RotatingKVCache(max_size=W, keep=keep)
        for t in range(fill):
            c.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
        positions = np.asarray(c._next_positions(n), dtype=np.int64)
        for window in (1, keep, keep + 1, W - 1, W, W + 2):
            if window < 1:
                continue
            host = _bool(M.ring_mask(positions, c.offset, n, keep, window, xp=np))
            device = _bool(M.ring_mask(positions, c.offset, n, keep, window, xp=mx))
            assert host.shape == (n, len(positions))
            assert (host == device).all(), (W, keep, fill, n, window)
            seen += 1
    assert seen > 500


def _caches():
    dense = KVCache()
    ring = RotatingKVCache(max_size=4, keep=1)
    paged: PagedKVCache = make_paged_prompt_cache(1, block_size=2)[0]
    for c in (dense, ring, paged):
        for _ in range(5):
            c.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    return {"dense": dense, "ring": ring, "paged": paged}


@pytest.mark.parametrize("name", ["dense", "ring", "paged"])
def test_make_mask_is_the_same_on_both_builds(monkeypatch, name):
    """A cache hands its own arguments to kvspec.impl.masks: the CUDA build (forced
    here) and the host build return the same matrix for every call."""
    cache = _caches()[name]
    calls = [(n, w) for n in (1, 2, 3) for w in (None, 1, 2, 3, 6)]
    got = {}
    for backend in ("cpu", "cuda"):
        monkeypatch.setattr(M, "backend", lambda b=backend: b)
        got[backend] = [_bool(cache.make_mask(n, window_size=w, return_array=True)) for n, w in calls]
    for (n, w), a, b in zip(calls, got["cpu"], got["cuda"]):
        assert a.shape == b.shape and (a == b).all(), (name, n, w)


def test_the_host_build_runs_no_mlx_op_and_the_device_build_no_numpy_one(monkeypatch):
    """On the CPU the matrix is built in NumPy and handed to MLX finished
    (one ``mx.array``); on CUDA it is MLX work only (no host arrays)."""
    def refuse(*_a, **_k):
        raise AssertionError("wrong namespace")

    cache = _caches()["ring"]
    monkeypatch.setattr(M, "backend", lambda: "cpu")
    with monkeypatch.context() as m:
        m.setattr(mx, "arange", refuse)
        host_causal = np.array(M.causal_mask(3, 2, 2))
        host_ring = np.array(cache.make_mask(2, window_size=2, return_array=True))
    monkeypatch.setattr(M, "backend", lambda: "cuda")
    with monkeypatch.context() as m:
        m.setattr(np, "arange", refuse)
        device_causal = np.array(M.causal_mask(3, 2, 2))
    assert np.array_equal(host_causal, device_causal)
    assert host_ring.shape == (2, len(cache._next_positions(2)))
