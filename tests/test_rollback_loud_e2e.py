"""Issue 47, item 2, end to end: mlx-lm's speculative decoding on a gemma3
with sliding-window layers, caches built as a user builds them
(``make_prompt_cache(model, mode)``: no ``num_draft_tokens``, no undo log)
and a prompt longer than the window, so that the rings go past the window
during the prefill, before any trim. mlx-lm's loop asks ``is_trimmable()``
before each rollback and skips the rollback in every layer on False: the
main model's first refused rollback must come with a RollbackWarning (at
or before it), in every mode; with ``num_draft_tokens`` no rollback is
refused and nothing warns."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

from kvspec.fuzz.commands.e2e import run_scenario
from kvspec.fuzz.commands.e2e.models import speculative_gemma3, token_ids
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.spec.errors import RollbackWarning

WINDOW, PROMPT, DRAFT, TOKENS = 8, 12, 4, 24


class Watched:
    """The main model; at each verification call (every call after the
    prefill) it notes whether the caches hold more rows than the prompt
    and the tokens yielded so far (a rollback was refused), and how many
    RollbackWarnings the main model's rings had issued by then."""

    def __init__(self, model, caches, caught):
        self.model, self.caught, self.calls, self.yielded = model, caught, 0, 0
        self.rings = [c for c in caches if isinstance(c, RotatingKVCache)]
        self.dense = next(c for c in caches if not isinstance(c, RotatingKVCache))
        self.refused_at: list[tuple[int, bool, int]] = []  # (call, a main ring warned, warnings so far)

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, inputs, cache=None):
        if self.calls and self.dense.offset != PROMPT - 1 + self.yielded:
            warned = sum(issubclass(w.category, RollbackWarning) for w in self.caught)
            self.refused_at.append((self.calls, any(r.rollback_warned for r in self.rings), warned))
        self.calls += 1
        return self.model(inputs, cache=cache)


def run(mode: str, num_draft_tokens: int = 0):
    from mlx_lm.generate import speculative_generate_step

    model, draft = speculative_gemma3(0, WINDOW)
    main = make_prompt_cache(model, mode=mode, num_draft_tokens=num_draft_tokens)
    caches = main + make_prompt_cache(draft, mode=mode, num_draft_tokens=num_draft_tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = Watched(model, main, caught)
        for _ in speculative_generate_step(token_ids(0, PROMPT), watch, draft, num_draft_tokens=DRAFT,
                                           max_tokens=TOKENS, prompt_cache=caches):
            watch.yielded += 1
    loud = [str(w.message) for w in caught if issubclass(w.category, RollbackWarning)]
    rings = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert len(rings) == 4 and all(r.offset > WINDOW for r in rings)  # every ring went past its window
    return watch, loud, rings


@pytest.mark.parametrize("mode", ["fp16", "int8", "turbo4asym", "turbo4delegated"])
def test_the_first_refused_rollback_after_a_prefill_wrap_warns(mode):
    watch, loud, rings = run(mode)
    assert watch.refused_at, "no main-model rollback was refused: the scenario checks nothing"
    call, warned, count = watch.refused_at[0]
    assert warned and count >= 1, f"refused rollback before call {call} came silently ({count} warnings)"
    assert 1 <= len(loud) <= len(rings)  # once per cache
    assert all("any rollback is refused" in m and "num_draft_tokens" in m for m in loud), loud


@pytest.mark.parametrize("mode", ["fp16", "turbo4delegated"])
def test_num_draft_tokens_refuses_no_main_rollback_and_stays_silent(mode):
    """The control: the same run with make_prompt_cache(num_draft_tokens=4)
    keeps every main-model rollback (the watch sees no extra rows)."""
    watch, _, rings = run(mode, num_draft_tokens=DRAFT)
    assert watch.refused_at == [] and watch.calls > 3
    main_rings = rings[:2]
    assert not any(r.rollback_warned for r in main_rings)


class OldRule(RotatingKVCache):
    """The rule before issue 47: is_trimmable()'s False warns only on a
    ring without an undo log that some trim reached before."""

    def trim(self, n):
        self.trimmed_before = getattr(self, "trimmed_before", False) or n > 0
        return super().trim(n)

    def is_trimmable(self):
        ok = self._counters_rewind_exact() or self.trimmable_rows() > 0
        if not ok and self.undo == 0 and getattr(self, "trimmed_before", False):
            self.warn_refused_rollback(None)
        return ok


def test_speculative_drift_scenario_fails_on_the_old_rule():
    """Scenario 11's runs with a 3-token prompt trim before the rings wrap,
    so they passed under the old rule; its prefill-wrap runs catch it."""
    result = run_scenario("speculative_drift", factories={"rotating": OldRule})
    assert not result.ok and "first refused rollback" in result.detail and "came silently" in result.detail, \
        result.detail


def test_bf16_rows_warn_the_same():
    """Many models run in bfloat16: a bf16 ring past its window warns at
    its first is_trimmable() False as well."""
    ring = RotatingKVCache(WINDOW, step=4)
    k = mx.ones((1, 2, PROMPT, 16), dtype=mx.bfloat16)
    ring.update_and_fetch(k, k)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not ring.is_trimmable()
    assert [w.category for w in caught] == [RollbackWarning]
