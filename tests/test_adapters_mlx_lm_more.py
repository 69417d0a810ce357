"""Issue 47, item 3: the built-in targets never crash into a verdict.

Each defect below was reported against mlx-lm 0.32.2 and seen failing
before its fix (the messages it gave then are quoted in each test):
``reload`` crashed on a missing ``meta_state``, float32 and bfloat16 rows of
an int8 (and fp16) trace came back as ``?`` rows or crashed, and a shallow
``copy`` copied the adapter instead of mlx-lm's cache. Then the rule that
tells a target's failure from the harness's (kvspec.fuzz.targets.classify_failure).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.targets import HarnessFailure, TargetCannotRun, classify_failure

DENSE = {"kind": "dense", "mode": "fp16", "step": 4, "batch": 1, "kv_heads": 1, "head_dim": 8}
INT8 = {"kind": "dense", "mode": "int8", "step": 4, "batch": 1, "kv_heads": 1, "head_dim": 32}
RING = {"kind": "rotating", "mode": "fp16", "step": 4, "batch": 1, "kv_heads": 1, "head_dim": 8, "max_size": 4,
        "keep": 1}
#: mlx-lm's RotatingKVCache's known contract differences (docs/conformance.md:
#: trimmable after a wrap, masks over the sinks), waived so that these
#: tests see only what they are about
WAIVE = ("--waive", "trimmable", "--waive", "masks")


def run_cli(tmp_path: Path, cache: dict[str, Any], ops: list[dict[str, Any]], *extra: str,
            target: str = "mlx-lm") -> tuple[int, dict[str, Any]]:
    """``kvspec replay TRACE --target TARGET --json`` in this process: exit
    status and the JSON object."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kvtrace": 1, "cache": cache, "ops": ops}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["replay", str(path), "--target", target, "--json", *extra])
    return code, json.loads(out.getvalue())


# -- reload ----------------------------------------------------------------------


@pytest.mark.parametrize("via", ["file", "state"])
@pytest.mark.parametrize("cache", [DENSE, INT8, RING], ids=["KVCache", "QuantizedKVCache", "RotatingKVCache"])
def test_reload_runs_on_mlx_lm(tmp_path, via, cache):
    """Before: exit 1, ``raised AttributeError: 'KVCacheAdapter' object has
    no attribute 'meta_state' (not a refusal: a crash)``. Now mlx-lm's own
    save_prompt_cache / load_prompt_cache (or ``state = state``) run, and
    every later op compares the loaded cache (capacity waived: mlx-lm keeps
    its whole preallocated buffer on save, a contract difference that the
    next test pins)."""
    ops = [{"op": "append", "n": 3}, {"op": "reload", "via": via}, {"op": "append", "n": 1},
           {"op": "trim", "n": 1}, {"op": "append", "n": 2}]
    code, doc = run_cli(tmp_path, cache, ops, "--waive", "capacity", *WAIVE)
    assert (code, doc["status"]) == (0, "ok"), doc


def test_reload_compares_the_loaded_cache(tmp_path):
    """The reload is a real comparison, not a skip: mlx-lm's KVCache saves
    its whole buffer (capacity 4 after a load of 3 rows with step 4), which
    the spec's reload does not keep: a divergence at the reload, for that
    reason and no other."""
    code, doc = run_cli(tmp_path, DENSE, [{"op": "append", "n": 3}, {"op": "reload"}])
    assert code == 1, doc
    assert (doc["divergence"]["index"], doc["divergence"]["what"]) == (1, "capacity differs")


# -- rows of every dtype ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("cache", [DENSE, INT8, RING], ids=["KVCache", "QuantizedKVCache", "RotatingKVCache"])
def test_rows_of_every_dtype_agree(tmp_path, cache, dtype):
    """Before: an int8 or fp16 trace of float32 rows diverged at op 0 with
    ``mlx-lm did: ['?', '?', '?']`` (the adapter's expected rows were cast
    to float16), and bfloat16 rows crashed (``'bfloat16' is not a valid PEP
    3118 buffer format string``, exit 1)."""
    ops = [{"op": "append", "n": 3}, {"op": "append", "n": 1}, {"op": "snapshot", "name": "s"},
           {"op": "trim", "n": 2}, {"op": "append", "n": 3}, {"op": "restore", "name": "s"},
           {"op": "append", "n": 1}]
    code, doc = run_cli(tmp_path, {**cache, "dtype": dtype}, ops, *WAIVE)
    assert (code, doc["status"]) == (0, "ok"), doc


