"""The injected recorder bug ``recorder_splits_wrong_end`` runs on every
tiny hybrid family, whatever its mixer's signature (qwen3_next's
``inputs``, nemotron_h's ``hidden_states``, recurrent_gemma's ``(x, cache,
mask)``), and is seen: it splits the first ``depth`` tokens of a call, so a
long call ends with coverage 0 where the step recorder keeps ``depth``."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.bugs.recurrent import record_steps_wrong_end
from kvspec.fuzz.commands.e2e.models import HYBRID_FAMILIES, tiny_hybrid, token_ids
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.recurrent import RecurrentCache, unrecord_steps


def _run(family: str, wrong: bool, depth: int):
    model = tiny_hybrid(family, 0)
    caches = make_prompt_cache(model, num_draft_tokens=depth)
    if wrong:
        unrecord_steps(model)
        assert record_steps_wrong_end(model) > 0
    logits = model(token_ids(0, 6)[None], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    return logits, [c for c in caches if isinstance(c, RecurrentCache)]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_wrong_end_recorder_runs_on_every_family_and_is_seen(family):
    good_logits, good = _run(family, False, 2)
    bad_logits, bad = _run(family, True, 2)
    assert good and all(c.offset == 6 for c in good + bad)
    assert [c.trimmable_rows() for c in good] == [2] * len(good)
    assert [c.trimmable_rows() for c in bad] == [0] * len(bad)  # the first 2 tokens split, then a block
    assert mx.allclose(good_logits, bad_logits, atol=1e-4).item()  # the same tokens, chunked otherwise
    _, bad0 = _run(family, True, 0)  # depth 0: the real recorder's call (it counts the tokens)
    assert all(c.offset == 6 for c in bad0)
