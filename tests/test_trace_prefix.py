"""Loading a prefix kvtrace (docs/kvtrace.md "The prefix kind: what loads,
what runs"): bounds on the pool and its tokens, the shape of each op's
``returns``, ids no engine could be handed refused at load (exit 2 naming the
field), refusals the spec defines run; and the unknown-op message of every
kind names the kind's own ops."""

import json

import pytest

from kvspec.fuzz import kinds, trace
from kvspec.fuzz.commands.cli import main

CACHE = {"kind": "prefix", "block_size": 2, "n_blocks": 4}
ADMIT = {"op": "admit", "req": "a", "tokens": [1, 2, 3]}


def replay(tmp_path, capsys, cache, ops):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"kvtrace": 1, "cache": cache, "ops": ops}))
    rc = main(["replay", str(p)])
    return rc, capsys.readouterr().out


BAD = {
    # 1. bounds: a replay of seconds
    "pool of 2^20 slots": ({**CACHE, "n_blocks": 2**20, "block_size": 1}, [ADMIT],
                           ("field cache.n_blocks: n_blocks 1048576 x block_size 1 = 1048576 slots, more than the "
                           f"limit of {trace.MAX_PREFIX_SLOTS}")),
    "pool just past the bound": ({**CACHE, "n_blocks": trace.MAX_PREFIX_SLOTS // 4 + 1, "block_size": 4}, [],
                                 "field cache.n_blocks:"),
    "tokens per op": (CACHE, [{"op": "lookup", "tokens": [1] * (trace.MAX_PREFIX_OP_TOKENS + 1)}],
                      f"op 0 field 'tokens': {trace.MAX_PREFIX_OP_TOKENS + 1} tokens, more than the limit"),
    "expect window per op": (CACHE, [ADMIT, {"op": "expect", "req": "a",
                                             "window": [1] * (trace.MAX_PREFIX_OP_TOKENS + 1)}],
                             "op 1 field 'window':"),
    "tokens of a trace": (CACHE, [ADMIT, *[{"op": "decode", "req": "a", "tokens": [1] * 500}] * 3],
                          (f"field ops: the admits and decodes hand the pool 1503 tokens, more than the limit of "
                          f"{trace.MAX_PREFIX_TOKENS}")),
    # 2. returns of a shape the op cannot return
    "admit returns a string": (CACHE, [{**ADMIT, "returns": "yes"}], "op 0 field 'returns': a prefix admit returns"),
    "admit returns fields missing": (CACHE, [{**ADMIT, "returns": {"admitted": True}}],
                                     "op 0 field 'returns': a prefix admit returns an object"),
    "admit returns an unknown field": (CACHE, [{**ADMIT, "returns": {"admitted": True, "hit": 0, "table": [0, 1],
                                                                    "hits": 0}}], "unknown 'hits'"),
    "admit returns admitted 1": (CACHE, [{**ADMIT, "returns": {"admitted": 1, "hit": 0, "table": [0, 1]}}],
                                 "op 0 field 'returns.admitted': a boolean"),
    "admit returns hit -1": (CACHE, [{**ADMIT, "returns": {"admitted": True, "hit": -1, "table": [0, 1]}}],
                             "op 0 field 'returns.hit': an integer >= 0"),
    "admit returns table [-1]": (CACHE, [{**ADMIT, "returns": {"admitted": True, "hit": 0, "table": [-1]}}],
                                 "op 0 field 'returns.table': block ids are integers >= 0"),
    "resume returns null": (CACHE, [ADMIT, {"op": "preempt", "req": "a"},
                                    {"op": "resume", "req": "a", "returns": None}],
                            "op 2 field 'returns': a prefix resume returns an object"),
    "free returns 5": (CACHE, [ADMIT, {"op": "free", "req": "a", "returns": 5}],
                       "op 1 field 'returns': a prefix free returns nothing"),
    "free_blocks returns false": (CACHE, [{"op": "free_blocks", "blocks": [0], "returns": False}],
                                  "op 0 field 'returns': a prefix free_blocks returns nothing"),
    "decode returns 1": (CACHE, [ADMIT, {"op": "decode", "req": "a", "tokens": [1], "returns": 1}],
                         "op 1 field 'returns': a prefix decode returns a boolean"),
    "reset returns null": (CACHE, [{"op": "reset", "returns": None}], "op 0 field 'returns': a prefix reset returns"),
    "lookup returns true": (CACHE, [{"op": "lookup", "tokens": [1], "returns": True}],
                            "op 0 field 'returns': a prefix lookup returns an integer >= 0"),
    "lookup returns -1": (CACHE, [{"op": "lookup", "tokens": [1], "returns": -1}], "op 0 field 'returns':"),
    # 2. and 3. ids no engine could be handed
    "expect table [-1]": (CACHE, [ADMIT, {"op": "expect", "req": "a", "table": [-1]}],
                          "op 1 field 'table': block ids are integers >= 0, got -1"),
    "expect free [-1]": (CACHE, [{"op": "expect", "free": [-1]}], "op 0 field 'free': block ids are integers >= 0"),
    "free_blocks [-1]": (CACHE, [{"op": "free_blocks", "blocks": [-1]}],
                         "op 0 field 'blocks': block ids are integers >= 0, got -1"),
    "free_blocks [1e30]": (CACHE, [{"op": "free_blocks", "blocks": [1e30]}], "op 0 field 'blocks.0':"),
    "admit tokens [-1]": (CACHE, [{"op": "admit", "req": "a", "tokens": [-1]}],
                          "op 0 field 'tokens': token ids are integers >= 0"),
    # 4. the unknown-op message names the kind and its ops
    "unknown op": (CACHE, [{"op": "admitt", "req": "a"}],
                   ("op 0 field 'op': unknown op 'admitt' (did you mean 'admit'?); known: expect, admit, decode, free, "
                   "preempt, resume, lookup, free_blocks, reset (the ops of kind prefix)")),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_prefix_trace_exits_2_naming_the_field(tmp_path, capsys, name):
    cache, ops, message = BAD[name]
    rc, out = replay(tmp_path, capsys, cache, ops)
    assert rc == 2, out
    assert out.startswith("invalid kvtrace") and message in out, out


@pytest.mark.parametrize("ops, refusal", [
    ([{"op": "admit", "req": "a", "tokens": []}], "tokens must hold at least one token"),
    ([{"op": "free_blocks", "blocks": []}], "blocks must be a non-empty list"),
    ([{"op": "free_blocks", "blocks": [99]}], "blocks must be block ids in 0..3"),
    ([ADMIT, {"op": "free", "req": "a"}, {"op": "free_blocks", "blocks": [0]}], "free_blocks"),
])
def test_a_refusal_the_spec_defines_runs(tmp_path, capsys, ops, refusal):
    rc, out = replay(tmp_path, capsys, CACHE, ops)
    assert rc == 0, out
    assert "refused by both sides" in out and refusal in out, out


def test_returns_of_the_right_shape_load_and_are_checked(tmp_path, capsys):
    ops = [{**ADMIT, "returns": {"admitted": True, "hit": 0, "table": [0, 1]}},
           {"op": "decode", "req": "a", "tokens": [4], "returns": True},
           {"op": "lookup", "tokens": [1, 2, 3], "returns": 2},
           {"op": "preempt", "req": "a", "returns": None},
           {"op": "resume", "req": "a", "returns": {"admitted": True, "hit": 2, "table": [0, 2]}},
           {"op": "free", "req": "a"},
           {"op": "reset", "returns": True}]
    rc, out = replay(tmp_path, capsys, CACHE, ops)
    assert rc == 0, out
    # a well-formed check the spec does not meet is the trace's (exit 3), not the format's
    rc, out = replay(tmp_path, capsys, CACHE, [{"op": "lookup", "tokens": [1], "returns": 1}])
    assert rc == 3 and "trace's 'returns' check fails" in out, out


def test_pools_and_tokens_at_the_bounds_load():
    slots = trace.MAX_PREFIX_SLOTS
    per_op = trace.MAX_PREFIX_OP_TOKENS
    ops = [{"op": "admit", "req": "a", "tokens": [1] * per_op},
           {"op": "decode", "req": "a", "tokens": [1] * (trace.MAX_PREFIX_TOKENS - per_op)},
           {"op": "lookup", "tokens": [1] * per_op}]
    for bs in (1, 4, 16):
        doc = {"kvtrace": 1, "cache": {"kind": "prefix", "block_size": bs, "n_blocks": slots // bs}, "ops": ops}
        trace.loads(json.dumps(doc))


@pytest.mark.parametrize("kind", kinds.trace_kinds())
def test_the_unknown_op_message_names_the_kind_and_its_ops(kind):
    entry = kinds.get(kind)
    cache = {"kind": kind, **{f: 2 for f, v in entry.fields.items() if v is kinds.REQUIRED}}
    with pytest.raises(trace.TraceFormatError) as info:
        trace.loads(json.dumps({"kvtrace": 1, "cache": cache, "ops": [{"op": "nosuch_op"}]}))
    ops = [op for op in entry.all_ops if op not in entry.without]
    assert f"known: {', '.join(ops)} (the ops of kind {kind})" in str(info.value)
