"""The conformance report on the recurrent kind: ``differences_after``
words a recurrent layer's views (conv window and state after each rollback
the spec covers) in the spec's terms, and ``engine_of`` names transformers'
version for the ``transformers-linear`` target (issue 48)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.commands.conformance import diagnose, engine_of
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import load

TRACES = Path(__file__).parent / "traces"


def _bug_target(name: str):
    bug = by_name(name)
    return dataclasses.replace(resolve("impl"), name="bug", factories=bug.factories, bug=bug)


def test_diagnose_words_what_else_differs_in_a_recurrent_layer():
    d, line = diagnose(load(TRACES / "conv_window_not_rolled_back.json"), _bug_target("conv_window_not_rolled_back"))
    assert d is not None and d.what == "live layer after a rollback of 1: conv window differs"
    assert "; after it: window ['conv [0, 1]', 'the state after [0, 1]'] (spec after [0, 1], coverage 2)" in line
    d, line = diagnose(load(TRACES / "snapshot_shares_ring.json"), _bug_target("snapshot_shares_ring"))
    assert "after it: snapshot s ['conv [1]', 'the state after [0, 1]'] (spec after [0, 1], coverage 2)" in line


def test_diagnose_of_a_conforming_recurrent_trace():
    assert diagnose(load(TRACES / "conv_window_not_rolled_back.json"), resolve("impl")) == (
        None, "no divergence on replay")


def test_engine_of_names_transformers_for_the_linear_target():
    from kvspec.fuzz.adapters.transformers import transformers_version

    assert engine_of("transformers-linear") == engine_of("transformers") == transformers_version()
    assert engine_of("impl") == "impl"
