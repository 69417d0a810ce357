"""The recorder (kvspec.fuzz.record) and ``kvspec replay --spec-only`` against
faults an engineer could write into them: rows with equal bytes named by
the wrong identity, a trim that returned 0 or a refusal left out or
recorded as done, rows handed back in another dtype taken for the rows
given, ops after the recording stopped, a saved window compared at its
last row only, the op at fault named one op late, a JSON or JUnit report
calling an impossible recording a pass; and bad input (exit 2, one line,
nothing written)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx
from mlx_lm.models.cache import KVCache as LmKVCache

from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.record import record, replay_spec_only
from kvspec.fuzz.trace import parse
from kvspec.impl.dense import KVCache as OurKVCache

RECORDINGS = Path(__file__).resolve().parent / "recordings"


def rows(n, seed, dtype=mx.float16):
    """``n`` rows of one sequence (``[1, 2, n, 8]`` keys and values) drawn from ``seed``."""
    key = mx.random.key(seed)
    k, v = mx.random.normal((2, 1, 2, n, 8), key=key).astype(dtype)
    return k, v


def only_trace(rec):
    (_, trace), = rec.traces()
    return trace


def dense(ops):
    return parse({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": ops})


# -- naming rows with equal bytes -----------------------------------------------------------
@pytest.mark.parametrize("cls", [LmKVCache, OurKVCache])
def test_equal_rows_appended_together_keep_their_own_identities(cls):
    """Three rows with the same bytes in one append (zeros, padding, a layer
    without positions fed a repeated token) are three rows: 0, 1, 2, not the
    newest identity three times (which the contract calls impossible)."""
    cache = cls()
    zeros = mx.zeros((1, 2, 3, 8), dtype=mx.float16)
    with record([cache]) as rec:
        cache.update_and_fetch(zeros, zeros)
        cache.update_and_fetch(zeros[:, :, :1], zeros[:, :, :1])
    trace = only_trace(rec)
    assert [op["returns"] for op in trace.ops] == [[0, 1, 2], [0, 1, 2, 3]]
    assert replay_spec_only(trace).ok


def test_a_slot_whose_bytes_did_not_change_keeps_its_name():
    """A row re-appended with the same bytes after a trim is a new identity
    in the live window, while the saved state, which never changed, keeps
    the old one; after putting the state back the window names the old row
    again (naming by "newest with these bytes" alone would rename both)."""
    a, b, c = rows(1, 1), rows(1, 2), rows(1, 3)
    cache = OurKVCache()
    with record([cache]) as rec:
        cache.update_and_fetch(mx.concatenate([a[0], b[0]], axis=2), mx.concatenate([a[1], b[1]], axis=2))
        saved = cache.state
        cache.trim(1)
        cache.update_and_fetch(*b)  # the same bytes as row 1: identity 2
        cache.state = saved
        cache.update_and_fetch(*c)
    trace = only_trace(rec)
    appends = [op["returns"] for op in trace.ops if op["op"] == "append"]
    assert appends == [[0, 1], [0, 2], [0, 1, 3]]
    assert [op["window"] for op in trace.ops if op["op"] == "expect"] == [[0, 1]]
    assert replay_spec_only(trace).ok, str(replay_spec_only(trace))


# -- what the cache did, recorded as it happened ----------------------------------------------
class TrimsNothing(LmKVCache):
    """Its trim returns 0 and removes nothing (a cache that cannot rewind)."""

    def trim(self, n):
        return 0


def test_a_trim_that_returned_0_is_recorded_and_found_impossible():
    cache = TrimsNothing()
    with record([cache]) as rec:
        cache.update_and_fetch(*rows(4, 0))
        assert cache.trim(2) == 0
        cache.update_and_fetch(*rows(1, 1))
    trace = only_trace(rec)
    assert trace.ops[1] == {"op": "trim", "n": 2, "returns": 0}
    result = replay_spec_only(trace)
    assert not result.ok and result.index == 1
    assert result.divergence.what == "the value trim returned is impossible"


#: ids of the Refuses caches that refuse a state put back
LOCKED: set[int] = set()


class Refuses(LmKVCache):
    """Refuses a fifth row (a full cache), and a state put back once in
    ``LOCKED`` (a loader that wants an empty cache)."""

    def update_and_fetch(self, keys, values):
        if self.offset + keys.shape[2] > 4:
            raise ValueError("cache full")
        return super().update_and_fetch(keys, values)

    @property
    def state(self):
        return LmKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        if id(self) in LOCKED:
            raise ValueError("load into an empty cache")
        LmKVCache.state.fset(self, v)


def test_a_refused_append_is_recorded_as_a_refusal_and_the_program_sees_it():
    cache = Refuses()
    with record([cache]) as rec:
        cache.update_and_fetch(*rows(3, 0))
        with pytest.raises(ValueError, match="cache full"):
            cache.update_and_fetch(*rows(2, 1))
        cache.update_and_fetch(*rows(1, 2))
    trace = only_trace(rec)
    assert trace.ops[1] == {"op": "append", "n": 2, "error": True}
    assert trace.ops[2]["returns"] == [0, 1, 2, 3]  # a refused append hands out no identity
    result = replay_spec_only(trace)  # the contract appends two rows to a dense cache: refusing them is impossible
    assert not result.ok and result.index == 1 and result.divergence.what == "recorded as refused; the spec runs it"


def test_a_refused_state_restore_is_recorded_as_a_refusal():
    cache = Refuses()
    with record([cache]) as rec:
        cache.update_and_fetch(*rows(2, 0))
        saved = cache.state
        cache.update_and_fetch(*rows(1, 1))
        LOCKED.add(id(cache))
        try:
            with pytest.raises(ValueError, match="load into an empty cache"):
                cache.state = saved
        finally:
            LOCKED.discard(id(cache))
        cache.update_and_fetch(*rows(1, 2))
    trace = only_trace(rec)
    restores = [(i, op) for i, op in enumerate(trace.ops) if op["op"] == "state_restore"]
    assert [op for _, op in restores] == [{"op": "state_restore", "name": "state0", "error": True}]
    assert [op["returns"] for op in trace.ops if op["op"] == "append"][-1] == [0, 1, 2, 3]  # it went on from its own rows
    result = replay_spec_only(trace)
    assert not result.ok and result.index == restores[0][0]
    assert result.divergence.what == "recorded as refused; the spec runs it"


class Upcasts(LmKVCache):
    """Hands back float32 windows of the float16 rows it was given."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return k.astype(mx.float32), v.astype(mx.float32)


