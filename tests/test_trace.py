"""Loading kvtraces: strict JSON, finite bounds, every schema error listed in
document order, and the compiled op checker agreeing with the schema."""

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvspec.fuzz import trace
from kvspec.fuzz.trace import TraceFormatError, loads

TRACES = sorted(p for p in (Path(__file__).parent / "traces").rglob("*.json") if p.name != "report.json")


def doc(cache=None, ops=None, **extra):
    return {"kvtrace": 1, "cache": cache or {"kind": "dense"}, "ops": ops if ops is not None else [], **extra}


def refused(text) -> str:
    with pytest.raises(TraceFormatError) as info:
        loads(text if isinstance(text, (str, bytes)) else json.dumps(text))
    return str(info.value)


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_shipped_traces_load(path):
    trace.load(path)


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1, "n": 5}]}',
         "key 'n' appears twice in one object"),
        (b'{"kvtrace": 1, "cache": {"kind": "d\xffense"}, "ops": []}', "not UTF-8: byte 0xff at offset 35"),
        ("[" * 100_000 + "]" * 100_000, "nested 100000 levels deep, more than the limit of 64"),
        ('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "trim", "n": NaN}]}',
         "NaN is not JSON"),
        ('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "trim", "n": 1e999}]}',
         "number 1e999 is out of range"),
        ('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "trim", "n": ' + "9" * 5000 + "}]}",
         "invalid JSON: Exceeds the limit"),
        ('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [', "invalid JSON at line 1 column"),
        (doc({"kind": "dense", "head_dim": 10**9}), "field cache.head_dim: 1000000000 is greater than the maximum of 1024"),
        (doc({"kind": "dense", "step": 10**12}), "field cache.step: 1000000000000 is greater than the maximum of 1048576"),
        (doc(ops=[{"op": "append", "n": 10**12}]), "op 0 field 'n': 1000000000000 is greater than the maximum"),
        (doc(ops=[{"op": "append", "n": 10**30}]), "op 0 field 'n': 1000000000000000000000000000000 is greater"),
        (doc(ops=[{"op": "trim", "n": -(10**30)}]), "op 0 field 'n': -1000000000000000000000000000000 is less"),
        (doc(ops=[{"op": "trim", "n": 1.0}]), "op 0 field 'n': 1.0 is not of type 'integer'"),
        (doc(ops=[{"op": "trim", "n": True}]), "op 0 field 'n': True is not of type 'integer'"),
        (doc(ops=[{"n": 1}]), 'op 0: has no "op" (every op names its operation)'),
        (doc(ops=[{"as": "x"}]), 'op 0: has no "op"'),
        (doc(ops=[{"op": "nosuch"}]), "op 0 field 'op': unknown op 'nosuch'; known: append, fetch"),
        (doc(ops=[7]), "op 0: 7 is not of type 'object'"),
        (doc(ops=[{"op": "snapshot", "name": "x" * 129}]), "op 0 field 'name': 'xxxxxxxx"),
        (doc(ops=[{"op": "append", "n": 1, "seq": "b"}]), "op 0 field 'seq': a dense cache has no sequences"),
        (doc({"kind": "rotating", "max_size": 2, "keep": 2}), "field cache.keep: must be < max_size (2), got 2"),
        (doc({"kind": "rotating"}), "field cache: 'max_size' is a required property"),
        (doc({"kind": "dense", "colour": 1}), "Additional properties are not allowed ('colour' was unexpected)"),
        (doc({"kind": "dense", "kv_heads": 64, "head_dim": 1024}, [{"op": "append", "n": 1000}]),
         "field cache: buffers of up to 1256 rows x batch 1 x kv_heads 64 x head_dim 1024 = 82313216 elements"),
        (doc({"kind": "rotating", "max_size": 10**6, "head_dim": 64}, [{"op": "append", "n": 10**6}]),
         "more than the limit of 16777216"),
        ("[]", "document: [] is not of type 'object'"),
    ],
)
def test_bad_input_is_refused_with_where_and_what(bad, message):
    assert message in refused(bad)


