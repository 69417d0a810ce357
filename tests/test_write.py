"""The write layer (kvspec.impl.write): which mechanism each backend takes, checked
on the CPU by standing in for the CUDA kernel (a CUDA array never takes the
NumPy path, a CPU array never takes the kernel path), and what the copying
write promises (the input and its sharers unchanged; MLX reuses the memory
when nothing else holds it)."""

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import write as W
from kvspec.impl.dense import KVCache, data_pointer
from kvspec.impl.paged import BlockPool
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError
from tests._standin import stand_in
from tests.budget import reduced


def rows(n, fill, d=4, h=2):
    return mx.full((1, h, n, d), fill, dtype=mx.float16)


class FakeKernel:
    """Stands in for the CUDA kernel: writes through NumPy (so values stay
    checkable), records every launch, and hands back a lazy token that the
    layer must complete before it returns."""

    def __init__(self, monkeypatch):
        self.launches, self.completed = [], []
        stand_in(monkeypatch, "cuda")
        monkeypatch.setattr(W, "kernel_write", self.kernel_write)
        monkeypatch.setattr(W, "complete", self.completed.append)

        def no_numpy(*a, **k):
            raise AssertionError("a CUDA array took the NumPy path")

        self.numpy_write = W.write_inplace_numpy
        monkeypatch.setattr(W, "write_inplace_numpy", no_numpy)

    def kernel_write(self, dst, src, start):
        assert list(src.shape) == [min(s, dst.shape[i] - start[i]) for i, s in enumerate(src.shape)]
        index = tuple(slice(a, a + n) for a, n in zip(start, src.shape))
        self.numpy_write(dst, src, index)
        token = mx.array([1]) + 0
        self.launches.append(token)
        return token


def test_cpu_backend_takes_the_numpy_path_never_the_kernel(monkeypatch):
    assert W.backend() == "cpu" and W.inplace_mechanism() == "numpy" and W.inplace_keeps_memory()

    def no_kernel(*a, **k):
        raise AssertionError("a CPU array took the kernel path")

    monkeypatch.setattr(W, "kernel_write", no_kernel)
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")  # only read on CUDA
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(3, 1), rows(3, 1))
    before, keys = W.COUNTS["numpy"], c.buffers.keys
    c.update_and_fetch(rows(1, 2), rows(1, 2))
    assert c.last_write_inplace and c.buffers.keys is keys
    assert W.COUNTS["numpy"] == before + 2  # keys and values


def test_cuda_kernel_mechanism_never_takes_the_numpy_path_and_completes_each_write(monkeypatch):
    fake = FakeKernel(monkeypatch)
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    assert W.inplace_mechanism() == "kernel" and W.inplace_keeps_memory()
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(3, 1), rows(3, 1))
    snap = c.snapshot()
    p = data_pointer(c.buffers.keys)
    k, _ = c.update_and_fetch(rows(1, 2), rows(1, 2))
    assert c.last_write_inplace and data_pointer(c.buffers.keys) == p  # beside a snapshot, in place
    assert len(fake.launches) == 2 and fake.completed == fake.launches  # each token completed, in order
    assert np.array(k)[0, 0, :, 0].tolist() == [1, 1, 1, 2]
    assert np.array(snap.buffers.keys)[0, 0, :3, 0].tolist() == [1, 1, 1]


def test_cuda_donate_mechanism_is_a_static_slice_update(monkeypatch):
    FakeKernel(monkeypatch)
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    assert W.inplace_mechanism() == "donate" and not W.inplace_keeps_memory()
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(3, 1), rows(3, 1))
    before = W.COUNTS["donate"]
    p = data_pointer(c.buffers.keys)
    k, _ = c.update_and_fetch(rows(1, 2), rows(1, 2))
    del k, _
    assert c.last_write_inplace and W.COUNTS["donate"] == before + 2
    assert data_pointer(c.buffers.keys) == p  # nothing else held it: MLX reused the memory
    snap = c.snapshot()
    c.update_and_fetch(rows(1, 3), rows(1, 3))
    assert data_pointer(c.buffers.keys) != data_pointer(snap.buffers.keys)  # beside a holder: MLX copied
    assert np.array(c.fetch()[0])[0, 0, :, 0].tolist() == [1, 1, 1, 2, 3]


