"""The harness against broken list-level and harness code (issue 48, a
review that broke it): a list trim that trims nothing must be loud exactly
for the refusing layers (RollbackWarning once per refusing cache, StateError
naming them with ``strict``), a wrong state or conv window confined to batch
element 1 is reported, and a list snapshot of a recurrent layer that
changes after it was taken is reported as an isolation failure."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz.layers import ListOps
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.trace import parse
from kvspec.impl import layers as impl_layers
from kvspec.spec.errors import RollbackWarning, StateError

HYBRID = {"kind": "layers", "layers": [{"kind": "dense"}, {"kind": "recurrent", "kernel": 3, "depth": 1},
                                       {"kind": "rotating", "max_size": 2}]}
#: 3 single-token calls: the recurrent layer covers 1 token, the ring (no
#: undo log) has wrapped; a list trim of 1 is refused by the ring alone, of 2
#: by both. TWO_RECURRENT: two recurrent layers (a ring warns once per cache
#: already when ``can_trim`` is asked, so two of them tell "every refusing
#: layer warns" from "the first warns")
TWO_RECURRENT = {"kind": "layers", "layers": [{"kind": "dense"}, {"kind": "recurrent", "kernel": 3, "depth": 1},
                                              {"kind": "recurrent", "kernel": 2, "size": 1, "depth": 1}]}
OPS = [{"op": "append", "n": 1}] * 3


class QuietListTrim(ListOps):
    """mlx-lm's refusal: 0 without a word."""

    def trim(self, caches, n):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RollbackWarning)
            return impl_layers.trim_prompt_cache(caches, n)


class FirstLayerWarnsOnly(ListOps):
    """Only the first refusing layer warns."""

    def trim(self, caches, n):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RollbackWarning)
            got = impl_layers.trim_prompt_cache(caches, n)
        for w in seen[:1]:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return got


class StrictNamesEveryLayer(ListOps):
    """strict=True names every layer, the ones that could roll back too."""

    def trim_strict(self, caches, n):
        try:
            return impl_layers.trim_prompt_cache(caches, n, strict=True)
        except StateError as exc:
            raise StateError(str(exc).replace("layer(s) [", f"layer(s) {list(range(len(caches)))} [")) from None


class StrictRaisesOnNothing(ListOps):
    """strict=True raises for a trim of 0 tokens."""

    def trim_strict(self, caches, n):
        if n <= 0:
            raise StateError("trim_prompt_cache: nothing to roll back")
        return impl_layers.trim_prompt_cache(caches, n, strict=True)


def _trace(*ops, cache=HYBRID):
    return parse({"kvtrace": 1, "cache": cache, "ops": [*OPS, *ops]})


@pytest.mark.parametrize("n", [1, 2])
def test_a_refused_list_trim_is_loud_for_exactly_the_refusing_layers(n):
    for cache in (HYBRID, TWO_RECURRENT):
        got = replay(_trace({"op": "trim", "n": 2, "returns": 0}, {"op": "trim", "n": n}, {"op": "trim", "n": 0},
                            cache=cache))
        assert got.ok, got.divergence


@pytest.mark.parametrize(("ops", "n", "what"), [
    (QuietListTrim, 2, "refused list trim: RollbackWarnings differ"),
    (FirstLayerWarnsOnly, 2, "refused list trim: RollbackWarnings differ"),
    (StrictNamesEveryLayer, 2, "strict refused list trim"),
    (StrictRaisesOnNothing, 0, "strict list trim of nothing"),
])
def test_a_list_trim_quiet_or_loud_for_the_wrong_layers_diverges(ops, n, what):
    got = replay(_trace({"op": "trim", "n": n}, cache=TWO_RECURRENT), {"layers": {"layers": ops}})
    assert not got.ok and got.divergence.index == 3 and what in got.divergence.what, got.divergence


def _lock(**cache):
    return make_lockstep(parse({"kvtrace": 1, "cache": {"kind": "recurrent", **cache}, "ops": []}).cache)


@pytest.mark.parametrize("index", [0, 1])
def test_a_wrong_array_of_batch_element_1_alone_is_reported(index):
    lk = _lock(depth=0, kernel=3, batch=2, dtype="bfloat16")
    lk.step(0, {"op": "append", "n": 2})
    stale = lk.cache.cache[index]
    lk.step(1, {"op": "append", "n": 1})
    live = lk.cache.cache[index]
    lk.cache.cache[index] = mx.concatenate([live[:1], stale[1:]], axis=0)  # batch 0 right, batch 1 stale
    with pytest.raises(Divergence) as err:
        lk.step(2, {"op": "fetch"})
    assert ("recurrent state differs" if index else "conv window differs") in str(err.value)


def test_a_list_snapshot_of_a_recurrent_layer_that_changes_is_reported():
    doc = {"kvtrace": 1, "cache": {"kind": "layers", "layers": [{"kind": "dense"}, {"kind": "recurrent", "kernel": 3}]},
           "ops": [{"op": "append", "n": 2}, {"op": "snapshot", "name": "s"}, {"op": "append", "n": 1}]}
    trace = parse(doc)
    lk = make_lockstep(trace.cache)
    for i, op in enumerate(trace.ops):
        lk.step(i, op)
    snap = lk.holders["s"][1]
    object.__setattr__(snap, "arrays", tuple(lk.caches[1].cache))  # the snapshot now holds the live arrays
    with pytest.raises(Divergence, match="view of 's' changed"):
        lk.step(3, {"op": "fetch"})
    assert np.array_equal(np.array(snap.arrays[0]), np.array(lk.caches[1].cache[0]))