def test_int8_rows_come_back_in_the_rows_dtype():
    """mlx-lm's QuantizedKVCache keeps scales in the rows' dtype, so a
    reader sees bfloat16 rows for bfloat16 input: the view says so
    (kvtrace_dtype), and its host form is exact float32."""
    import mlx.core as mx
    import numpy as np

    from kvspec.fuzz.adapters.mlx_lm import QuantizedKVCacheAdapter, affine_int8_row
    from kvspec.fuzz.rows import dtype_name, host

    a = QuantizedKVCacheAdapter({"step": 4})
    x = mx.arange(64, dtype=mx.float32).reshape(1, 1, 2, 32).astype(mx.bfloat16) / 7
    k, _ = a.update_and_fetch(x, x)
    assert dtype_name(k) == "bfloat16"
    assert np.asarray(k).dtype == np.float32
    assert np.asarray(k).tobytes() == host(affine_int8_row(x)).tobytes()


# -- copy ------------------------------------------------------------------------


def test_shallow_copy_copies_mlx_lms_cache_not_the_adapter(tmp_path):
    """Before: ``copy.copy`` copied the adapter, so the copy and the
    original were one mlx-lm object, and the append right after the copy
    showed in the copy (op 2, ``mlx-lm did: [0, 1, 2, 3]``). Now the copy is
    ``copy.copy`` of mlx-lm's KVCache: its arrays are shared, so only a
    write into a row the copy still shows (after a trim) changes it: op 4,
    token 4 where the copy had token 2."""
    from kvspec.fuzz.adapters.mlx_lm import KVCacheAdapter

    a = KVCacheAdapter({"step": 4})
    dup = copy.copy(a)
    assert dup is not a and dup.inner is not a.inner and type(dup.inner) is type(a.inner)
    ops = [{"op": "append", "n": 3}, {"op": "copy", "name": "c", "deep": False}, {"op": "append", "n": 1},
           {"op": "trim", "n": 2}, {"op": "append", "n": 1}]
    code, doc = run_cli(tmp_path, DENSE, ops)
    assert code == 1, doc
    d = doc["divergence"]
    assert (d["index"], d["what"], d["impl"]) == (4, "view of holder:c changed (isolation)", [0, 1, 4])
    deep = [{**op, "deep": True} if op["op"] == "copy" else op for op in ops]
    assert run_cli(tmp_path, DENSE, deep)[0] == 0


# -- whose failure -------------------------------------------------------------------


class NoMetaState:
    """A user's dense cache with ``state`` but no ``meta_state``."""

    kvspec_kind = "dense"

    def __init__(self) -> None:
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k: Any, v: Any) -> Any:
        import mlx.core as mx

        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def fetch(self) -> Any:
        return None if self.offset == 0 else (self.keys, self.values)

    @property
    def state(self) -> Any:
        return self.keys, self.values

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values = v


class CrashesOnFourth(NoMetaState):
    """Raises KeyError (no refusal category) on the fourth row."""

    def update_and_fetch(self, k: Any, v: Any) -> Any:
        if self.offset >= 3:
            raise KeyError("row table full")
        return super().update_and_fetch(k, v)


class FetchCrashes(NoMetaState):
    """Its ``fetch`` crashes once it holds rows: read after the op."""

    def fetch(self) -> Any:
        if self.offset:
            raise KeyError("lost the window")
        return None


@pytest.fixture
def user_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvspec_user_caches", sys.modules[__name__])
    return "kvspec_user_caches"


@pytest.mark.parametrize("via", ["file", "state"])
def test_a_member_the_harness_needs_and_the_class_lacks_is_exit_2(tmp_path, user_module, via):
    """A reload needs ``meta_state`` (and ``from_state``) and the class has
    none: a capability gap, exit 2 not applicable with the sentence, never
    a divergence (before: exit 1, ``raised AttributeError ... (not a
    refusal: a crash)``). Declared by the members it lacks (OP_METHODS),
    so a campaign never generates it; where the harness finds a missing
    member only while running (test_classify_failure_by_origin), the same
    exit 2."""
    code, doc = run_cli(tmp_path, DENSE, [{"op": "append", "n": 2}, {"op": "reload", "via": via}],
                        target=f"{user_module}:NoMetaState")
    assert (code, doc["status"]) == (2, "not applicable"), doc
    assert "op 1 'reload'" in doc["unsupported"] and "meta_state" in doc["unsupported"]


def test_a_crash_in_the_targets_own_code_is_a_divergence(tmp_path, user_module):
    """KeyError raised in the target's own method on an op the spec runs:
    the target's crash, never agreement nor a refusal."""
    code, doc = run_cli(tmp_path, DENSE, [{"op": "append", "n": 3}, {"op": "append", "n": 1}],
                        target=f"{user_module}:CrashesOnFourth")
    assert code == 1, doc
    assert doc["divergence"]["what"] == "refusal differs" and "not a refusal: a crash" in doc["divergence"]["impl"]