def test_a_ring_bound_counts_its_window_not_every_row():
    """Rows of 8 x 1024 elements: 4,096 one-row appends are twice the
    MAX_ELEMENTS of a dense buffer, and a 64-row ring's window holds 1/32 of it."""
    ops = [{"op": "append", "n": 1}] * 4096
    loads(json.dumps(doc({"kind": "rotating", "max_size": 64, "head_dim": 1024, "kv_heads": 8}, ops)))
    assert "elements per tensor" in refused(doc({"kind": "dense", "head_dim": 1024, "kv_heads": 8}, ops))


def test_an_op_the_kind_lacks_is_a_format_error():
    """An op another kind runs, which this kind neither runs nor refuses by
    contract (a paged op on a dense cache), exits 2 instead of passing."""
    from kvspec.fuzz import kinds

    narrow = kinds.Kind("narrow", "a kind with the common ops only", modes=("fp16",), refuses=("detach",))
    cache = {**narrow.defaults(), "kind": "narrow"}
    ops = [{"op": "append", "n": 1}, {"op": "detach", "name": "h"}, {"op": "trim_front", "n": 1}]
    with pytest.raises(TraceFormatError, match="op 2: op 'trim_front' is not an operation of a narrow cache"):
        trace.check_semantics(narrow, cache, ops)
    trace.check_semantics(narrow, cache, ops[:2])


def test_every_error_is_listed_first_one_first():
    ops = [{"op": "append", "n": 1}, {"op": "append", "n": 0}, {"op": "trim"}, {"op": "x"}]
    msg = refused(doc({"kind": "dense", "step": 0}, ops))
    lines = msg.splitlines()
    assert lines[0] == "4 problems:"
    assert "field cache.step" in lines[1]
    assert lines[2].strip().startswith("op 1 field 'n'")
    assert lines[3].strip() == "op 2: 'n' is a required property"
    assert lines[4].strip().startswith("op 3 field 'op': unknown op 'x'")


def test_many_errors_are_counted_beyond_the_shown_ones():
    msg = refused(doc(ops=[{"op": "append", "n": 0}] * 50))
    lines = msg.splitlines()
    assert lines[0] == "50 problems:"
    assert len(lines) == 1 + trace.MAX_ERRORS_SHOWN + 1
    assert lines[-1].strip() == f"... and {50 - trace.MAX_ERRORS_SHOWN} more"


def test_op_count_is_refused_before_ops_are_validated(monkeypatch):
    monkeypatch.setattr(trace, "MAX_OPS", 10)
    # eleven invalid ops: the count is the only problem reported
    assert refused(doc(ops=[{"op": "bogus"}] * 11)) == "field ops: 11 ops, more than the limit of 10"


def test_oversized_file_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "MAX_BYTES", 100)
    p = tmp_path / "big.json"
    p.write_text(json.dumps(doc(title="x" * 200)))
    with pytest.raises(TraceFormatError, match="more than the limit of 100"):
        trace.load(p)