def test_cuda_ring_warmup_and_paged_writes_take_the_kernel(monkeypatch):
    fake = FakeKernel(monkeypatch)
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    r = RotatingKVCache(max_size=4, step=2, inplace=True)
    r.update_and_fetch(rows(1, 1), rows(1, 1))
    r.update_and_fetch(rows(1, 2), rows(1, 2))
    assert r.last_write_inplace and len(fake.launches) == 2
    pool = BlockPool(block_size=2, inplace=True)
    pool.create("a")
    pool.append("a", rows(1, 5), rows(1, 5))
    pool.fork("a", "b")
    n = len(fake.launches)
    pool.append("a", rows(1, 6), rows(1, 6))  # a shared block: copy on write, then the row
    assert len(fake.launches) > n and fake.completed == fake.launches
    assert np.array(pool.fetch("a")[0])[0, 0, :, 0].tolist() == [5, 6]
    assert np.array(pool.fetch("b")[0])[0, 0, :, 0].tolist() == [5]


def test_a_bad_cuda_mechanism_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KV_CUDA_INPLACE", "fast")
    with pytest.raises(InvalidArgumentError, match="KV_CUDA_INPLACE must be one of donate, kernel"):
        W.cuda_inplace()
    stand_in(monkeypatch, "cuda")
    c = KVCache("fp16", step=8, inplace=True)
    c.update_and_fetch(rows(2, 1), rows(2, 1))
    with pytest.raises(InvalidArgumentError):
        c.update_and_fetch(rows(1, 2), rows(1, 2))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_write_copy_leaves_the_input_and_its_sharers_unchanged(dtype):
    a = mx.zeros((1, 2, 6, 3), dtype=dtype)
    mx.eval(a)
    view = a[:, :, :4]
    b = W.write_copy(a, mx.ones((1, 2, 2, 3), dtype=dtype), W.seq_index(2, 2))
    assert b.dtype == dtype
    assert np.array(b.astype(mx.float32))[0, 0, :, 0].tolist() == [0, 0, 1, 1, 0, 0]
    assert not np.array(a.astype(mx.float32)).any() and not np.array(view.astype(mx.float32)).any()


def test_write_inplace_numpy_is_seen_by_every_sharer_bit_for_bit():
    a = mx.zeros((1, 1, 4, 2), dtype=mx.bfloat16)
    mx.eval(a)
    share = a[:, :, :]
    src = mx.array([[[[1.5, -0.0]]]], dtype=mx.bfloat16)
    assert W.write_inplace(a, src, W.seq_index(1, 1)) is a
    got = np.array(mx.view(share, mx.uint16))[0, 0, 1]
    assert got.tolist() == np.array(mx.view(src, mx.uint16))[0, 0, 0].tolist()


def test_region_refuses_what_the_kernel_cannot_write():
    a = mx.zeros((2, 3))
    with pytest.raises(IndexError, match="axis 0: index 2 outside"):
        W._region(a, (2,))
    with pytest.raises(ValueError, match="unit-step"):
        W._region(a, (slice(None), slice(0, 3, 2)))
    assert W._region(a, (1, slice(1, 3))) == ([1, 1], [1, 2])


@pytest.mark.parametrize("mechanism", ["donate", "kernel"])
@pytest.mark.parametrize("kind", ["dense", "rotating", "paged", "layers"])
def test_fuzz_campaigns_agree_with_the_spec_through_the_cuda_paths(kind, mechanism, monkeypatch):
    """The CPU cannot run the CUDA paths, so the whole differential harness
    runs here with the CUDA backend stood in for (FakeKernel: the kernel
    path's region, broadcast and completion; donate: the returned array
    callers must keep). A ring or pool that drops the array donate returns,
    or a kernel region that spills past the rows written, diverges here."""
    from kvspec.fuzz.campaign import campaign

    FakeKernel(monkeypatch)
    monkeypatch.setenv("KV_CUDA_INPLACE", mechanism)
    before = dict(W.COUNTS)
    # one batch of 25 examples (budget 0: the verdict does not depend on the
    # machine's load; a smaller batch never reaches the ring's in-place
    # write); under the mutation profile no shrinking (a mutant needs the
    # verdict only, and a shrink was 10-30 s of a killed mutant's time)
    rep = campaign(kind, "fp16", True, 0.0, 20261201, shrink=not reduced())
    assert rep.failure is None, str(rep.failure.error)
    assert rep.stats.get("ops", 0) > 100
    assert W.COUNTS[mechanism] > before[mechanism]  # the stand-in path really ran


