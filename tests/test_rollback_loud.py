"""Issue 47, item 2: every refused rollback is loud, unit level.

A sliding-window ring that went past its window during the prefill (the
ordinary case: a prompt longer than the window) refuses a rollback it
cannot honour on its first request, with no trim before it; that first
refusal warns (``RollbackWarning``) exactly once per cache, through every
path a caller rolls back by: the ring's ``trim`` and ``is_trimmable``,
our list ``trim_prompt_cache`` (``strict=True`` raises instead), mlx-lm's
``trim_prompt_cache`` (which asks ``is_trimmable`` and skips the rollback
on False), in every storage mode of ``make_prompt_cache``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest

from kvspec.fuzz.commands.e2e.models import tiny_gemma3, token_ids
from kvspec.impl.layers import can_trim_prompt_cache, trim_prompt_cache
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.paged import PagedKVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import RollbackWarning, StateError

MODES = ("fp16", "int8", "turbo4asym", "turbo4", "turbo3asym", "turbo4delegated")
#: the sliding window of the gemma3 layers, and a prompt longer than it
WINDOW, PROMPT = 8, 12


def loud(fn) -> list[str]:
    """The RollbackWarnings ``fn()`` issues (every one: filter "always")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RollbackWarning)]


def prefilled(mode: str) -> tuple[list, list[RotatingKVCache]]:
    """make_prompt_cache(gemma3, mode) (no undo log, no num_draft_tokens)
    after one 12-token prefill: both rings went past their window of 8."""
    model = tiny_gemma3(0, WINDOW)
    caches = make_prompt_cache(model, mode=mode, step=4)
    model(token_ids(0, PROMPT)[None], cache=caches)
    mx.eval([c.state for c in caches])
    rings = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert len(rings) == 2 and all(r.offset == PROMPT and not r.rollback_warned for r in rings)
    return caches, rings


def offsets(caches) -> list[int]:
    return [c.offset for c in caches]


@pytest.mark.parametrize("mode", MODES)
def test_mlx_lm_trim_after_a_prefill_wrap_warns_once(mode):
    """mlx-lm's trim_prompt_cache asks is_trimmable() (can_trim_prompt_cache
    stops at the first False) and skips the rollback: the first ring warns
    at that first request, once; the same request again is silent."""
    from mlx_lm.models.cache import trim_prompt_cache as lm_trim

    caches, rings = prefilled(mode)
    before = offsets(caches)
    got: list[int] = []
    first = loud(lambda: got.append(lm_trim(caches, 2)))
    assert got == [0] and offsets(caches) == before  # nothing trimmed anywhere
    assert len(first) == 1 and "any rollback is refused" in first[0] and "num_draft_tokens" in first[0], first
    assert rings[0].rollback_warned and not rings[1].rollback_warned
    assert loud(lambda: [lm_trim(caches, 2), lm_trim(caches, 1), can_trim_prompt_cache(caches)]) == []
    # the second ring's own first refusal warns (once per cache), later ones do not
    assert len(loud(lambda: rings[1].trim(1))) == 1
    assert loud(lambda: [rings[1].trim(3), rings[1].is_trimmable(), rings[0].trim(1)]) == []
    assert offsets(caches) == before


@pytest.mark.parametrize("mode", MODES)
def test_list_trim_after_a_prefill_wrap_warns_per_ring_once_and_strict_raises(mode):
    """Our trim_prompt_cache: strict=True raises on the first refused
    rollback (nothing trimmed, no warning); without it each refusing ring
    warns once, naming the rows asked; a later refusal is silent."""
    caches, rings = prefilled(mode)
    before = offsets(caches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StateError, match=r"cannot roll back 3 rows exactly: layer\(s\) \[0, 1\]"):
            trim_prompt_cache(caches, 3, strict=True)
    assert caught == [] and offsets(caches) == before and not any(r.rollback_warned for r in rings)
    got: list[int] = []
    first = loud(lambda: got.append(trim_prompt_cache(caches, 3)))
    assert got == [0] and offsets(caches) == before
    assert len(first) == 2 and all("a rollback of 3 rows is refused" in m for m in first), first
    assert loud(lambda: [trim_prompt_cache(caches, 1), trim_prompt_cache(caches, 5)]) == []
    with pytest.raises(StateError):
        trim_prompt_cache(caches, 1, strict=True)  # strict raises every time
    assert offsets(caches) == before


