"""The paged harness: what the lockstep driver compares, what the state
machine reaches, and the prefix-sharing scenario catching a broken pool."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.campaign import machine_for
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.replay import make_lockstep, replay
from kvspec.fuzz.trace import load, parse

TRACES = Path(__file__).parent / "traces"


def paged_lock(factories=None, check_inplace=True, **cache):
    doc = {"kvtrace": 1, "cache": {"kind": "paged", "block_size": 2, **cache}, "ops": []}
    return make_lockstep(parse(doc).cache, factories, check_inplace)


def test_lockstep_sees_a_broken_pool_invariant():
    lock = paged_lock()
    lock.step(0, {"op": "append", "n": 3})
    lock.pool.refcounts[0] += 1  # a leak the spec does not have
    with pytest.raises(Divergence, match="refcounts differs"):
        lock.step(1, {"op": "fetch"})
    lock = paged_lock(check_inplace=False)  # block ids unobserved: the invariant check still runs
    lock.step(0, {"op": "append", "n": 3})
    lock.pool.refcounts[0] += 1
    with pytest.raises(Divergence, match="pool invariants broken on the implementation"):
        lock.step(1, {"op": "fetch"})


def test_isolation_alone_catches_a_write_without_copy_on_write():
    # with the write path and block ids unobserved, b's window changing is what fails
    result = replay(load(TRACES / "paged_no_cow.json"), by_name("paged_no_cow").factories, check_inplace=False)
    assert not result.ok
    assert "view of seq:b changed (isolation)" in str(result.divergence)


def test_expect_on_a_sequence_and_refusal_messages():
    lock = paged_lock()
    lock.step(0, {"op": "append", "n": 2})
    lock.step(1, {"op": "fork", "from": "main", "as": "b"})
    lock.step(2, {"op": "expect", "seq": "b", "window": [0, 1]})
    with pytest.raises(Divergence, match="trace's 'expect' fails on the spec"):
        lock.step(3, {"op": "expect", "seq": "b", "window": [0]})
    lock.step(4, {"op": "trim_front", "n": 1, "keep": 1, "error": True})
    assert "keep must be 0" in lock.refusals[-1][1]


@pytest.mark.parametrize(("fixed", "edges"), [
    ({}, ("copies on write", "forks of forks", "trim releasing blocks", "writes after a front trim",
          "writes beside shared blocks", "in-place writes")),
    ({"max_blocks": 6}, ("pool exhausted (refused)", "copies on write")),
])
def test_machine_reaches_the_paged_edges(fixed, edges):
    machine = machine_for("paged", fixed=fixed)
    run_state_machine_as_test(machine, settings=settings(max_examples=30, stateful_step_count=30, deadline=None,
                                                         derandomize=True, database=None))
    for edge in edges:
        assert machine.stats.get(edge, 0) > 0, (edge, machine.stats)


def test_prefix_sharing_scenario_catches_a_shared_block_write():
    pytest.importorskip("mlx_lm")
    from kvspec.fuzz.commands.e2e import run_scenario

    result = run_scenario("prefix_sharing", factories=by_name("paged_no_cow").factories)
    assert not result.ok and "shared tail block" in result.detail


def test_handle_reuses_are_derived_from_the_handle_class():
    """The uses the fuzzer draws for a spent handle come from
    PagedKVCache's public methods and properties (not a hand list), and the
    spec answers exactly those: a method added to the handle is drawn, and
    the spec must say what it does on a spent handle."""
    import inspect

    from kvspec.fuzz.paged import NOT_REUSES, handle_api
    from kvspec.impl.paged import PagedKVCache
    from kvspec.spec import paged as sp

    api = handle_api()
    assert set(api) == set(sp.HANDLE_REUSES)
    public = {n for n, _ in inspect.getmembers(PagedKVCache) if not n.startswith("_")}
    assert {m for m, _ in api.values()} | set(NOT_REUSES) == public

    class Grown(PagedKVCache):
        def rewind(self, n: int) -> int:
            return self.trim(n)

    assert "rewind" in handle_api(Grown) and "rewind" not in sp.HANDLE_REUSES


def test_every_use_of_a_spent_handle_is_refused_and_changes_nothing():
    """Each use of a released sequence's handle, after a fork took the name:
    refused (StateError, the spec's words), the new sequence untouched."""
    from kvspec.fuzz.paged import handle_api

    lock = paged_lock()
    ops = [{"op": "append", "n": 3}, {"op": "fork", "as": "f"}, {"op": "append", "n": 1, "seq": "f"},
           {"op": "release", "seq": "f"}, {"op": "fork", "as": "f"}]
    ops += [{"op": "handle_reuse", "seq": "f", "use": use, "error": True} for use in sorted(handle_api())]
    ops += [{"op": "expect", "of": "f", "window": [0, 1, 2]}]
    for i, op in enumerate(ops):
        lock.step(i, op)
