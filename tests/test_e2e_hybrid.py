"""Hybrid models (recurrent layers beside attention) in mlx-lm's loops (issue 48).

tests/test_e2e.py runs every registered scenario, the hybrid ones (14 to 16)
included, at the short size. Here: the tiny models are live hybrids, the
hybrid scenarios fail on broken caches and recorders (injected bugs of
``kvspec.fuzz.bugs.recurrent`` and local ones), scenario 16 cannot pass on a
rollback that does not pretend, and bfloat16 models decode exactly too.
"""

from __future__ import annotations

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")

from kvspec.fuzz.bugs import by_name as bug_by_name
from kvspec.fuzz.commands.e2e import hybrid, run_scenario
from kvspec.fuzz.commands.e2e.checks import Size
from kvspec.fuzz.commands.e2e.hybrid import (
    build_hybrid,
    forced_caches,
    recurrent_states,
    speculative_run,
    teacher_run,
)
from kvspec.fuzz.commands.e2e.models import HYBRID_FAMILIES, mlx_lm_caches, tiny_hybrid, token_ids
from kvspec.fuzz.commands.e2e.streams import greedy
from kvspec.impl.models import trim_prompt_cache
from kvspec.impl.recurrent import RecurrentCache
from kvspec.spec.errors import RollbackWarning

#: one seed, short streams: enough for a broken cache to show
TINY = Size(tokens=16, window=8, seeds=(0,))


# -- the models ----------------------------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_tiny_hybrid_is_a_live_float32_hybrid(family):
    """Recurrent layers (RecurrentCache) beside attention layers, float32,
    seeded; and the recurrent layers matter: zeroing their arrays changes
    the next logits (a zero-initialised RG-LRU, mlx-lm's default before a
    checkpoint loads, would not)."""
    model = tiny_hybrid(family, 0)
    caches = build_hybrid(model, 2)
    kinds = [type(c).__name__ for c in caches]
    assert "RecurrentCache" in kinds and set(kinds) - {"RecurrentCache"}, kinds
    params = [p for _, p in tree_flatten(model.parameters())]
    assert {p.dtype for p in params} == {mx.float32}
    prompt = token_ids(0, 12)
    model(prompt[None], cache=caches)
    nxt = mx.array([[7]], dtype=mx.uint32)
    zeroed = copy.deepcopy(caches)
    for c in zeroed:
        if isinstance(c, RecurrentCache):
            c.cache = [mx.zeros_like(a) for a in c.cache]
    a, b = model(nxt, cache=copy.deepcopy(caches)), model(nxt, cache=zeroed)
    assert not np.array_equal(np.array(a), np.array(b)), "the recurrent layers do not affect the logits"
    again = tiny_hybrid(family, 0)
    other = tiny_hybrid(family, 1)
    assert np.array_equal(np.array(again(prompt[None])), np.array(model(prompt[None])))
    assert not np.array_equal(np.array(other(prompt[None])), np.array(model(prompt[None])))


def test_tiny_hybrid_refuses_an_unknown_family():
    with pytest.raises(KeyError, match="no tiny hybrid family 'mamba9'"):
        tiny_hybrid("mamba9", 0)


# -- the scenarios fail on broken caches ----------------------------------------------
@pytest.mark.parametrize("bug, family", [
    ("conv_window_not_rolled_back", "qwen3_next"),
    ("checkpoint_ring_one_short", "nemotron_h"),
    # the injected recorder bug handles mixers whose input is named x (lfm2, recurrent_gemma)
    ("recorder_splits_wrong_end", "lfm2"),
])
def test_hybrid_speculative_catches(bug, family):
    result = run_scenario("hybrid_speculative", TINY, bug_by_name(bug).factories, families=(family,))
    assert not result.ok
    assert ("speculative vs greedy" in result.detail or "StateError" in result.detail
            or "conv window / recurrent state" in result.detail), result.detail


@pytest.mark.parametrize("bug, family, says", [
    ("conv_window_not_rolled_back", "recurrent_gemma", "conv window / recurrent state"),
    ("checkpoint_ring_one_short", "qwen3_next", "conv window / recurrent state"),
    ("recorder_splits_wrong_end", "lfm2", "prefill call, trim 1: trim_prompt_cache returned 0"),
])
def test_hybrid_prompt_reuse_catches(bug, family, says):
    result = run_scenario("hybrid_prompt_reuse", TINY, bug_by_name(bug).factories, families=(family,))
    assert not result.ok and says in result.detail, result.detail


