"""kvspec.impl.recurrent against mlx-lm's protocol where a breakage hunt found the
harness blind (issue 48): make_prompt_cache's ``undo`` alone installs the
step recorder, and the batch protocol (extract, filter) keeps each batch
element's arrays, offset and depth with no checkpoints."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvspec.fuzz.layers import LayoutModel
from kvspec.fuzz.recurrent import FakeModel
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.recurrent import RecurrentCache, record_steps


def _call(mixer, cache, tokens, batch=1, channels=4):
    x = mx.array(np.array([[[t + 1 + b * 100.0] * channels for t in tokens] for b in range(batch)], np.float32))
    mixer(x, None, cache)


def test_undo_alone_installs_the_recorder():
    """``undo=U`` without ``num_draft_tokens``: every recurrent layer of
    depth U is recorded, so a call leaves coverage U (not 0)."""
    model = LayoutModel([{"kind": "dense"}, {"kind": "recurrent", "size": 2, "kernel": 3}])
    caches = make_prompt_cache(model, undo=2)
    assert caches[1].depth == 2
    _call(model.layers[1].mixer, caches[1], [0, 1, 2, 3])
    assert caches[1].offset == 4 and caches[1].trimmable_rows() == 2


def test_extract_and_filter_keep_the_batch_axis_and_clear_the_checkpoints():
    model = FakeModel(3, 2)
    record_steps(model)
    c = RecurrentCache(size=2, depth=2, strict=True)
    _call(model.layers[0].mixer, c, [0, 1, 2, 3], batch=2)
    assert c.trimmable_rows() == 2
    live = [np.array(a) for a in c.cache]
    for b in range(2):
        one = c.extract(b)
        assert [tuple(a.shape) for a in one.cache] == [(1, 2, 4), (1, 3)]
        assert all(np.array_equal(np.array(a), w[b:b + 1]) for a, w in zip(one.cache, live))
        assert (one.offset, one.depth, one.strict, one.trimmable_rows()) == (4, 2, True, 0)
    c.filter(mx.array([1]))
    assert [tuple(a.shape) for a in c.cache] == [(1, 2, 4), (1, 3)] and c.trimmable_rows() == 0
    assert all(np.array_equal(np.array(a), w[1:2]) for a, w in zip(c.cache, live))
