"""The registry of kinds (fuzz/kinds.py) as every reader uses it: trace
fields, modes and ops per kind, defaults, mode families sharing a trace kind,
machines bound to the mode they are labelled with, the mlx-lm waivers, and
``make_prompt_cache(classes=...)`` on every branch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvspec.fuzz import kinds
from kvspec.fuzz.bugs import InjectedBug, by_name, catalog
from kvspec.fuzz.campaign import machine_for, run_machine
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import Trace, TraceFormatError, parse
from kvspec.impl.dense import KVCache
from kvspec.impl.models import make_prompt_cache
from kvspec.impl.rotating import RotatingKVCache

#: a valid value for a required field that is not a count
REQUIRED_EXAMPLES = {"layers": [{"kind": "dense"}], "build": "make_prompt_cache", "stores": ["full", "window"]}


def minimal_cache(kind: str) -> dict:
    entry = kinds.get(kind)
    return {"kind": kind, **{f: REQUIRED_EXAMPLES.get(f, 4) for f, v in entry.fields.items() if v is kinds.REQUIRED}}


def foreign_fields() -> list[tuple[str, str]]:
    """(trace kind, field) for every cache field the schema defines that no
    entry of that kind declares."""
    props = json.loads(kinds.SCHEMA_PATH.read_text())["$defs"]["cache"]["properties"]
    out = []
    for kind in kinds.trace_kinds():
        own = {f for k in kinds.KINDS.values() if k.kind == kind for f in k.cache_fields}
        out += [(kind, f) for f in props if f not in own]
    return out


@pytest.mark.parametrize("kind,field", foreign_fields())
def test_a_field_of_another_kind_is_refused(kind: str, field: str):
    doc = {"kvtrace": 1, "cache": {**minimal_cache(kind), field: REQUIRED_EXAMPLES.get(field, 1)}, "ops": []}
    with pytest.raises(TraceFormatError, match=rf"field cache\.{field}: not a field of kind {kind}"):
        parse(doc)


def test_there_are_foreign_fields_to_refuse():
    assert ("dense", "max_size") in foreign_fields()


@pytest.mark.parametrize("kind", kinds.trace_kinds())
def test_defaults_are_the_documented_ones(kind: str):
    """docs/kvtrace.md's defaults: every kind's common fields, and the ring's
    ``keep`` (its ``max_size`` is required, never defaulted)."""
    trace = parse({"kvtrace": 1, "cache": minimal_cache(kind), "ops": []})
    want = {"mode": "fp16", "step": 256, "batch": 1, "kv_heads": 2, "head_dim": 8, "inplace": True}
    assert {k: trace.cache[k] for k in want} == want
    if kind == "rotating":
        assert trace.cache["keep"] == 0
        assert "max_size" not in kinds.get("rotating").defaults()


def test_an_op_the_kind_neither_runs_nor_refuses_is_a_format_error(monkeypatch):
    ring = dataclasses.replace(kinds.KINDS["rotating"], refuses=())
    monkeypatch.setitem(kinds.KINDS, "rotating", ring)
    trace = Trace({**parse({"kvtrace": 1, "cache": minimal_cache("rotating"), "ops": []}).cache},
                  [{"op": "append", "n": 1}, {"op": "detach", "name": "h"}])
    with pytest.raises(TraceFormatError, match="op 1 field 'op': kind rotating has no op 'detach'"):
        replay(trace)


def test_an_op_refused_by_contract_runs_and_is_refused():
    trace = Trace({**parse({"kvtrace": 1, "cache": minimal_cache("rotating"), "ops": []}).cache},
                  [{"op": "detach", "name": "h", "error": True}])
    result = replay(trace)
    assert result.ok and result.refusals


FAKE_BUGS = (InjectedBug("fake_family_bug", "a clause", "a source", "dense", ("fakemode",), "KVCache.trim",
                         "a bug of a mode family", {"dense": KVCache}),)


def test_a_mode_family_shares_its_trace_kind(monkeypatch):
    family = kinds.Kind("family", "a mode family of the dense cache", modes=("fakemode",), trace_kind="dense",
                        campaigns=(("fakemode", True),), lockstep="kvspec.fuzz.dense:DenseLockstep",
                        machine="kvspec.fuzz.dense:DenseMachine", bugs="tests.test_registry:FAKE_BUGS")
    monkeypatch.setitem(kinds.KINDS, "family", family)
    assert kinds.get("dense", "fakemode") is family
    assert kinds.get("dense", "int8") is kinds.KINDS["dense"]
    assert kinds.get("dense") is kinds.KINDS["dense"]
    assert kinds.trace_kinds().count("dense") == 1
    assert ("dense", "fakemode") in kinds.configs()
    assert "fakemode" in kinds.modes_of("dense")
    assert by_name("fake_family_bug") in catalog()
    base = json.loads(kinds.SCHEMA_PATH.read_text())
    rules = kinds.schema_from_registry(base)["$defs"]["cache"]["allOf"]
    dense = next(r for r in rules if r["if"]["properties"]["kind"]["const"] == "dense")
    assert dense["then"]["properties"]["mode"]["enum"] == list(kinds.modes_of("dense"))
    assert dense["then"]["properties"]["mode"]["enum"][-1] == "fakemode"
    with pytest.raises(kinds.UnknownKindError, match="mode 'turbo9' has no implementation for kind dense") as exc:
        kinds.get("dense", "turbo9")
    assert exc.value.field == "mode"


@pytest.mark.parametrize("kind,mode", kinds.configs())
def test_a_machine_runs_the_mode_it_is_labelled_with(kind: str, mode: str):
    machine = machine_for(kind, mode)
    assert machine.mode == mode
    run_machine(machine, seed=1, max_examples=2, steps=5)
    assert machine.last_run is not None and machine.last_run[0]["mode"] == mode
    assert machine.last_run[0]["kind"] == kind


def test_a_waived_observable_is_not_compared():
    """mlx-lm's KVCache keeps a stale tail on growth when prev % step == 0:
    its capacity differs, its windows do not. Waiving capacity passes."""
    cache = {**parse({"kvtrace": 1, "cache": {"kind": "dense", "step": 2}, "ops": []}).cache}
    ops = [{"op": "append", "n": 2}, {"op": "append", "n": 1}, {"op": "trim", "n": 1}, {"op": "append", "n": 3}]
    strict = replay(Trace(cache, ops), target="mlx-lm")
    assert not strict.ok and "capacity" in strict.divergence.what
    assert replay(Trace(cache, ops), target=resolve("mlx-lm").waiving("capacity")).ok


class Ring(RotatingKVCache):
    pass


class Dense(KVCache):
    pass


class Bare:
    def __init__(self) -> None:
        self.layers = [object(), object()]


class WithMakeCache(Bare):
    def make_cache(self):
        from mlx_lm.models.cache import KVCache as LmKVCache
        from mlx_lm.models.cache import RotatingKVCache as LmRing

        return [LmKVCache(), LmRing(max_size=8, keep=0)]


@pytest.mark.parametrize("model,kwargs,want", [
    (WithMakeCache(), {}, [Dense, Ring]),
    (Bare(), {"max_kv_size": 16}, [Ring, Ring]),
    (Bare(), {}, [Dense, Dense]),
])
def test_make_prompt_cache_builds_the_given_classes(model, kwargs, want):
    caches = make_prompt_cache(model, classes={"dense": Dense, "rotating": Ring}, **kwargs)
    assert [type(c) for c in caches] == want
