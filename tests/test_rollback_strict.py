"""Issue 47, item 2: ``strict`` on the cache itself. A ring built with
``strict=True`` (directly, or by ``kvspec.impl.models.make_prompt_cache(model,
strict=True)``) raises StateError at every rollback it cannot honour
exactly, instead of the once-per-cache RollbackWarning, and is left
unchanged; this holds inside mlx-lm's own loops too
(``mlx_lm.generate.speculative_generate_step`` asks ``is_trimmable()``
through mlx-lm's ``trim_prompt_cache``, never ours). The setting survives
copies, the state / meta_state protocol, prompt-cache files and
``to_quantized``; a bad value is refused naming the argument."""

from __future__ import annotations

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz.commands.e2e.models import speculative_gemma3, token_ids
from kvspec.impl import layers
from kvspec.impl.models import (
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import InvalidArgumentError, RollbackWarning, StateError

WINDOW, PROMPT, DRAFT, TOKENS = 8, 12, 4, 24
MODES = ["fp16", "int8", "turbo4asym", "turbo4delegated"]


def rows(n: int, dtype=mx.float16, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((1, 2, n, 16)), dtype=dtype)


def wrapped_ring(dtype=mx.float16, undo: int = 0, strict: bool = True) -> RotatingKVCache:
    """A ring that went past its window in one prefill (no trim before)."""
    ring = RotatingKVCache(WINDOW, step=4, undo=undo, strict=strict)
    k = rows(PROMPT, dtype)
    ring.update_and_fetch(k, k)
    for i in range(3):  # and a few decode steps
        r = rows(1, dtype, seed=i + 1)
        ring.update_and_fetch(r, r)
    return ring


def fields(c) -> dict:
    """Everything a refused rollback must leave as it was."""
    out = {k: v for k, v in vars(c).items() if not isinstance(v, mx.array) and k not in ("keys", "values")}
    got = c.fetch() if hasattr(c, "fetch") else None
    out["rows"] = None if got is None else [np.array(a.astype(mx.float32)).tolist() for a in got]
    return out


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_strict_ring_raises_at_every_refused_rollback_and_stays_unchanged(dtype):
    ring = wrapped_ring(dtype)
    before = fields(ring)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the first refusal and every later one
            with pytest.raises(StateError) as err:
                ring.trim(2)
            with pytest.raises(StateError) as ask:
                ring.is_trimmable()
    assert caught == []
    assert fields(ring) == before and not ring.rollback_warned
    msg = str(err.value)
    for part in ("RotatingKVCache(max_size=8", "undo=0", "a rollback of 2 rows", "num_draft_tokens=", "undo=2",
                 "strict=True", "nothing was trimmed"):
        assert part in msg, (part, msg)
    assert "any rollback" in str(ask.value) and "is_trimmable()" in str(ask.value)
    # what it can do stays allowed: trimming nothing, and the queries that never refuse
    assert ring.trim(0) == 0 and ring.trimmable_rows() == 0


def test_a_strict_ring_with_an_undo_log_trims_what_it_covers_and_raises_beyond():
    ring = wrapped_ring(undo=2)
    assert ring.is_trimmable() and ring.trimmable_rows() == 2
    before = fields(ring)
    with pytest.raises(StateError, match="a rollback of 3 rows"):
        ring.trim(3)
    assert fields(ring) == before
    assert ring.trim(2) == 2 and ring.offset == PROMPT + 3 - 2


def test_a_strict_ring_that_never_wrapped_trims_as_any_ring():
    ring = RotatingKVCache(WINDOW, strict=True)
    assert ring.is_trimmable()  # empty
    k = rows(5)
    ring.update_and_fetch(k, k)
    assert ring.is_trimmable() and ring.trim(3) == 3 and ring.offset == 2


def test_the_default_still_warns_once():
    ring = wrapped_ring(strict=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ring.trim(2) == 0 and not ring.is_trimmable()
    assert [w.category for w in caught] == [RollbackWarning]


@pytest.mark.parametrize("bad", ["yes", 1, None, np.bool_(True)])
def test_bad_strict_is_refused_naming_the_argument(bad):
    with pytest.raises(InvalidArgumentError, match=r"RotatingKVCache: strict must be True or False"):
        RotatingKVCache(WINDOW, strict=bad)
    model, _ = speculative_gemma3(0, WINDOW)
    with pytest.raises(InvalidArgumentError, match=r"make_prompt_cache: strict must be True or False"):
        make_prompt_cache(model, strict=bad)


# -- every mode, through the list operations --------------------------------------
def prefilled(mode: str, strict: bool = True) -> list:
    """make_prompt_cache(gemma3, mode, strict) after a prompt longer than the window."""
    model, _ = speculative_gemma3(0, WINDOW)
    caches = make_prompt_cache(model, mode=mode, strict=strict)
    model(token_ids(0, PROMPT)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_raises_at_the_first_refused_list_rollback(mode):
    from mlx_lm.models.cache import trim_prompt_cache as lm_trim

    caches = prefilled(mode)
    rings = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert len(rings) == 2 and all(r.strict and r.offset > r.max_size for r in rings)
    before = [fields(c) for c in caches]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StateError, match="RotatingKVCache"):
            lm_trim(caches, 1)  # mlx-lm's: asks is_trimmable() only
        with pytest.raises(StateError, match="a rollback of 1 rows"):
            trim_prompt_cache(caches, 1)  # ours, not strict itself: the ring's setting decides
        with pytest.raises(StateError):
            layers.can_trim_prompt_cache(caches)
    assert caught == []
    assert [fields(c) for c in caches] == before


# -- round trips ------------------------------------------------------------------
def test_strict_survives_copies_state_files_and_to_quantized(tmp_path):
    ring = wrapped_ring(undo=1)
    assert copy.copy(ring).strict and copy.deepcopy(ring).strict
    assert all(c.strict for c in layers.copy_prompt_cache([ring])) and all(
        c.strict for c in layers.copy_prompt_cache([ring], deep=False))
    meta = ring.meta_state
    assert RotatingKVCache.from_state(ring.state, meta).strict
    other = RotatingKVCache(WINDOW)
    other.state = ring.state
    other.meta_state = meta
    assert other.strict and other.undo == 1
    # strict without an undo log: the undo depth 0 is spelled out
    bare = wrapped_ring()
    assert bare.meta_state[5:] == ("0", "1") and RotatingKVCache.from_state(bare.state, bare.meta_state).strict
    # the default keeps mlx-lm's five fields
    assert len(wrapped_ring(strict=False).meta_state) == 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert ring.to_quantized(bits=4) is ring and ring.strict
    f = tmp_path / "c.safetensors"
    save_prompt_cache(f, [ring, bare, wrapped_ring(strict=False)])
    back = load_prompt_cache(f)
    assert [c.strict for c in back] == [True, True, False]
    with pytest.raises(StateError):
        back[1].trim(1)


def test_a_bad_strict_field_in_meta_state_is_refused():
    ring = wrapped_ring()
    meta = ring.meta_state[:6] + ("2",)
    with pytest.raises(InvalidArgumentError, match="strict"):
        RotatingKVCache.from_state(ring.state, meta)


# -- end to end: mlx-lm's speculative decoding ---------------------------------------
def speculate(strict: bool, num_draft_tokens: int = 0, prompt: int = PROMPT) -> list[int]:
    from mlx_lm.generate import speculative_generate_step

    model, draft = speculative_gemma3(0, WINDOW)
    # strict on the main model's caches, as docs/mlx-lm.md advises (a draft
    # ring's refusal costs only accepted drafts)
    caches = (make_prompt_cache(model, strict=strict, num_draft_tokens=num_draft_tokens)
              + make_prompt_cache(draft, num_draft_tokens=num_draft_tokens))
    out = []
    for tok, _, _ in speculative_generate_step(token_ids(0, prompt), model, draft, num_draft_tokens=DRAFT,
                                               max_tokens=TOKENS, prompt_cache=caches):
        out.append(int(tok))
    return out


def test_speculative_generate_step_raises_at_the_first_refused_rollback():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StateError) as err:
            speculate(strict=True)
    assert not [w for w in caught if issubclass(w.category, RollbackWarning)]
    assert "num_draft_tokens=" in str(err.value) and "max_size=8" in str(err.value)
    # raised in the loop's rollback (mlx-lm's set-up check passed: fresh rings are trimmable)
    assert any(e.name == "_rewind_cache" for e in err.traceback), err.traceback


def test_speculative_generate_step_with_an_undo_log_runs_strict_and_equals_the_default():
    """The control: with num_draft_tokens no rollback is refused, so strict
    passes mlx-lm's set-up check and every round, and changes no token."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RollbackWarning)
        got = speculate(strict=True, num_draft_tokens=DRAFT)
        assert got == speculate(strict=False, num_draft_tokens=DRAFT) and len(got) == TOKENS
