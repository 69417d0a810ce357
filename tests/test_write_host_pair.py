"""The host write of ``kvspec.impl.write`` (the ``numpy`` mechanism, CPU and
Apple unified memory) in one evaluation: ``write_inplace_numpy`` evaluates the
buffer, the rows and the reads queued by ``queue_read`` in one ``mx.eval``,
and ``write_inplace_numpy_pair`` (a dense or ring decode write of a key/value
pair) does so for both buffers and both rows. What that must keep:

* the order of the module docstring: a read queued before the write reads
  the row as it was before the write (for the pair too, in both buffers);
* the rows land where they belong: keys in the key buffer, values in the
  value buffer, with equal head dims (a mix-up raises nothing there), bit
  for bit, bfloat16 included, and into a buffer that was still lazy;
* one evaluation: the rows are among the arrays of the one ``mx.eval``
  (evaluated by NumPy's conversion instead, each would cost a round trip
  to MLX's stream thread).
"""

import mlx.core as mx
import numpy as np
import pytest

from kvspec.impl import write as W

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
ROW = (slice(None), slice(None), slice(2, 3))


def bits(a):
    """The array's bytes (bfloat16 through uint16: exact)."""
    return np.array(mx.view(a, mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def slow_gather(dst):
    """Row 2 of ``dst``, gathered only after some slow work (so that a
    write that does not wait for it lands first)."""
    slow = mx.ones((256, 256))
    for _ in range(3):
        slow = slow @ slow / 256
    at = (slow[0, :1] * 0).astype(mx.int32) + 2
    return mx.take(dst, at, axis=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pair_write_comes_after_the_reads_queued_before_it(dtype):
    """A ring's undo log queues the rows a decode overwrites; the pair write
    of that row must wait for both gathers (seen failing with the queued
    reads left out of the pair's ``mx.eval``)."""
    keys, values = mx.zeros((1, 2, 4, 8), dtype=dtype), mx.zeros((1, 2, 4, 8), dtype=dtype)
    nk, nv = mx.ones((1, 2, 1, 8), dtype=dtype), mx.full((1, 2, 1, 8), 2.0, dtype=dtype)
    mx.eval(keys, values, nk, nv)
    saved = (slow_gather(keys), slow_gather(values))
    W.queue_read(*saved)
    k, v = W.write_inplace_pair(keys, nk, values, nv, ROW, "numpy")
    assert k is keys and v is values
    for a in saved:
        assert not np.array(a.astype(mx.float32)).any(), "a queued read saw the later write"
    assert (np.array(keys[:, :, 2].astype(mx.float32)) == 1).all()
    assert (np.array(values[:, :, 2].astype(mx.float32)) == 2).all()
    assert W._QUEUED == ()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lazy", [False, True])
def test_a_pair_write_puts_keys_in_keys_and_values_in_values_bit_for_bit(dtype, lazy):
    """Equal head dims (a keys/values mix-up fits either buffer); rows given
    in float32 are cast to the buffers' dtype; a buffer still lazy (a
    regrow's concatenate) is written in its own memory, seen by a sharer."""
    keys, values = mx.zeros((1, 2, 4, 8), dtype=dtype), mx.zeros((1, 2, 4, 8), dtype=dtype)
    if lazy:
        keys, values = keys + 0, values + 0
    else:
        mx.eval(keys, values)
    held_k, held_v = keys[:, :, :], values[:, :, :]
    rng = np.random.default_rng(0)
    nk, nv = (mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32)) for _ in range(2))
    before = W.COUNTS["numpy"]
    k, v = W.write_inplace_pair(keys, nk, values, nv, ROW, "numpy")
    assert k is keys and v is values and W.COUNTS["numpy"] == before + 2
    for buf, held, rows in ((keys, held_k, nk), (values, held_v, nv)):
        want = rows.astype(dtype)
        assert bits(buf[:, :, 2:3]) == bits(want) and bits(held[:, :, 2:3]) == bits(want)
        assert not np.array(buf[:, :, :2].astype(mx.float32)).any()
        assert not np.array(buf[:, :, 3:].astype(mx.float32)).any()


class EvalSpy:
    """Stands in for ``mx`` inside the write layer: records each ``mx.eval``'s
    arguments, everything else is MLX's."""

    def __init__(self):
        self.calls = []

    def eval(self, *arrays):
        self.calls.append(arrays)
        return mx.eval(*arrays)

    def __getattr__(self, name):
        return getattr(mx, name)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_a_pair_write_evaluates_buffers_rows_and_queued_reads_in_one_eval(dtype, monkeypatch):
    """One ``mx.eval`` for the pair, holding both rows (the same arrays
    NumPy then copies: already evaluated) and the queued reads; one for a
    single write too (seen failing with the rows left to NumPy's
    conversion, and with two single writes for the pair)."""
    keys, values = mx.zeros((1, 2, 4, 8), dtype=dtype), mx.zeros((1, 2, 4, 8), dtype=dtype)
    mx.eval(keys, values)
    nk, nv = mx.ones((1, 2, 1, 8), dtype=dtype) * 3, mx.ones((1, 2, 1, 8), dtype=dtype) * 5  # lazy
    queued = mx.take(keys, mx.array([1]), axis=2)
    W.queue_read(queued)
    spy = EvalSpy()
    monkeypatch.setattr(W, "mx", spy)
    W.write_inplace_pair(keys, nk, values, nv, ROW, "numpy")
    assert len(spy.calls) == 1, spy.calls
    (args,) = spy.calls
    for a in (keys, values, nk, nv, queued):
        assert any(x is a for x in args), "an operand was left out of the one evaluation"
    row = mx.ones((1, 2, 1, 8), dtype=dtype) * 7
    W.write_inplace(keys, row, (slice(None), slice(None), slice(3, 4)), "numpy")
    assert len(spy.calls) == 2 and any(x is row for x in spy.calls[1])
    monkeypatch.undo()
    assert (np.array(keys[:, :, 2:4].astype(mx.float32)) == np.array([3, 7])[None, None, :, None]).all()
    assert (np.array(values[:, :, 2].astype(mx.float32)) == 5).all()