class QuietRefusal(RecurrentCache):
    """Refuses a rollback beyond its coverage without a word (no
    RollbackWarning, no StateError even when strict)."""

    def warn_refused_rollback(self, n):
        pass


def test_hybrid_prompt_reuse_catches_a_quiet_refusal():
    result = run_scenario("hybrid_prompt_reuse", TINY, {"recurrent": QuietRefusal}, families=("lfm2",))
    assert not result.ok and "returned 0 silently" in result.detail, result.detail


class TrimsOffsetOnly(RecurrentCache):
    """Counts the rollback (offset, coverage) but keeps the live arrays: a
    rollback that pretends, inside kvspec's own class."""

    def trim(self, n):
        arrays = list(self.cache)
        got = super().trim(n)
        self.cache = arrays
        return got


def test_hybrid_scenarios_catch_a_rollback_that_only_moves_the_offset():
    for name in ("hybrid_speculative", "hybrid_prompt_reuse"):
        result = run_scenario(name, TINY, {"recurrent": TrimsOffsetOnly}, families=("nemotron_h",))
        assert not result.ok, name


def test_the_mlx_lm_scenario_needs_the_forced_rollback_to_drift(monkeypatch):
    """Scenario 16 requires the pretended rollback to show: with caches that
    roll back exactly in its place, it fails (it could not tell them apart
    otherwise)."""
    monkeypatch.setattr(hybrid, "forced_caches", lambda model, depth: build_hybrid(model, depth))
    result = run_scenario("hybrid_mlx_lm", TINY, families=("lfm2",))
    assert not result.ok and "cannot tell a rollback that only pretends" in result.detail, result.detail


def test_forced_caches_pretend():
    """What scenario 16 forces: mlx-lm's ArraysCache that answers
    is_trimmable() True and trim(n) = n, arrays unchanged."""
    model = tiny_hybrid("qwen3_next", 0)
    caches = forced_caches(model, 2)
    model(token_ids(0, 6)[None], cache=caches)
    layer = caches[0]
    before = [np.array(a) for a in layer.cache]
    assert layer.is_trimmable() and layer.trim(3) == 3
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, layer.cache))


# -- bfloat16 ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["lfm2", "nemotron_h", "qwen3_next"])
def test_bf16_hybrid_decodes_exactly(family):
    """A bfloat16 hybrid: greedy decoding with our caches (depth 0) gives
    mlx-lm's tokens and bfloat16 log-probability bytes; the recurrent
    layers keep the model's dtypes; speculative decoding (draft = target,
    k = 2) gives greedy decoding's tokens with our depth-2 caches; a trim
    of 2 puts back the states a run without those tokens has, bytes."""
    model = tiny_hybrid(family, 0, dtype=mx.bfloat16)
    prompt = token_ids(0, 12)
    ref_caches = mlx_lm_caches(model)
    ref = greedy(model, ref_caches, prompt, 12)
    ours = build_hybrid(model, 0)
    got = greedy(model, ours, prompt, 12)
    assert got.tokens == ref.tokens and got.logprobs == ref.logprobs
    lm_dtypes = [[a.dtype for a in c.cache] for c in ref_caches if hasattr(c, "cache")]
    assert [[a.dtype for a in c.cache] for c in ours if isinstance(c, RecurrentCache)] == lm_dtypes
    assert mx.bfloat16 in {d for ds in lm_dtypes for d in ds}
    plain = greedy(model, build_hybrid(model, 2), prompt, 12)
    caches = build_hybrid(model, 2) + build_hybrid(model, 2)
    spec = speculative_run(model, model, caches, prompt, 12, 2)
    assert spec.stream.tokens == plain.tokens and spec.accepted == spec.drafted
    live = build_hybrid(model, 2)
    first = greedy(model, live, prompt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RollbackWarning)
        assert trim_prompt_cache(live, 2) == 2
    never = teacher_run(model, build_hybrid(model, 2), prompt, first.tokens[:0])
    assert recurrent_states(live) == recurrent_states(never)