def test_unreadable_file(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read"):
        trace.load(tmp_path / "missing.json")
    with pytest.raises(TraceFormatError, match="cannot read"):
        trace.load(tmp_path)


def test_schema_bounds_are_finite():
    """Every integer and every list in the schema has an upper bound."""
    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                assert "maximum" in node, path
            if node.get("type") == "array":
                assert "maxItems" in node, path
            if node.get("type") == "string" and path[-1] not in ("enum",):
                assert "maxLength" in node or "enum" in node, path
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    walk(trace.schema(), [])


def test_nesting_depth_skips_strings():
    assert trace.nesting_depth(b'{"a": "[[[[", "b": "\\"[[", "c": "\\\\"}') == 1
    assert trace.nesting_depth(b'[[1, [2]], {"x": [{}]}]') == 4
    assert trace.nesting_depth(b'"plain"') == 0


# -- the compiled checker agrees with jsonschema ----------------------------------
_names = st.sampled_from(["s", "h", "main", "", "x" * 128, "x" * 129])
_ints = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1]),
)
_values = st.one_of(
    _ints, _ints, _names, st.booleans(), st.none(), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(_ints, max_size=3), st.lists(st.one_of(_ints, _names), max_size=2), st.dictionaries(_names, _ints, max_size=1),
    st.sampled_from(["exact", "set", "other"]),
)
_FIELDS = {
    "append": ["n"], "trim": ["n"], "trim_to": ["len"], "trim_front": ["n", "keep"],
    "gather_positions": ["positions"], "gather_within_tail": ["tail", "kept"], "snapshot": ["name"],
    "restore": ["name", "drops"], "drop": ["name"], "detach": ["name"], "install": ["name"],
    "handle_trim_to": ["name", "len"], "fork": ["from", "as"], "release": ["seq"],
    "expect": ["window", "of", "order", "layer", "store"], "fetch": [], "hold": [], "release_hold": [],
    "can_trim": [], "layer": ["index", "do"],
    "state_snapshot": ["name"], "state_restore": ["name"],
    "copy": ["name", "deep", "live"], "append_mismatch": ["n", "differs"], "append_pair_mismatch": ["n", "differs"], "reload": ["via", "env"],
    "restore_mixed": ["name", "layer", "source"], "trim_refused_late": ["n", "layer", "how"],
    "handle_reuse": ["seq", "use", "arg"], "state_assign": ["seq", "n"],
    "build_probe": ["mode", "layout", "n_layers", "max_kv_size", "undo", "num_draft_tokens", "step", "hot_threshold",
                    "fold_block"],
    "save_load": ["metadata"], "to_quantized": ["layer"], "mask": ["layer", "n", "window", "device"],
    "mechanism": ["env"], "rows": ["tokens"], "append_unrecorded": ["n"],
    # the cells kind
    "decode": ["seqs", "tokens", "pos0", "drops"], "seq_rm": ["seq", "p0", "p1"], "seq_cp": ["src", "dst", "p0", "p1"],
    "seq_keep": ["seq"], "seq_add": ["seq", "p0", "p1", "delta"], "seq_div": ["seq", "p0", "p1", "d"],
    "pos_min": ["seq", "value"], "pos_max": ["seq", "value"], "save": ["seq", "name"], "clear": [],
    # the prefix kind (decode's req and expect's req, table, free: its fields of the shared op names)
    "admit": ["req", "tokens", "salt"], "free": ["req"], "preempt": ["req"], "resume": ["req"],
    "lookup": ["tokens", "salt"], "free_blocks": ["blocks"], "reset": [],
}
_FIELDS["decode"] = [*_FIELDS["decode"], "req"]
_FIELDS["expect"] = [*_FIELDS["expect"], "req", "table", "free"]
_CHECKS = ["returns", "error", "inplace", "capacity", "seq", "colour", "n", "name", "window"]