@pytest.mark.parametrize("undo", [0, 4])
@pytest.mark.parametrize("keep", [0, 4])
def test_a_ring_wrapped_by_its_prefill_warns_at_its_first_refused_trim(undo, keep):
    """A ring alone (keep 4: the rings of make_prompt_cache(max_kv_size=)):
    a prefill past the window, then the first trim beyond trimmable_rows()
    warns once; trim_to (the ring's strict form) raises StateError; a ring
    with an undo log still rolls back within it, silently."""
    ring = RotatingKVCache(WINDOW, keep=keep, step=4, undo=undo)
    k = mx.arange(PROMPT * 4, dtype=mx.float16).reshape(1, 1, PROMPT, 4)
    ring.update_and_fetch(k, k)
    assert ring.trimmable_rows() == undo
    with pytest.raises(StateError, match="cannot trim a wrapped sliding-window ring exactly"):
        ring.trim_to(ring.offset - undo - 1)
    first = loud(lambda: ring.trim(undo + 1))
    assert len(first) == 1 and f"a rollback of {undo + 1} rows is refused" in first[0], first
    assert ring.offset == PROMPT
    assert loud(lambda: [ring.trim(undo + 1), ring.is_trimmable(), ring.trim(PROMPT)]) == []
    if undo:
        assert loud(lambda: ring.trim(undo)) == [] and ring.offset == PROMPT - undo


def test_is_trimmable_false_is_the_refusal_with_no_trim_before():
    """The check path alone: the first is_trimmable() False of a ring that
    never trimmed warns (any rollback), once."""
    ring = RotatingKVCache(WINDOW, step=4)
    k = mx.zeros((1, 1, PROMPT, 4), dtype=mx.bfloat16)
    ring.update_and_fetch(k, k)
    first = loud(lambda: [ring.is_trimmable(), ring.is_trimmable()])
    assert len(first) == 1 and "any rollback is refused" in first[0]
    assert loud(lambda: ring.trim(1)) == []


def test_max_kv_size_rings_warn_through_mlx_lm():
    """make_prompt_cache(model, max_kv_size=8) of a model without
    make_cache: every layer a ring with 4 sinks; a 12-row prefill takes
    them past the window; mlx-lm's trim warns at once."""
    from mlx_lm.models.cache import trim_prompt_cache as lm_trim

    class TwoLayers:  # an mlx-lm model as make_prompt_cache reads it: layers, no make_cache
        layers = (None, None)

    caches = make_prompt_cache(TwoLayers(), max_kv_size=WINDOW, step=4)
    assert [(type(c).__name__, c.keep) for c in caches] == [("RotatingKVCache", 4)] * 2
    for c in caches:
        k = mx.zeros((1, 2, PROMPT, 8), dtype=mx.bfloat16)
        c.update_and_fetch(k, k)
    assert len(loud(lambda: lm_trim(caches, 1))) == 1
    assert offsets(caches) == [PROMPT, PROMPT]


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_a_copy_of_a_warned_ring_is_another_cache_and_warns_again(how):
    """A copy (mlx-lm's LRUPromptCache deep-copies a stored prompt cache on
    every fetch, after asking can_trim_prompt_cache on insert) refuses on
    its own account: its first refusal warns."""
    caches, rings = prefilled("fp16")
    assert len(loud(lambda: can_trim_prompt_cache(caches))) == 1  # the stored prompt cache, asked
    fetched = how(rings[0])
    assert fetched.rollback_warned is False and rings[0].rollback_warned is True
    assert len(loud(lambda: fetched.trim(1))) == 1
    assert loud(lambda: rings[0].trim(1)) == []


def test_an_error_filter_makes_every_refusal_raise_in_mlx_lms_loop():
    """Under warnings.simplefilter("error", RollbackWarning) the refusal
    raises out of mlx-lm's trim_prompt_cache, every time (the flag is set
    only once a warning was issued), and nothing is trimmed."""
    from mlx_lm.models.cache import trim_prompt_cache as lm_trim

    caches, rings = prefilled("int8")
    before = offsets(caches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RollbackWarning)
        for _ in range(2):
            with pytest.raises(RollbackWarning, match="any rollback is refused"):
                lm_trim(caches, 2)
    assert offsets(caches) == before and not rings[0].rollback_warned


def test_a_paged_list_never_refuses_a_rollback():
    """The paged kind keeps every row it was given (no window): a rollback
    of any count up to its rows is exact, so it has nothing to warn of."""
    caches = [PagedKVCache(block_size=4) for _ in range(2)]
    for c in caches:
        k = mx.zeros((1, 2, 30, 8), dtype=mx.float16)
        c.update_and_fetch(k, k)
    assert loud(lambda: [can_trim_prompt_cache(caches), trim_prompt_cache(caches, 29)]) == []
    assert offsets(caches) == [1, 1]


