"""The states log of the hybrid scenarios (``kvspec.fuzz.commands.e2e.hybrid.
StateLog``): it keeps the recurrent layers' arrays at every offset a run
passes through and turns them into bytes only when a check reads them. What
it hands back for an offset must be the states the run had there, not those
of a later step (the live array list of a ``RecurrentCache`` is written in
place by the model; a log that kept the list, not the arrays, would read the
last step's states at every offset)."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.commands.e2e.hybrid import (
    StateLog,
    build_hybrid,
    check_states,
    recurrent_states,
    states_along,
    teacher_run,
)
from kvspec.fuzz.commands.e2e.models import tiny_hybrid, token_ids

PROMPT, TOKENS = 6, [3, 141, 59, 26]


@pytest.mark.parametrize("family", ["lfm2", "nemotron_h"])
def test_the_log_holds_each_offsets_own_states(family):
    model = tiny_hybrid(family, 0)
    prompt = token_ids(0, PROMPT)
    caches = build_hybrid(model, 2)
    log = StateLog(model, caches)
    teacher_run(log, caches, prompt, TOKENS)
    assert sorted(log.at) == list(range(PROMPT - 1, PROMPT + len(TOKENS) + 1))
    seen = set()
    for t in range(PROMPT, PROMPT + len(TOKENS) + 1):
        fresh = teacher_run(model, build_hybrid(model, 2), prompt, TOKENS[: t - PROMPT])
        want = recurrent_states(fresh)
        assert {off for _, off, _ in want} == {t}
        assert log.at[t] == want, f"offset {t}: the log's states are not those the run had there"
        assert log.at[t] is log.at[t]  # turned into bytes once
        seen.add(b"".join(b for _, _, b in want))
    assert len(seen) == len(TOKENS) + 1  # every offset's states differ: a log of one step's states fails above
    # states_along is that log over a fresh run, and check_states reads it at the caches' offset
    along = states_along(model, prompt, TOKENS, 2)
    assert all(along[t] == log.at[t] for t in log.at)
    assert check_states("end", caches, along) == PROMPT + len(TOKENS)