_VALID = {
    "count": st.one_of(st.integers(1, 4), st.sampled_from([2**20 - 1, 2**20])),
    "int": st.one_of(st.integers(-3, 3), st.sampled_from([2**31 - 1, -(2**31)])),
    "name": st.sampled_from(["s", "main", "x" * 128]),
    "ints": st.lists(st.integers(-2, 5), max_size=3),
    "bool": st.booleans(),
    "order": st.sampled_from(["exact", "set"]),
    "any": _values,
    "do": st.sampled_from([{"op": "fetch"}, {"op": "trim_front", "n": 1}, {"op": "trim_front", "n": 1, "keep": 0}]),
    "live": st.sampled_from(["original", "copy"]),
    "differs": st.sampled_from(["batch", "kv_heads", "k_head_dim", "v_head_dim", "dtype"]),
    "pair": st.sampled_from(["dtype", "batch", "kv_heads", "rows"]),
    "via": st.sampled_from(["file", "state"]),
    "how": st.sampled_from(["raises", "short", "partial", "fewer", "more"]),
    "use": st.sampled_from(["append", "fetch", "trim", "release", "trim_front_keep_sink", "set_state", "nbytes"]),
    "arg": st.sampled_from(["valid", "zero", "negative"]),
    "env": st.sampled_from(["0", "1", " OFF", "x" * 64]),
    "mode": st.sampled_from(["fp16", "int8", "turbo4delegated"]),
    "layout": st.sampled_from([[{"kind": "dense"}], [{"kind": "rotating", "max_size": 4}]]),
    "size": st.integers(1, 8),
    "depth": st.integers(0, 3),
    "metadata": st.sampled_from([{}, {"0shot": "a"}]),
    "seq": st.one_of(st.sampled_from(["s", "main"]), st.integers(-1, 3)),
    "int_or_null": st.one_of(st.integers(-3, 3), st.none()),
    "store": st.sampled_from(["full", "window"]),
    "drops": st.sampled_from([[], [[3, [0], 1]], [[[2, [0, 1], 4], 1]]]),
    "salt": st.one_of(st.none(), st.integers(0, 3)),
}
_BAD = {
    "count": st.sampled_from([0, 2**20 + 1, 2**31]),
    "int": st.sampled_from([2**31, -(2**31) - 1, 1.5, "1"]),
    "name": st.sampled_from(["", "x" * 129, 1]),
    "ints": st.sampled_from([[2**31], [-(2**31) - 1], ["a"], [True], 3]),
    "bool": st.sampled_from([1, 0, "true", None]),
    "order": st.sampled_from(["other", 1]),
    "any": st.nothing(),
    "do": st.sampled_from([{}, {"op": "append"}, {"op": "fetch", "x": 1}, {"op": "trim_front", "n": "a"}, 3]),
    "live": st.sampled_from(["both", 1, None]),
    "differs": st.sampled_from(["heads", "", 2]),
    "pair": st.sampled_from(["k_head_dim", "heads", "", 2]),
    "via": st.sampled_from(["disk", True]),
    "how": st.sampled_from(["both", 1]),
    "use": st.sampled_from(["write", 1]),
    "arg": st.sampled_from(["bad", -1, None]),
    "env": st.sampled_from([0, None, "x" * 65]),
    "mode": st.sampled_from(["fp32", 1]),
    "layout": st.sampled_from([3, [{"kind": "dense"}] * 9]),
    "size": st.sampled_from([0, 2**31, 1.5]),
    "depth": st.sampled_from([-1, 2**31, "1"]),
    "metadata": st.sampled_from([3, "x", []]),
    "seq": st.sampled_from(["", "x" * 129, -2, 256, None, 1.5, True]),
    "int_or_null": st.sampled_from([2**31, 1.5, "1", True]),
    "store": st.sampled_from(["both", 1, None]),
    "drops": st.sampled_from([3, "x", [1], [[1, 2, 3, 4]], None]),
    "salt": st.sampled_from([-1, 2**31, "0", 1.5, True]),
}
_KIND = {"n": "int", "len": "int", "keep": "int", "positions": "ints", "tail": "int", "kept": "ints",
         "name": "name", "from": "name", "as": "name", "seq": "seq", "window": "ints", "of": "name",
         "order": "order", "returns": "any", "error": "bool", "inplace": "bool", "capacity": "count",
         "layer": "count", "index": "int", "do": "do", "deep": "bool", "live": "live", "differs": "differs",
         "via": "via", "source": "int", "env": "env", "how": "how", "use": "use", "arg": "arg",
         "mode": "mode", "layout": "layout", "n_layers": "size", "max_kv_size": "size", "step": "size",
         "fold_block": "size", "undo": "depth", "num_draft_tokens": "depth", "hot_threshold": "depth",
         "metadata": "metadata", "device": "bool", "tokens": "ints",
         "seqs": "ints", "pos0": "int", "p0": "int", "p1": "int_or_null", "src": "int", "dst": "int", "delta": "int",
         "d": "int", "value": "int", "store": "store", "drops": "drops",
         "req": "name", "salt": "salt", "blocks": "ints", "table": "ints", "free": "ints"}
