"""The prefix kind's harness (fuzz/prefix.py): the lockstep agrees with our
pool over campaigns and reaches every must_reach edge within a small
budget; hand-broken pools are caught, shrunk to a few ops, and named by
op, rule and field; the recorded traces replay (and catch the bug they are
named after); bad trace input exits 2 naming the field; the rows are named
back exactly; and the plug-in surface another engine uses
(prefix_campaign, replay_prefix with a target factory, declared
differences)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz import kinds
from kvspec.fuzz.bugs import by_name
from kvspec.fuzz.bugs.prefix import BUGS
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.failures import Divergence
from kvspec.fuzz.prefix import RULES, PrefixLockstep, PrefixRows, row_name
from kvspec.fuzz.prefix_runs import prefix_campaign, replay_prefix
from kvspec.fuzz.trace import TraceFormatError, load
from kvspec.impl.prefix import PrefixCachePool
from kvspec.spec import prefix as sp

TRACES = Path(__file__).parent / "traces"
PREFIX_TRACES = sorted(TRACES.glob("prefix_*.json"))
WORKED = TRACES / "prefix_worked_example.json"
CACHE = {"kind": "prefix", "block_size": 2, "n_blocks": 4, "window": None, "kv_heads": 1, "head_dim": 8,
         "dtype": "float16", "mode": "fp16"}


# -- hand-broken pools (the catalog's bugs live in fuzz/bugs/prefix.py) ---------------------------------


class StaleKeyOnEviction(PrefixCachePool):
    """A block popped from the free queue keeps its key and its place in
    the cached map (vLLM PR 4761's shape)."""

    def _take(self) -> int:
        b = self._q_popleft()
        self._ref[b] = 1
        return b


class HitUncapped(PrefixCachePool):
    """A whole-prompt match is hit whole: the last token is not recomputed."""

    def _hits(self, tokens, salt):
        bs, out = self.block_size, []
        for i in range(len(tokens) // bs):
            ids = self._cached.get((salt, tokens[:(i + 1) * bs]))
            if not ids:
                break
            out.append(ids[0])
        return out


class FreeHeadFirst(PrefixCachePool):
    """A table is released root first: the root reaches the back of the
    queue first, so it is evicted before its descendants."""

    def _release(self, r) -> None:
        r.table = list(reversed(r.table))
        super()._release(r)


BROKEN = [(StaleKeyOnEviction, ("cached map", "key", "rows")), (HitUncapped, ("hit length",)),
          (FreeHeadFirst, ("free queue",))]


def test_a_clean_campaign_agrees_and_reaches_every_must_reach_edge():
    """One campaign through ``prefix_campaign``, bounded by examples: seed 1
    reaches every edge within 15 of them. The rate on other seeds is
    tests/test_must_reach.py's (seeds 4 and 6, 25 examples, through the
    campaigns ``kvspec verify`` runs); agreement over many more examples is
    every catalog bug's campaign below, clean up to the bug's edge."""
    got = prefix_campaign(None, max_examples=20, seed=1)
    assert got.ok, got.error
    missed = [e for e in kinds.get("prefix").must_reach if not got.stats.get(e)]
    assert not missed, f"not reached in 20 examples: {missed}"


@pytest.mark.parametrize("cls,rules", BROKEN, ids=lambda x: getattr(x, "__name__", ""))
def test_a_hand_broken_pool_is_caught_shrunk_and_named(cls, rules):
    got = prefix_campaign(cls, max_examples=100, seed=4)
    assert got.status == "diverged", f"{cls.__name__} not caught in {got.examples} examples"
    assert isinstance(got.error, Divergence)
    assert got.examples <= 20, got.examples
    ops = [op for op in got.trace.ops if op["op"] != "expect"]
    assert len(ops) <= 8, got.trace.dumps()
    first = str(got.error).splitlines()[0]
    assert first.startswith(f"op {got.error.index} ") and any(f"(rule {r!r}: " in first for r in rules), first
    assert replay_prefix(got.trace).ok  # the minimal trace passes on ours
    again = replay_prefix(got.trace, cls)
    assert not again.ok and again.divergence.index == got.error.index


def _run(ops, factory=None, cache=CACHE):
    lock = PrefixLockstep(dict(cache), factory)
    lock.compare_messages = True
    for i, op in enumerate(ops):
        lock.step(i, op)
    return lock


def test_each_divergence_names_op_rule_and_field_with_both_sides():
    """The messages, in full, for a stale key, an uncapped hit and a head-first free."""
    with pytest.raises(Divergence) as e:
        _run([{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"},
              {"op": "admit", "req": "b", "tokens": [5, 6, 7]}], StaleKeyOnEviction, {**CACHE, "n_blocks": 2})
    text = str(e.value)
    assert text.splitlines()[0] == (f'op 2 {{"op": "admit", "req": "b", "tokens": [5, 6, 7]}}: block 0 key differs '
                                    f"(rule 'key': {RULES['key']})"), text
    assert text.splitlines()[1:] == ["  spec says: None", "  impl did:  (None, (1, 2))"]

    with pytest.raises(Divergence) as e:
        _run([{"op": "admit", "req": "a", "tokens": [1, 2]}, {"op": "admit", "req": "b", "tokens": [1, 2]}],
             HitUncapped)
    lines = str(e.value).splitlines()
    assert lines[0].endswith(f"admit result: hit tokens differs (rule 'hit length': {RULES['hit length']})")
    assert lines[1:] == ["  spec says: 0", "  impl did:  2"]

    with pytest.raises(Divergence) as e:
        _run([{"op": "admit", "req": "a", "tokens": [1, 2, 3, 4]}, {"op": "free", "req": "a"}], FreeHeadFirst)
    lines = str(e.value).splitlines()
    assert "free queue (front to back) differs (rule 'free queue'" in lines[0]
    assert lines[1:] == ["  spec says: [2, 3, 1, 0]", "  impl did:  [2, 3, 0, 1]"]
    assert e.value.to_json()["what"].startswith("free queue")


def test_the_view_compares_k_and_v_apart():
    class ValuesOfTheNextRow(PrefixCachePool):
        def write(self, req, keys, values):
            super().write(req, keys, mx.concatenate([values[1:], values[:1]]) if values.shape[0] > 1 else values)

    with pytest.raises(Divergence, match=r"slot 0 row differs \(rule 'rows'") as e:
        _run([{"op": "admit", "req": "a", "tokens": [1, 2]}], ValuesOfTheNextRow)
    assert "K (None, (1,)) / V (None, (1, 2))" in str(e.value)


def test_a_refused_op_leaves_every_byte_of_ours_as_it_was():
    """Slab bytes of a free unkeyed block are garbage to the view, but an
    admit that is not admitted must not touch them either."""

    class ScribblesWhenFull(PrefixCachePool):
        def admit(self, req, tokens, salt=None):
            got = super().admit(req, tokens, salt)
            if not got.admitted and self.keys is not None:
                free = mx.array(np.isin(np.arange(self.n_blocks), self.free_queue())[:, None, None, None])
                self.keys = mx.where(free, self.keys + 1, self.keys)  # only free unkeyed blocks' slots
            return got

    ops = [{"op": "admit", "req": "a", "tokens": [1, 2, 3, 4, 5]},
           {"op": "admit", "req": "b", "tokens": [9, 9, 9]}]  # needs 2 blocks, 1 free: not admitted
    with pytest.raises(Divergence, match="the pool's slabs after an op that changes nothing") as e:
        _run(ops, ScribblesWhenFull)
    assert "rule 'nothing changed'" in str(e.value)
    lock = _run(ops)  # ours: not admitted, nothing changed
    assert lock.stats["admit refused"] == 1


# -- traces ---------------------------------------------------------------------------------------------


def test_the_worked_example_replays_green(capsys):
    assert main(["replay", str(WORKED)]) == 0
    assert "17 ops, spec and implementation agree" in capsys.readouterr().out


def test_every_bug_has_its_trace():
    assert {b.name for b in BUGS} <= {p.stem for p in PREFIX_TRACES}


@pytest.mark.parametrize("path", PREFIX_TRACES, ids=lambda p: p.stem)
def test_recorded_trace_passes_on_ours_and_catches_its_bug(path, capsys):
    assert main(["replay", str(path)]) == 0
    if path.stem in {b.name for b in BUGS}:
        assert load(path).title, "a bug's trace says what it checks"
        assert main(["replay", str(path), "--bug", path.stem]) == 1
        assert not replay_prefix(load(path), by_name(path.stem).factories["prefix"]).ok
    capsys.readouterr()


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name)
def test_a_campaign_catches_the_bug_and_its_trace_passes_on_ours(bug):
    got = prefix_campaign(bug.factories["prefix"], max_examples=300, seed=1, shrink=False)
    assert got.status == "diverged", f"{bug.name} not caught in {got.examples} examples"
    assert replay_prefix(got.trace).ok


def _doc(ops, **cache_over):
    cache = {"kind": "prefix", "block_size": 2, "n_blocks": 4, "window": None}
    cache.update(cache_over)
    return {"kvtrace": 1, "cache": cache, "ops": [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, *ops]}


BAD = {
    "unknown req": (_doc([{"op": "decode", "req": "b", "tokens": [4]}]),
                    "op 1 field 'req': request 'b' is not admitted before this op"),
    "negative token": (_doc([{"op": "admit", "req": "b", "tokens": [1, -1]}]),
                       "op 1 field 'tokens': token ids are integers >= 0"),
    "negative token in a lookup": (_doc([{"op": "lookup", "tokens": [-3]}]), "op 1 field 'tokens'"),
    "block_size 0": (_doc([], block_size=0), "field cache.block_size: 0 is less than the minimum of 1"),
    "no n_blocks": (_doc([]), "'n_blocks' is a required property"),
    "window 0": (_doc([], window=0), "field cache.window: 0 is less than the minimum of 1"),
    "negative salt": (_doc([{"op": "admit", "req": "b", "tokens": [1], "salt": -1}]), "op 1 field 'salt'"),
    "a cells decode": (_doc([{"op": "decode", "seqs": [0], "tokens": [4], "pos0": 3}]), "'req' is a required"),
    "a cells field": (_doc([{"op": "decode", "req": "a", "tokens": [4], "pos0": 3}]),
                      "op 1 field 'pos0': a prefix decode has no field 'pos0'"),
    "expect of nothing": (_doc([{"op": "expect"}]), "a prefix expect checks something"),
    "expect window without req": (_doc([{"op": "expect", "window": [1, 2, 3]}]), "'req' is a required property"),
    "expect of an unknown req": (_doc([{"op": "expect", "req": "z", "table": []}]), "request 'z' is not admitted"),
    "a dense op": (_doc([{"op": "append", "n": 1}]), "'append'"),
    "req not a string": (_doc([{"op": "free", "req": 3}]), "op 1 field 'req'"),
    "slabs too large": (_doc([], n_blocks=2**20, block_size=2**20), "field cache: buffers of up to"),
}
BAD["no n_blocks"][0]["cache"].pop("n_blocks")


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_trace_input_exits_2_naming_the_field_and_rule(tmp_path, capsys, case):
    doc, words = BAD[case]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    assert main(["replay", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert words in out and "Traceback" not in out, out


def test_a_double_free_is_a_refusal_not_a_format_error(capsys, tmp_path):
    doc = _doc([{"op": "free", "req": "a"}, {"op": "free", "req": "a", "error": True},
                {"op": "free_blocks", "blocks": [0], "error": True}])
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    assert main(["replay", str(p)]) == 0
    capsys.readouterr()


def test_replay_prefix_refuses_another_kind():
    with pytest.raises(TraceFormatError, match="cache.kind"):
        replay_prefix(load(TRACES / "format_example.json"))


# -- rows -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rows_name_back_exactly_in_every_dtype(dtype):
    rows = PrefixRows(2, 8, dtype)
    names = [row_name(s, (1, 2, 3), p) for s in (None, 0, 1) for p in range(3)]
    for which in ("k", "v"):
        made = rows.rows(names, which)
        stored = np.asarray(mx.array(made).astype(getattr(mx, dtype)).astype(mx.float32))
        assert [rows.name(r, which) for r in stored] == names
        assert len({r.tobytes() for r in made}) == len(names)
    assert rows.name(np.zeros((2, 8), np.float32), "k") is None
    assert not np.array_equal(rows.row(names[0], "k"), rows.row(names[0], "v"))


def test_a_row_s_values_are_a_stable_function_of_its_name():
    """A stable hash (BLAKE2b of the name's repr), not Python's salted hash():
    the same rows in every process."""
    import os
    import subprocess
    import sys

    code = "from kvspec.fuzz.prefix import PrefixRows; print(PrefixRows.seed('k', (None, (1, 2))))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(s)}, cwd=Path(__file__).parents[1]).stdout
            for s in (1, 2)}
    assert runs == {f"{PrefixRows.seed('k', (None, (1, 2)))}\n"}


# -- another engine: the plug-in surface ---------------------------------------------------------------


class SpecTarget(sp.PrefixModel):
    """The spec itself as a PrefixTarget (another engine's shape: its
    results, its observe without reads)."""

    name = "spec-as-target"

    def __init__(self, cache: dict) -> None:
        super().__init__(cache["block_size"], cache["n_blocks"], cache.get("window"))


class LookupOneBlockLong(SpecTarget):
    def lookup(self, tokens, salt=None):
        got = super().lookup(tokens, salt)
        return got + self.world.block_size if got else got


class IgnoresDoubleFree(SpecTarget):
    """vLLM's manager ignores a free of a request it does not know; both
    change nothing, so it is a difference a target may declare."""

    declared: ClassVar[dict[str, str]] = {
        "free refusal": "the engine ignores a free of an unknown request (nothing changes either way)"}

    def free(self, req):
        if req in self.world.requests and self.world.requests[req].live:
            super().free(req)


def test_another_target_plugs_in_through_the_two_calls():
    assert prefix_campaign(SpecTarget, max_examples=30, seed=2).ok
    # the trace as found (shrinking is test_a_hand_broken_pool_is_caught_shrunk_and_named's)
    bad = prefix_campaign(LookupOneBlockLong, max_examples=60, seed=2, shrink=False)
    assert bad.status == "diverged" and bad.trace is not None
    assert bad.trace.ops[bad.error.index]["op"] in ("lookup",)
    assert replay_prefix(bad.trace).ok
    again = replay_prefix(bad.trace, LookupOneBlockLong)
    assert not again.ok and "spec-as-target did" in str(again.divergence)


def test_a_declared_refusal_difference_is_not_counted():
    ops = [{"op": "admit", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "a"}, {"op": "free", "req": "a"}]
    lock = _run(ops, {"target": IgnoresDoubleFree})
    assert lock.stats["declared: free refusal"] == 1 and lock.not_compared == {"free refusal"}

    class Undeclared(IgnoresDoubleFree):
        declared: ClassVar[dict[str, str]] = {}

    with pytest.raises(Divergence, match="refusal differs"):
        _run(ops, {"target": Undeclared})


# -- render ---------------------------------------------------------------------------------------------


def test_render_draws_tables_refcounts_and_the_free_queue():
    from kvspec.fuzz.render import svg, timeline

    tl = timeline(load(WORKED))
    assert tl.divergence is None
    rows = {r.label: r for r in tl.frames[4].rows}  # after "free a"
    assert [c.text for c in rows["free queue"].cells] == ["3", "1"]
    assert [c.cls for c in rows["free queue"].cells] == ["empty", "saved"]  # 1 is cached-free
    assert [c.text for c in rows["table b"].cells] == ["0", "2"]
    assert [c.text for c in rows["request b"].cells] == ["1", "2", "3", "4"]
    assert "kind prefix, block_size 2, n_blocks 4, window None" in svg(tl)


# -- one hand-broken target per check (each check seen firing) -------------------------------------------


class CachedIdsReversed(PrefixCachePool):
    def cached(self):
        return {k: tuple(reversed(ids)) for k, ids in super().cached().items()}


class FreeScribblesKeyedRows(PrefixCachePool):
    """free() adds 1 to the K rows of the keyed blocks it queues."""

    def free(self, req):
        held = [b for b in self.table(req) if b is not None]
        super().free(req)
        hit = [b for b in held if self._ref[b] == 0 and self._key[b] is not None]
        if hit:
            mask = mx.array(np.isin(np.arange(self.n_blocks), hit)[:, None, None, None])
            self.keys = mx.where(mask, self.keys + 1, self.keys)


class FetchThroughRotatedTable(PrefixCachePool):
    def fetch(self, req):
        r = self._reqs[req]
        table = r.table
        r.table = table[1:] + table[:1]
        try:
            return super().fetch(req)
        finally:
            r.table = table


class AdmitResultReversed(PrefixCachePool):
    def admit(self, req, tokens, salt=None):
        got = super().admit(req, tokens, salt)
        return type(got)(got.admitted, got.hit_tokens, tuple(reversed(got.table)))


class DecodeReturnsNone(PrefixCachePool):
    def decode(self, req, tokens):
        super().decode(req, tokens)


class BFloat16StoredAsFloat16(PrefixCachePool):
    def write(self, req, keys, values):
        super().write(req, keys.astype(mx.float16), values.astype(mx.float16))


class CopySharesTheFreeQueue(PrefixCachePool):
    def copy(self):
        new = super().copy()
        new._next, new._prev, new._in_free = self._next, self._prev, self._in_free
        return new


ADMIT_A = {"op": "admit", "req": "a", "tokens": [1, 2, 3, 4]}
CHECKS = {
    "cached map": (CachedIdsReversed, [{"op": "admit", "req": "a", "tokens": [1, 2]},
                                       {"op": "admit", "req": "b", "tokens": [1, 2]}], CACHE),
    "rows": (FreeScribblesKeyedRows, [ADMIT_A, {"op": "free", "req": "a"}], CACHE),
    "reads": (FetchThroughRotatedTable, [ADMIT_A], CACHE),
    "block table": (AdmitResultReversed, [ADMIT_A], CACHE),
    "decode room": (DecodeReturnsNone, [ADMIT_A, {"op": "decode", "req": "a", "tokens": [5]}], CACHE),
    "dtype": (BFloat16StoredAsFloat16, [ADMIT_A], {**CACHE, "dtype": "bfloat16", "mode": "bf16"}),
    "copy": (CopySharesTheFreeQueue, [ADMIT_A], CACHE),
}


@pytest.mark.parametrize("rule", sorted(CHECKS))
def test_each_check_fires_on_its_hand_broken_target(rule):
    cls, ops, cache = CHECKS[rule]
    with pytest.raises(Divergence) as e:
        _run(ops, cls, cache)
    first = str(e.value).splitlines()[0]
    assert f"(rule {rule!r}: " in first and first.startswith(f"op {len(ops) - 1} "), first
    _run(ops, None, cache)  # ours agrees


def test_reads_cover_exactly_the_live_requests():
    class ReadsAGhost(SpecTarget):
        def observe(self):
            got = super().observe()
            got["reads"] = {r: [] for r in ("a", "ghost")}
            return got

    class ReadsNone(SpecTarget):
        def observe(self):
            got = super().observe()
            got["reads"] = {}
            return got

    for cls in (ReadsAGhost, ReadsNone):
        with pytest.raises(Divergence, match=r"requests read \(live\) differs \(rule 'reads'"):
            _run([{"op": "admit", "req": "a", "tokens": [1, 2]}, {"op": "preempt", "req": "a"}], {"target": cls})


@pytest.mark.parametrize("dtype,narrower", [("bfloat16", "float16"), ("float32", "float16"),
                                            ("float32", "bfloat16")])
def test_rows_stored_in_a_narrower_dtype_lose_their_names(dtype, narrower):
    rows = PrefixRows(1, 8, dtype)
    names = [row_name(None, (1, 2, 3), p) for p in range(3)]
    stored = np.asarray(mx.array(rows.rows(names, "k")).astype(getattr(mx, narrower)).astype(mx.float32))
    assert [rows.name(r, "k") for r in stored] == [None] * 3
