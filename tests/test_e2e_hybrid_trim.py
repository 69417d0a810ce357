"""A list trim over a tiny hybrid model's caches at depth 0 (no
checkpoints) is refused loudly on every family, never a silent 0: the
recurrent layers count the tokens they consumed (the step recorder counts
them at depth 0 too: recurrent_gemma never calls ``cache.advance``), and a
recurrent layer that counted none beside layers that hold rows is refused
as well (issue 48)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.commands.e2e.models import HYBRID_FAMILIES, tiny_hybrid, token_ids
from kvspec.impl.layers import trim_prompt_cache
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.recurrent import RecurrentCache, unrecord_steps
from kvspec.spec.errors import RollbackWarning, StateError


def _prefilled(family: str, strict: bool = False, recorder: bool = True):
    model = tiny_hybrid(family, 0)
    caches = make_prompt_cache(model, strict=strict)
    if not recorder:
        unrecord_steps(model)
    model(token_ids(0, 6)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _snap(caches):
    return [(c.offset, [id(a) for a in getattr(c, "cache", ())] if isinstance(c, RecurrentCache) else c.offset)
            for c in caches]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_depth_0_list_trim_warns_and_every_layer_counts(family):
    caches = _prefilled(family)
    assert any(isinstance(c, RecurrentCache) for c in caches)
    assert {c.offset for c in caches} == {6}  # recurrent layers counted the prefill too
    before = _snap(caches)
    with pytest.warns(RollbackWarning, match="coverage"):
        assert trim_prompt_cache(caches, 2) == 0
    assert _snap(caches) == before


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_depth_0_list_trim_raises_with_strict(family):
    caches = _prefilled(family, strict=True)
    before = _snap(caches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no quiet path: it raises
        with pytest.raises(StateError, match="recurrent layer"):
            trim_prompt_cache(caches, 2, strict=True)
    assert _snap(caches) == before


def test_recurrent_gemma_without_the_recorder_is_refused_not_silent():
    """Without the recorder recurrent_gemma's recurrent layers stay at
    offset 0 (it never calls advance): the list trim names them."""
    caches = _prefilled("recurrent_gemma", recorder=False)
    assert any(isinstance(c, RecurrentCache) and c.offset == 0 for c in caches)
    with pytest.warns(RollbackWarning):
        assert trim_prompt_cache(caches, 2) == 0
    with pytest.raises(StateError, match="offset 0 beside layers that hold rows"):
        trim_prompt_cache(caches, 2, strict=True)