_OPTIONAL = {"trim_front": {"keep"}, "expect": {"window", "of", "order", "layer", "store", "req", "table", "free"},
             "seq_rm": {"p1"}, "decode": {"drops", "seqs", "pos0", "req"}, "admit": {"salt"}, "lookup": {"salt"}, "restore": {"drops"}, "seq_cp": {"p1"}, "seq_add": {"p1"}, "seq_div": {"p1"}, "pos_min": {"value"},
             "pos_max": {"value"}, "copy": {"deep", "live"}, "reload": {"via", "env"},
             "trim_refused_late": {"how"}, "handle_reuse": {"use", "arg"},
             "build_probe": {"layout", "n_layers", "max_kv_size", "undo", "num_draft_tokens", "step", "hot_threshold",
                             "fold_block"},
             "save_load": {"metadata"}, "mask": {"window", "device"}, "mechanism": {"env"}}


def _field_kind(op: str, f: str, default: str | None = None) -> str:
    if (op, f) in (("append", "n"), ("append_mismatch", "n"), ("append_pair_mismatch", "n")):
        return "count"
    if (op, f) == ("append_pair_mismatch", "differs"):
        return "pair"
    return _KIND[f] if default is None else _KIND.get(f, default)


@st.composite
def _ops(draw):
    """Mostly valid ops, then at most one perturbation: a field's value from
    anywhere, a field removed, an unknown field added."""
    name = draw(st.sampled_from(sorted(trace._op_checker().names)))
    op = {"op": name}
    for f in _FIELDS[name] + draw(st.lists(st.sampled_from(["returns", "error", "inplace", "capacity"]), max_size=2)):
        if f in _OPTIONAL.get(name, ()) and draw(st.booleans()):
            continue
        kind = _field_kind(name, f)
        op[f] = draw(_VALID[kind])
    how = draw(st.sampled_from(["none", "none", "value", "value", "remove", "add"]))
    if how == "value":
        f = draw(st.sampled_from(sorted(op)))
        kind = _field_kind(name, f, "any")
        op[f] = draw(st.one_of(_BAD[kind], _values))
    elif how == "remove":
        del op[draw(st.sampled_from(sorted(op)))]
    elif how == "add":
        op[draw(st.sampled_from(_CHECKS))] = draw(_values)
    return op


def test_the_op_rules_here_are_the_schemas():
    assert set(_FIELDS) >= set(trace._op_checker().names)


@settings(max_examples=1500)
@given(st.one_of(_ops(), _values))
@example({"op": "append", "n": 2**20 + 1})
@example({"op": "append", "n": 0})
@example({"op": "gather_positions", "positions": [2**31]})
@example({"op": "gather_positions", "positions": ["a"]})
@example({"op": "snapshot", "name": "x" * 129})
@example({"op": "snapshot", "name": ""})
@example({"op": "snapshot"})
@example({"op": "fetch", "colour": 1})
@example({"op": "fetch", "error": 1})
@example({"op": "expect", "window": [], "order": "other"})
@example({"op": "fork", "from": "a", "as": "b"})
@example({"op": "layer", "index": 0, "do": {"op": "fetch", "n": 1, "extra": 2}})
@example({"op": "layer", "index": 0, "do": {"n": 1}})
def test_compiled_op_checker_agrees_with_the_schema(op):
    assert trace._op_checker().ok(op) == trace._validator("op").is_valid(op)


@pytest.mark.parametrize("bad", [
    b'{"kvtrace": 1, "cache": {"kind": "dense", "step": 1000000000000}, "ops": []}',
    b'{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1, "n": 2}]}',
    b"\xff\xfe",
    b"[" * 100_000,
])
def test_replay_refuses_bad_files_with_exit_2(tmp_path, capsys, bad):
    from kvspec.fuzz.commands.cli import main

    p = tmp_path / "bad.json"
    p.write_bytes(bad)
    assert main(["replay", str(p)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("invalid kvtrace") and "Traceback" not in out
