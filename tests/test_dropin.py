"""Drop-in for mlx-lm beyond one stream (issue 24): loud rollbacks,
``num_draft_tokens``, quantized modes on models with sliding-window layers.
The real-decoding checks are the e2e scenarios (tests/test_e2e.py runs
them); these pin the unit rules and see the scenarios fail on broken
variants."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.commands.e2e import run_scenario, tiny_gemma3
from kvspec.impl.dense import KVCache
from kvspec.impl.models import make_prompt_cache, trim_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, RollbackWarning, StateError


def rows(n: int, start: int = 0) -> mx.array:
    a = np.arange(start, start + n, dtype=np.float32)[None, None, :, None] * np.ones((1, 2, 1, 4), np.float32)
    return mx.array(a).astype(mx.float16)


def wrapped_pair(undo: int) -> list:
    """A dense layer and a ring of window 3 (undo ``undo``) after 5 decode steps: the ring has wrapped."""
    caches = [KVCache("fp16", step=2), RotatingKVCache(max_size=3, undo=undo)]
    for i in range(5):
        for c in caches:
            c.update_and_fetch(rows(1, i), rows(1, i))
    return caches


def refusals(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, RollbackWarning)]


def test_a_refused_list_rollback_warns_once_per_cache_and_strict_raises():
    caches = wrapped_pair(undo=1)
    offsets = [c.offset for c in caches]
    got = refusals(lambda: [trim_prompt_cache(caches, 2) for _ in range(3)])
    assert len(got) == 1 and "num_draft_tokens" in str(got[0].message)
    assert [c.offset for c in caches] == offsets  # nothing trimmed
    with pytest.raises(StateError, match=r"cannot roll back 2 rows exactly: layer\(s\) \[1\]"):
        trim_prompt_cache(caches, 2, strict=True)
    assert [c.offset for c in caches] == offsets
    assert trim_prompt_cache(caches, 1, strict=True) == 1  # within the undo log: exact, silent
    bare = wrapped_pair(undo=0)
    got = refusals(lambda: trim_prompt_cache(bare, 1))  # a one-row rollback is as loud
    assert len(got) == 1 and [c.offset for c in bare] == [5, 5]
    with pytest.raises(InvalidArgumentError, match="strict must be True or False"):
        trim_prompt_cache(caches, 1, strict=1)


def test_a_ring_refusing_trim_warns_once_and_an_honoured_one_is_silent():
    ring = wrapped_pair(undo=2)[1]
    assert refusals(lambda: ring.trim(1)) == [] and ring.offset == 4
    got = refusals(lambda: [ring.trim(3), ring.trim(3)])
    assert len(got) == 1 and ring.offset == 4


def test_is_trimmable_false_after_rollbacks_warns_on_a_ring_without_undo():
    """mlx-lm's speculative loop asks is_trimmable() before each rollback and
    skips it everywhere when False: a ring with undo=0 says so once, trimmed
    before or not."""
    ring = RotatingKVCache(max_size=3)
    ring.update_and_fetch(rows(2), rows(2))
    assert ring.trim(1) == 1
    for i in range(4):
        ring.update_and_fetch(rows(1, i), rows(1, i))
    got = refusals(lambda: [ring.is_trimmable(), ring.is_trimmable()])
    assert len(got) == 1
    fresh = wrapped_pair(undo=0)[1]  # never trimmed: its first False warns all the same (issue 47)
    assert len(refusals(lambda: [fresh.is_trimmable(), fresh.is_trimmable()])) == 1


def test_num_draft_tokens_sizes_every_ring():
    gemma = tiny_gemma3(0, window=6)
    caches = make_prompt_cache(gemma, num_draft_tokens=5)
    assert [c.undo for c in caches if isinstance(c, RotatingKVCache)] == [5, 5]
    caches = make_prompt_cache(gemma, num_draft_tokens=2, undo=4)
    assert [c.undo for c in caches if isinstance(c, RotatingKVCache)] == [4, 4]
    for bad in (-1, 1.5):
        with pytest.raises(InvalidArgumentError, match="num_draft_tokens"):
            make_prompt_cache(gemma, num_draft_tokens=bad)


class SilentRing(RotatingKVCache):
    """A ring that refuses rollbacks as ours does, without a word (the bug
    this issue closes)."""

    def warn_refused_rollback(self, n):
        return None


def test_the_drift_scenario_fails_on_a_silent_ring():
    result = run_scenario("speculative_drift", factories={"rotating": SilentRing})
    assert not result.ok and "silently (no RollbackWarning)" in result.detail, result.detail


@pytest.mark.parametrize("mode", ["int8", "turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"])
def test_every_quantized_mode_keeps_sliding_window_layers_as_rings(mode):
    caches = make_prompt_cache(tiny_gemma3(0, window=6), mode=mode, step=4)
    assert [type(c).__name__ for c in caches[:2]] == ["RotatingKVCache", "RotatingKVCache"]
    assert caches[2].mode == mode


def test_the_quantized_scenario_fails_when_a_ring_is_quantized():
    """A variant that quantizes sliding-window layers away (an Int8 dense
    cache in their place) is caught by the layout check."""
    class Int8Everywhere(KVCache):
        def __init__(self, mode="fp16", **kw):
            super().__init__(mode="int8", step=kw.get("step", 256), inplace=kw.get("inplace"))

    def ring_as_int8(max_size, keep, step, inplace, undo):
        return Int8Everywhere(step=step, inplace=inplace)

    result = run_scenario("quantized_models", factories={"rotating": ring_as_int8})
    assert not result.ok and "expected 2 fp16 rings" in result.detail, result.detail