def test_a_crash_while_the_target_is_read_is_a_divergence(tmp_path, user_module):
    """A fetch that raises after the op (the target's own code): a
    divergence at that op, not a traceback or a tool failure."""
    code, doc = run_cli(tmp_path, DENSE, [{"op": "append", "n": 1}], target=f"{user_module}:FetchCrashes")
    assert code == 1, doc
    assert doc["divergence"]["what"] == "target crashed while being read after the op"


def test_the_harness_own_crash_is_a_tool_failure(tmp_path, monkeypatch):
    """An exception raised in the harness's code (here the adapter's view,
    broken on purpose) is exit 2, ``tool failure``, never 1."""
    import kvspec.fuzz.adapters.mlx_lm as M

    # the adapter reads its views with a group size mx.dequantize refuses:
    # the ValueError is raised in the adapter's own __array__
    monkeypatch.setattr(M.DequantView, "group_size", property(lambda self: 7, lambda self, v: None), raising=False)
    code, doc = run_cli(tmp_path, INT8, [{"op": "append", "n": 1}])
    assert (code, doc["status"]) == (2, "tool failure"), doc


def test_classify_failure_by_origin():
    """The rule itself: where it was raised, and on what object."""

    class Lock:
        target = None

        def __init__(self, cache: Any) -> None:
            self.cache, self.holders = cache, {}

    user = NoMetaState()
    lock = Lock(user)
    op = {"op": "reload"}
    try:
        user.meta_state  # noqa: B018 - raised here, in a test file: the target's side
    except AttributeError as exc:
        assert classify_failure(lock, 1, op, exc, running=True) is None  # not the harness's frame
    from kvspec.fuzz.protocol import read_observable

    try:
        read_observable(object(), "capacity")  # the harness's frame, on an object that is not the target's
    except AttributeError as exc:
        assert isinstance(classify_failure(lock, 1, op, exc, running=True), HarnessFailure)
    try:
        read_observable(user, "capacity")  # the harness's frame, on the target's cache
    except AttributeError as exc:
        got = classify_failure(lock, 1, op, exc, running=True)
        assert isinstance(got, TargetCannotRun) and got.member == "capacity"
    try:
        raise ValueError("an adapter's translated refusal")
    except ValueError as exc:  # raised here: the target's side; a refusal either way while running
        assert classify_failure(lock, 1, op, exc, running=True) is None
    from kvspec.fuzz.lockstep import Lockstep

    try:
        Lockstep.reloaded(None, user, "state")  # type: ignore[arg-type] - the harness asks for meta_state
    except AttributeError as exc:
        got = classify_failure(lock, 1, op, exc, running=True)
        assert isinstance(got, TargetCannotRun) and got.member == "meta_state"


# -- fuzz and conformance: no verdict is exit 2 ----------------------------------------


def _break_the_adapter(monkeypatch) -> None:
    import kvspec.fuzz.adapters.mlx_lm as M

    monkeypatch.setattr(M.DequantView, "group_size", property(lambda self: 7, lambda self, v: None), raising=False)


def test_fuzz_target_stops_without_a_verdict_on_a_harness_crash(tmp_path, monkeypatch):
    """``kvspec fuzz --target``: a campaign the harness's own crash stopped
    is exit 2 with ``tool failure`` in its row, never 1 and never a
    finding (before: ``FAILED``, exit 1)."""
    _break_the_adapter(monkeypatch)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["fuzz", "--target", "mlx-lm", "--kind", "dense", "--mode", "int8", "--budget", "1",
                     "--seed", "1", "--out", str(tmp_path), "--json"])
    doc = json.loads(out.getvalue())
    assert code == 2, doc
    assert [r["result"] for r in doc["runs"]] == ["tool failure"], doc["runs"]
    assert "the harness raised ValueError" in doc["runs"][0]["failure"]


def test_conformance_stops_without_a_verdict_on_a_harness_crash(tmp_path, monkeypatch):
    """``kvspec conformance``: the class's search ends without a verdict,
    says why, and the run exits 2 (before: a finding with no trace, exit
    1)."""
    _break_the_adapter(monkeypatch)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["conformance", "--class", "QuantizedKVCache", "--budget", "3", "--seed", "1",
                     "--out", str(tmp_path), "--json"])
    doc = json.loads(out.getvalue())
    assert code == 2, doc
    assert doc["no_verdict"]["QuantizedKVCache"].startswith("tool failure: op "), doc["no_verdict"]
    assert doc["classes"][0]["findings"] == []