def test_importing_fuzz_leaves_the_warning_visible():
    """fuzz (and the CLI, which imports it) no longer installs a
    process-wide ignore filter: a user's refused rollback after importing
    it reaches stderr; inside the harness's steps (fuzz.expected_refusals)
    it is silenced, and only there."""
    code = (
        "import warnings, mlx.core as mx\n"
        "from kvspec import fuzz\n"
        "import kvspec.fuzz.commands.cli, kvspec.fuzz.commands.e2e\n"
        "from kvspec.impl.rotating import RotatingKVCache\n"
        "def ring():\n"
        "    r = RotatingKVCache(4, step=4)\n"
        "    k = mx.zeros((1, 1, 6, 2), dtype=mx.float16)\n"
        "    r.update_and_fetch(k, k)\n"
        "    return r\n"
        "with fuzz.expected_refusals():\n"
        "    assert ring().trim(1) == 0\n"
        "print('inside-done', flush=True)\n"
        "assert ring().trim(1) == 0\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "inside-done"
    assert out.stderr.count("RollbackWarning") == 1, out.stderr


def test_the_harness_silences_its_own_refusals_inside_a_step_only():
    """A lockstep replay of a ring that refuses trims (a prefill past the
    window, then trims) lets no RollbackWarning out of its steps (each
    step runs under fuzz.expected_refusals), though the ring did warn; the
    filters are the caller's again after the step."""
    from kvspec.fuzz.replay import make_lockstep
    from kvspec.fuzz.targets import resolve

    cache = {"kind": "rotating", "mode": "fp16", "batch": 1, "kv_heads": 1, "head_dim": 4, "dtype": "float16",
             "max_size": 4, "keep": 0, "step": 2, "undo": 0, "inplace": True}
    lock = make_lockstep(cache, None, True, resolve("impl"))
    ops = [{"op": "append", "n": 6}, {"op": "trim", "n": 1}, {"op": "append", "n": 1}, {"op": "trim", "n": 2}]
    got = loud(lambda: [lock.step(i, op) for i, op in enumerate(ops)])
    assert got == [] and lock.cache.rollback_warned and lock.cache.offset == 7
    assert len(loud(lambda: copy.copy(lock.cache).trim(1))) == 1  # outside a step: heard


# -- the rotating lockstep checks the warning (kvspec.fuzz.rotating.check_rollback_warning) ---------------
class _SilentIsTrimmable(RotatingKVCache):
    def is_trimmable(self) -> bool:  # False without the warning
        return self._counters_rewind_exact() or self.trimmable_rows() > 0


class _PartialRefusalSilent(RotatingKVCache):
    def warn_refused_rollback(self, n):  # warns only when nothing at all can be rolled back
        if n is None or self.trimmable_rows() == 0:
            super().warn_refused_rollback(n)


class _FlagSetFirst(RotatingKVCache):
    def warn_refused_rollback(self, n):  # the flag set before warnings.warn, which may raise
        if self.rollback_warned:
            return
        self.rollback_warned = True
        warnings.warn(f"a rollback of {n} rows is refused", RollbackWarning, stacklevel=2)


class _CopyKeepsWarned(RotatingKVCache):
    def __deepcopy__(self, memo):  # the flag copied into the copy
        new = super().__deepcopy__(memo)
        new.rollback_warned = self.rollback_warned
        return new


_RING = {"mode": "fp16", "step": 1, "batch": 1, "kv_heads": 1, "head_dim": 4, "inplace": True, "keep": 0,
         "kind": "rotating", "max_size": 2}
_WRAP = [{"op": "append", "n": 1}] * 3


@pytest.mark.parametrize("factory, undo, ops", [
    (_SilentIsTrimmable, 0, _WRAP),
    (_FlagSetFirst, 0, _WRAP),
    # undo 1: trimmable_rows 1 after the wrap; a trim of 2 is a refusal with a row to roll back
    (_PartialRefusalSilent, 1, [*_WRAP, {"op": "trim", "n": 2}]),
    # warned by a refused trim, trimmable again after a decode, then copied: the copy has not warned
    (_CopyKeepsWarned, 1, [*_WRAP, {"op": "trim", "n": 2}, {"op": "append", "n": 1},
                           {"op": "copy", "name": "c", "live": "copy"}]),
])
def test_the_rotating_lockstep_sees_a_wrong_rollback_warning(factory, undo, ops):
    from kvspec.fuzz.lockstep import Divergence
    from kvspec.fuzz.rotating import RotatingLockstep

    def run(cls):
        lock = RotatingLockstep({**_RING, "undo": undo}, cache_factory=cls)
        for i, op in enumerate(ops):
            lock.step(i, op)

    run(RotatingKVCache)  # the ring itself agrees
    with pytest.raises(Divergence, match="refused-rollback warning|strict refused rollback"):
        run(factory)
