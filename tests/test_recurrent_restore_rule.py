"""The rule for a recurrent layer taking another layer's snapshot
(semantics.md 9, "restore across layers"): spec and implementation state
the same one."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvspec.impl.recurrent import RecurrentCache
from kvspec.spec import layers as sl
from kvspec.spec import recurrent as src
from kvspec.spec.errors import InvalidArgumentError


def test_spec_snapshot_fits_by_size_depth_and_kernel_when_both_hold_a_window():
    a, b = src.empty(2, 4, 2), src.empty(2, 3, 2)
    fed = lambda c: src.step(c, (1, 2))
    assert src.snapshot_fits(a, b) and src.snapshot_fits(fed(a), b) and src.snapshot_fits(a, fed(b))
    assert not src.snapshot_fits(fed(a), fed(b))  # both hold a conv window of another width
    assert src.snapshot_fits(fed(a), fed(src.empty(2, 4, 2)))
    assert not src.snapshot_fits(a, src.empty(2, 4, 1)) and not src.snapshot_fits(a, src.empty(1, 4, 2))


def test_list_restore_mixed_reads_the_named_snapshot():
    w = sl.new_world((sl.DenseLayer(), sl.RecurrentLayer(2, 4, 2), sl.RecurrentLayer(2, 3, 2)))
    _, w = sl.apply_op(w, {"op": "snapshot", "name": "empty"})
    _, w = sl.apply_op(w, {"op": "append", "n": 2})
    _, w = sl.apply_op(w, {"op": "snapshot", "name": "fed"})
    _, w = sl.apply_op(w, {"op": "append", "n": 1})
    assert sl.layers_interchangeable(w.layers[1], w.layers[2], "empty")
    assert not sl.layers_interchangeable(w.layers[1], w.layers[2], "fed")
    with pytest.raises(InvalidArgumentError, match="layer 1 refuses the snapshot of layer 2"):
        sl.apply_op(w, {"op": "restore_mixed", "name": "fed", "layer": 1, "source": 2})
    with pytest.raises(InvalidArgumentError, match="take each other's snapshots"):
        sl.apply_op(w, {"op": "restore_mixed", "name": "empty", "layer": 1, "source": 2})


def _fed(kernel: int, dtype=mx.float32, depth: int = 2) -> RecurrentCache:
    c = RecurrentCache(2, depth)
    c[0] = mx.zeros((1, kernel - 1, 4), dtype=dtype)
    c[1] = mx.zeros((1, 4, 4), dtype=dtype)
    c.advance(1)
    return c


def test_impl_restore_checks_the_conv_window_when_both_hold_one():
    live, other = _fed(4), _fed(3)
    before = (live.offset, list(live.cache))
    with pytest.raises(InvalidArgumentError, match="conv window .* does not fit"):
        live.restore(other.snapshot())
    assert (live.offset, list(live.cache)) == before
    with pytest.raises(InvalidArgumentError, match="conv window"):
        live.restore(_fed(4, mx.bfloat16).snapshot())
    live.restore(RecurrentCache(2, 2).snapshot())  # a snapshot of an empty layer: no window to compare
    assert live.offset == 0 and live[0] is None
    empty = RecurrentCache(2, 2)
    empty.restore(other.snapshot())  # an empty layer cannot tell its kernel
    assert empty[0].shape == (1, 2, 4)
    with pytest.raises(InvalidArgumentError, match="depth=1"):
        _fed(4).restore(_fed(4, depth=1).snapshot())