def test_rows_handed_back_in_another_dtype_are_not_the_rows_given():
    cache = Upcasts()
    with record([cache]) as rec:
        cache.update_and_fetch(*rows(2, 0))
    trace = only_trace(rec)
    assert trace.ops[0]["returns"] == [-1, -1]
    assert not replay_spec_only(trace).ok


def test_nothing_after_the_recording_stopped_is_in_the_trace():
    """A state from elsewhere stops the recording: no later op (a trim, an
    append) enters the trace, which ends where the recording stopped."""
    cache, other = LmKVCache(), LmKVCache()
    other.update_and_fetch(*rows(5, 9))
    with record([cache]) as rec:
        cache.update_and_fetch(*rows(3, 0))
        cache.state = other.state
        assert cache.trim(2) == 2
        cache.update_and_fetch(*rows(1, 1))
    trace = only_trace(rec)
    assert trace.ops == [{"op": "append", "n": 3, "returns": [0, 1, 2]}]
    assert "recording stopped at op 1" in trace.title
    assert replay_spec_only(trace).ok


class Unreadable(LmKVCache):
    """Once it holds 3 rows, a state it hands out cannot be put into
    another instance (the recorder reads a saved window that way)."""

    @property
    def state(self):
        return LmKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        if id(self) not in LOCKED and self.offset >= 3:
            raise RuntimeError("not this cache's state")
        LmKVCache.state.fset(self, v)


def test_a_saved_window_the_recorder_cannot_read_ends_the_trace_not_a_verdict():
    """A saved state read back after an op it could not read is not claimed
    empty (the spec would call that impossible: the tool's own limit
    reported as the cache's fault): the recording stops there, with a note."""
    cache = Unreadable()
    LOCKED.add(id(cache))
    try:
        with record([cache]) as rec:
            cache.update_and_fetch(*rows(2, 0))
            saved = cache.state
            cache.update_and_fetch(*rows(1, 1))
            cache.state = saved
            cache.update_and_fetch(*rows(1, 2))
    finally:
        LOCKED.discard(id(cache))
    trace = only_trace(rec)
    assert not any(op["op"] == "expect" and op["window"] == [] for op in trace.ops)
    assert any("could not be read back" in n for n in rec.notes)
    assert replay_spec_only(trace).ok


def test_an_emptied_cache_state_and_zero_rows_do_not_break_the_program():
    """``c.state`` of a cache trimmed to nothing is an empty window, and an
    ``update_and_fetch`` of zero rows (no kvtrace op appends nothing) stops
    the recording: neither raises into the program."""
    a = rows(3, 0)
    cache = LmKVCache()
    with record([cache]) as rec:
        cache.update_and_fetch(*a)
        cache.trim(3)
        saved = cache.state
        cache.update_and_fetch(*rows(1, 1))
        cache.state = saved
        cache.update_and_fetch(*rows(1, 2))
        cache.update_and_fetch(a[0][:, :, :0], a[1][:, :, :0])
        cache.update_and_fetch(*rows(1, 3))
    trace = only_trace(rec)
    assert [op for op in trace.ops if op["op"] == "expect"] == [{"op": "expect", "of": "state0", "window": []}]
    assert trace.ops[-1] == {"op": "append", "n": 1, "returns": [4]}
    assert any("update_and_fetch of 0 keys" in n for n in rec.notes)
    assert replay_spec_only(trace).ok