def test_kernel_region_of_a_middle_block_touches_no_other_block(monkeypatch):
    """A write into a pool block that is not the last one: the kernel's region
    is exactly the rows written (a region running to the end of the axis
    would broadcast the row into later blocks)."""
    FakeKernel(monkeypatch)
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    slab = mx.zeros((4, 3, 1, 2))
    mx.eval(slab)
    W.write_inplace(slab, mx.ones((1, 1, 1, 2)), (slice(1, 2), slice(1, 2)))
    got = np.array(slab)[:, :, 0, 0]
    assert got.tolist() == [[0, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("mechanism", ["numpy", "kernel"])
def test_write_inplace_casts_and_broadcasts_its_source(mechanism, monkeypatch):
    if mechanism == "kernel":
        FakeKernel(monkeypatch)
        monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    a = mx.zeros((1, 2, 3, 2), dtype=mx.float16)
    mx.eval(a)
    W.write_inplace(a, mx.full((1, 1, 1, 1), 1.5, dtype=mx.float32), W.seq_index(1, 1))
    assert np.array(a)[0, :, :, :].tolist() == [[[0, 0], [1.5, 1.5], [0, 0]]] * 2


REFUSED_SNAPSHOT_AFTER_DONATED_WRITE = {
    "kvtrace": 1,
    "cache": {"mode": "fp16", "step": 256, "batch": 1, "kv_heads": 1, "head_dim": 8, "inplace": True,
              "dtype": "float16", "kind": "layers",
              "layers": [{"kind": "dense", "step": 1}, {"kind": "rotating", "max_size": 2, "keep": 0, "step": 2}]},
    "ops": [{"op": "append", "n": 1}, {"op": "snapshot", "name": "nope"}, {"op": "append", "n": 1},
            {"op": "snapshot", "name": "nope", "error": True},
            {"op": "expect", "window": [0, 1], "layer": 1}, {"op": "expect", "window": [0], "layer": 1, "of": "nope"}],
}


@pytest.mark.parametrize("mechanism", ["donate", "kernel"])
def test_a_refused_snapshot_claims_no_sharing(mechanism, monkeypatch):
    """Found on the H200: the ring's warm-up write beside a snapshot is one
    copy under donate, and the harness then demanded that a *refused*
    snapshot (its name in use) share memory with the cache. A refused op
    shares nothing; the trace replays clean under both CUDA mechanisms."""
    from kvspec.fuzz.replay import replay
    from kvspec.fuzz.trace import parse

    FakeKernel(monkeypatch)
    monkeypatch.setenv("KV_CUDA_INPLACE", mechanism)
    result = replay(parse(REFUSED_SNAPSHOT_AFTER_DONATED_WRITE))
    assert result.ok, result.divergence


class ClaimsInPlaceButCopiesValues(KVCache):
    """Reports an in-place write, writes keys in place, but copies the values
    (a values buffer that moves)."""

    def _write_inplace(self, at, rows):
        b = self.buffers
        keys = W.write_inplace(b.keys, rows.keys, W.seq_index(at, 1))
        self.buffers = type(b)(keys, W.write_copy(b.values, rows.values, W.seq_index(at, 1)), out_dtype=b.out_dtype)


def test_on_the_cpu_an_in_place_write_that_moves_either_buffer_diverges():
    """The check that an in-place write keeps the cache's memory runs on the
    CPU (it is only relaxed under CUDA's donate) and covers the values
    buffer as well as the keys."""
    from kvspec.fuzz.campaign import Campaign

    assert W.inplace_keeps_memory()
    # bounded by examples (caught in the first batch from seed 7), read as found (no shrink)
    run = Campaign("dense", "fp16", True, 7, factories={"dense": ClaimsInPlaceButCopiesValues}, shrink=False)
    while run.report.examples < 100 and not run.failed:
        run.batch()
    rep = run.report
    assert rep.failure is not None and "in-place write moved the cache's values memory" in str(rep.failure.error)


# -- the host-side shortcuts of the decode path (issue 20: on a GPU a
# -- 28-layer step pays this Python between its kernels) --

CASTS = [(mx.float32, mx.float16), (mx.float32, mx.bfloat16), (mx.bfloat16, mx.float16), (mx.float16, mx.float32),
         (mx.float32, mx.int8), (mx.float16, mx.uint8)]


@pytest.mark.parametrize("src_dtype,dst_dtype", CASTS)
def test_write_copy_casts_the_rows_to_the_buffer_dtype_as_astype_would(src_dtype, dst_dtype):
    """write_copy leaves the cast to MLX's slice assignment: the result is
    the buffer's dtype and holds exactly what an explicit astype gives."""
    values = mx.array(np.linspace(-3.7, 250.3, 12, dtype=np.float32).reshape(1, 2, 2, 3)).astype(src_dtype)
    a = mx.zeros((1, 2, 5, 3), dtype=dst_dtype)
    mx.eval(a, values)
    out = W.write_copy(a, values, W.seq_index(1, 2))
    want = mx.concatenate([a[:, :, :1], values.astype(dst_dtype), a[:, :, 3:]], axis=2)
    assert out.dtype == dst_dtype
    assert np.array_equal(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_the_cuda_mechanism_follows_the_environment_at_every_call(monkeypatch):
    """KV_CUDA_INPLACE is read at each write (its direct read of os.environ's
    mapping sees setenv, delenv and plain assignment)."""
    monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    assert W.cuda_inplace() == "donate"
    monkeypatch.setenv("KV_CUDA_INPLACE", "kernel")
    assert W.cuda_inplace() == "kernel"
    monkeypatch.setenv("KV_CUDA_INPLACE", " Donate ")
    assert W.cuda_inplace() == "donate"
    monkeypatch.setenv("KV_CUDA_INPLACE", "")
    assert W.cuda_inplace() == "donate"
    monkeypatch.delenv("KV_CUDA_INPLACE")
    assert W._env_value("KV_CUDA_INPLACE") is None
    monkeypatch.setenv("KVSPEC_TEST_OTHER", "x")
    assert W._env_value("KVSPEC_TEST_OTHER") == "x"  # a name without a precomputed key


def test_the_backend_is_read_for_the_current_default_device():
    assert W.backend() == "cpu"
    with mx.stream(mx.cpu):
        assert W.backend() == "cpu"
    assert all(v in ("cpu", "cuda", "metal") for v in W._BACKENDS.values())


def test_the_backend_answer_is_kept_per_device_not_once_for_the_process(monkeypatch):
    """With CUDA available, the GPU's answer is "cuda" and the CPU's is still
    "cpu", in either order: a cache of one answer for the process would give
    the first device's answer to both."""

    class FakeGPU:
        type = mx.DeviceType.gpu

    monkeypatch.setattr(W, "_BACKENDS", {})
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert W.backend() == "cpu"
    monkeypatch.setattr(mx, "default_device", lambda: FakeGPU())
    assert W.backend() == "cuda"
    monkeypatch.undo()
    monkeypatch.setattr(W, "_BACKENDS", {})
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: FakeGPU())
    assert W.backend() == "cuda"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert W.backend() == "cpu"


def test_the_backend_cache_holds_one_entry_per_device_type(monkeypatch):
    """The decode path asks backend() per layer per step: its cache must hit.
    MLX hands out a new Device object, with its own hash, at every
    mx.default_device(), so a cache keyed on the Device grows by one entry a
    call (seen failing that way: 1,000 entries after 1,000 calls)."""
    monkeypatch.setattr(W, "_BACKENDS", {})
    for _ in range(1000):
        W.backend()
    with mx.stream(mx.cpu):
        W.backend()
    assert len(W._BACKENDS) <= 1  # a CPU needs no entry
    asked = []
    monkeypatch.setattr(mx.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu, 0))
    for _ in range(1000):
        assert W.backend() == "cuda"
    assert W._BACKENDS == {"gpu": "cuda"} and asked == [1]


def _full_window_cases():
    dense = KVCache("fp16", step=4, inplace=True)
    ring = RotatingKVCache(max_size=4, keep=1, step=4, inplace=True)
    return {"dense": dense, "ring": ring}


@pytest.mark.parametrize("mechanism", ["numpy", "donate"])
@pytest.mark.parametrize("which", ["dense", "ring"])
def test_a_window_that_is_the_whole_buffer_is_a_new_handle_on_its_memory(which, mechanism, monkeypatch):
    """At a full buffer the decode path hands out handles of the buffers
    themselves, not slices: the same rows and memory, but a caller that
    assigns into its window changes neither the cache nor an earlier
    window."""
    if mechanism == "donate":
        stand_in(monkeypatch, "cuda")
        monkeypatch.delenv("KV_CUDA_INPLACE", raising=False)
    c = _full_window_cases()[which]
    mx.eval(c.update_and_fetch(rows(3, 1), rows(3, 1)))
    for step in range(3):  # fills the buffer, then (ring) wraps
        k, v = c.update_and_fetch(rows(1, 2 + step), rows(1, 2 + step))
        mx.eval(k, v)
        buf_k, buf_v = (c.buffers.keys, c.buffers.values) if which == "dense" else (c.keys, c.values)
        assert k is not buf_k and v is not buf_v
        assert k.shape == buf_k.shape and v.shape == buf_v.shape  # the whole buffer
        before = np.array(buf_k).copy()
        k[:, :, 0:1] = rows(1, 9)  # the caller's own handle
        v[...] = 0
        mx.eval(k, v)
        assert np.array_equal(np.array(buf_k), before)
        assert float(np.array(buf_v).sum()) != 0
        if which == "dense":
            c.trim(1)  # rollback at the buffer's edge: the next append fills it again