# -- the check ----------------------------------------------------------------------------------
def test_a_saved_window_wrong_in_the_middle_is_impossible():
    trace = dense([{"op": "append", "n": 3, "returns": [0, 1, 2]}, {"op": "state_snapshot", "name": "s"},
                   {"op": "expect", "of": "s", "window": [0, 7, 2]}])
    result = replay_spec_only(trace)
    assert not result.ok and result.index == 1 and result.divergence.index == 2
    assert list(result.divergence.impl) == [0, 7, 2] and list(result.divergence.spec) == [0, 1, 2]


def test_the_op_at_fault_is_the_op_before_every_expect_that_follows_it():
    """Two saved states read after one append: the second's window being
    wrong puts the fault at the append, not at the first state's expect."""
    trace = dense([{"op": "append", "n": 2, "returns": [0, 1]},
                   {"op": "state_snapshot", "name": "a"}, {"op": "expect", "of": "a", "window": [0, 1]},
                   {"op": "state_snapshot", "name": "b"}, {"op": "expect", "of": "b", "window": [0, 1]},
                   {"op": "append", "n": 1, "returns": [0, 1, 2]},
                   {"op": "expect", "of": "a", "window": [0, 1]}, {"op": "expect", "of": "b", "window": [0, 9]}])
    result = replay_spec_only(trace)
    assert not result.ok and result.index == 5 and result.divergence.index == 7
    assert result.to_json()["impossible"]["op"] == trace.ops[5]
    assert result.to_json()["impossible"]["seen_at"]["index"] == 7


def test_json_and_junit_never_call_an_impossible_recording_a_pass(tmp_path, capsys):
    junit = tmp_path / "r.xml"
    assert main(["replay", "--spec-only", "--json", "--junit-xml", str(junit), str(RECORDINGS)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["exit"] == 1
    assert doc["counts"] == {"possible": 1, "impossible": 1, "invalid": 0, "tool_failure": 0}
    by_name = {Path(t["trace"]).name: t for t in doc["traces"]}
    assert by_name["mlx_lm_server.json"]["ok"] is False and by_name["impl_server.json"]["ok"] is True
    cases = {Path(tc.get("name")).name: tc for tc in ET.parse(junit).iter("testcase")}
    assert cases["mlx_lm_server.json"].find("failure") is not None
    assert cases["impl_server.json"].find("failure") is None and cases["impl_server.json"].find("error") is None


# -- bad input: one line naming the argument, exit 2, nothing written ---------------------------
def test_a_recording_of_no_ops_is_not_called_possible(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": []}))
    assert main(["replay", "--spec-only", str(empty)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("invalid kvtrace") and "no ops" in out and "Traceback" not in out
    assert main(["replay", "--spec-only", "--json", str(empty)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["status"] == "invalid"


def test_missing_files_and_empty_folders_are_bad_arguments(tmp_path, capsys):
    assert main(["replay", "--spec-only", str(tmp_path / "nope.json")]) == 2
    out = capsys.readouterr().out
    assert "nope.json" in out and "Traceback" not in out and len(out.strip().splitlines()) == 1
    (tmp_path / "none").mkdir()
    assert main(["replay", "--spec-only", str(tmp_path / "none")]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: trace: no kvtrace files") and len(out.strip().splitlines()) == 1


def test_a_cache_module_that_fails_to_import_is_a_bad_argument(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvspec_broken_cache_mod.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / "kvspec_syntax_cache_mod.py").write_text("def f(:\n")
    for spec, said in (("kvspec_broken_cache_mod:C", "RuntimeError: broken at import"),
                       ("kvspec_syntax_cache_mod:C", "SyntaxError")):
        assert main(["record", "server", "-o", str(tmp_path / "r"), "--cache", spec]) == 2
        out = capsys.readouterr().out
        assert out.startswith(f"error: --cache {spec}: cannot import it") and said in out
        assert "Traceback" not in out and not (tmp_path / "r").exists()


def test_a_cache_nothing_could_be_recorded_of_is_a_bad_argument(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kvspec_int8_cache_mod.py").write_text(
        "from mlx_lm.models.cache import KVCache\n"
        "class Int8(KVCache):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.mode = 'int8'\n")
    assert main(["record", "generate", "-o", str(tmp_path / "r"), "--cache", "kvspec_int8_cache_mod:Int8",
                 "--tokens", "1"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: --cache kvspec_int8_cache_mod:Int8: nothing was recorded") and "mode 'int8'" in out
    assert not (tmp_path / "r").exists()


def test_a_folder_holds_one_recording(tmp_path):
    """Writing a recording into a folder that holds an earlier one removes
    the earlier layers this one does not write (else ``replay --spec-only
    folder`` checks both); other files stay."""
    out = tmp_path / "rec"
    out.mkdir()
    (out / "layer02.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    cache = LmKVCache()
    with record([cache], out=out):
        cache.update_and_fetch(*rows(2, 0))
    assert sorted(p.name for p in out.iterdir()) == ["layer00.json", "notes.txt"]
