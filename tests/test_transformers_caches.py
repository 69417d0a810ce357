"""transformers' StaticCache, sliding-window layer and QuantizedCache
(quanto, HQQ, fp8) as targets (fuzz/adapters/transformers.py,
docs/conformance.md "transformers").

Without PyTorch (the CI case) the recorded search is checked as recorded:
each behaviour the report must hold is there, with its category, and its
minimal trace replays clean on our caches (the traces themselves are
replayed in tests/test_transformers_traces.py). With PyTorch, transformers
and the backends, the search runs on the real classes, bounded by
examples, and must find each behaviour by itself; the declared
differences are checked not to hide a planted fault."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from kvspec.fuzz.commands.conformance import CONTRACT, FAULT
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import load

FOLDER = Path(__file__).parent / "traces" / "conformance" / "transformers"
HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
NO_TORCH = "PyTorch/transformers not installed (optional extra 'transformers'): the recorded report is checked " \
           "and its traces replayed against our caches only"
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason=NO_TORCH)


def _findings(cls: str) -> list[dict]:
    doc = json.loads((FOLDER / "report.json").read_text())
    (c,) = [c for c in doc["classes"] if c["cache_class"] == cls]
    return c["findings"]


def _trace(f: dict) -> Path:
    return FOLDER / Path(f["trace"]).name


def _one(cls: str, what: str, op: str) -> dict:
    got = [f for f in _findings(cls) if f["what"] == what and f["op"]["op"] == op]
    assert got, f"{cls}: no recorded finding '{what}' at a {op} ({[f['summary'] for f in _findings(cls)]})"
    return got[0]


# -- the record (runs everywhere) -----------------------------------------------------------


def test_every_class_is_in_the_recorded_report():
    from kvspec.fuzz.commands.conformance import classes_of

    doc = json.loads((FOLDER / "report.json").read_text())
    run = {c["cache_class"]: c for c in doc["classes"]}
    names = [c.name for c, _ in classes_of("transformers")]
    assert names == ["DynamicCache", "StaticCache", "DynamicSlidingWindowLayer", "QuantoQuantizedLayer",
                     "HQQQuantizedLayer", "Fp8QuantizedLayer"]
    assert set(names) <= set(run)
    assert not doc["no_verdict"] and doc["examples"] is not None, "the recorded run is bounded by examples"


def test_static_update_past_capacity_moves_the_length_a_fault():
    """A StaticCache update past max_cache_len raises IndexError (declared: a
    refusal) but moves the length: a refusal that changes state."""
    f = _one("StaticCache", "offset differs", "append")
    assert f["category"] == FAULT and "IndexError" not in f["what"]
    ops = load(_trace(f)).ops
    assert len([o for o in ops if o["op"] != "expect"]) <= 3


def test_static_update_that_fits_is_refused_once_the_length_is_wrong():
    f = _one("StaticCache", "refusal differs", "append")
    assert "IndexError" in f["summary"] and f["category"] == CONTRACT


def test_quantized_crop_raises_index_error():
    for cls in ("QuantoQuantizedLayer", "HQQQuantizedLayer", "Fp8QuantizedLayer"):
        got = [f for f in _findings(cls) if f["op"]["op"] == "trim" and "IndexError" in f["summary"]]
        assert got, f"{cls}: crop's IndexError not in the report"


def test_fp8_saturates_silently_a_fault():
    f = _one("Fp8QuantizedLayer", "returned window differs", "append")
    assert f["category"] == FAULT


@pytest.mark.parametrize("cls", ["StaticCache", "DynamicSlidingWindowLayer", "QuantoQuantizedLayer",
                                 "HQQQuantizedLayer", "Fp8QuantizedLayer"])
def test_recorded_traces_replay_clean_on_ours(cls):
    for f in _findings(cls):
        assert replay(load(_trace(f)), target=resolve("impl")).ok, f["trace"]


# -- the search on the real classes (PyTorch, transformers, the backends) ---------------------


def _search(cls, target: str, tmp_path, max_findings: int = 1, examples: int = 50):
    from kvspec.fuzz.commands.conformance import search_class

    return search_class(cls, target, math.inf, 20261129, tmp_path, max_findings, batch=examples, steps=20,
                        max_rounds=4)


@needs_torch
def test_search_finds_the_static_length_fault_by_itself(tmp_path):
    from kvspec.fuzz.adapters.transformers import STATIC

    report = _search(STATIC, "transformers-static", tmp_path)
    (f,) = report.findings
    assert (f.what, f.op["op"], f.category, f.confirmed) == ("offset differs", "append", FAULT, True)


@needs_torch
def test_search_finds_the_fp8_saturation_by_itself(tmp_path):
    from kvspec.fuzz.adapters.transformers import FP8

    report = _search(FP8, "transformers-fp8", tmp_path)
    (f,) = report.findings
    assert (f.what, f.category, f.confirmed) == ("returned window differs", FAULT, True)


# -- declared differences never hide a planted fault (PyTorch) ----------------------------------

SLIDING_TRACE = {"kvtrace": 1, "cache": {"kind": "rotating", "mode": "fp16", "max_size": 3, "keep": 0, "step": 2,
                                         "batch": 1, "kv_heads": 1, "head_dim": 8, "inplace": True,
                                         "dtype": "float16"},
                 "ops": [{"op": "append", "n": 1}, {"op": "append", "n": 1}, {"op": "snapshot", "name": "a"},
                         {"op": "append", "n": 1}, {"op": "append", "n": 1}, {"op": "append", "n": 3},
                         {"op": "hold"}, {"op": "append", "n": 1}, {"op": "restore", "name": "a"},
                         {"op": "trim", "n": 1}, {"op": "append", "n": 1}, {"op": "fetch"}]}


def _replay(doc: dict, target, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    return replay(load(path), target=target)


@needs_torch
def test_sliding_retention_agrees_on_a_clean_run(tmp_path):
    target = resolve("transformers-sliding").waiving("trimmable")
    assert _replay(SLIDING_TRACE, target, tmp_path).ok


@needs_torch
@pytest.mark.parametrize("plant", ["keeps sliding_window rows", "returns only the kept rows"])
def test_sliding_retention_does_not_hide_a_planted_fault(tmp_path, monkeypatch, plant):
    import torch
    from transformers.cache_utils import DynamicSlidingWindowLayer

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        keep = self.sliding_window if plant == "keeps sliding_window rows" else self.sliding_window - 1
        self.keys, self.values = full_k[:, :, -keep:, :], full_v[:, :, -keep:, :]
        if plant == "returns only the kept rows":
            return self.keys, self.values
        return full_k, full_v

    monkeypatch.setattr(DynamicSlidingWindowLayer, "update", update)
    target = resolve("transformers-sliding").waiving("trimmable")
    assert not _replay(SLIDING_TRACE, target, tmp_path).ok


@needs_torch
def test_fp8_bound_does_not_hide_saturation(tmp_path):
    """The fp8 window is read within float8_e4m3fn's rounding, which a
    saturated row is far outside: the recorded saturation trace diverges
    there, and a clean fp8 round trip (rows within the first update's
    range) does not."""
    f = _one("Fp8QuantizedLayer", "returned window differs", "append")
    result = replay(load(_trace(f)), target=resolve("transformers-fp8"))
    assert not result.ok and result.divergence.what == "returned window differs"


@needs_torch
def test_fp8_bound_accepts_rows_within_the_first_updates_range(tmp_path):
    """Rows quantized at the scale of their own update round-trip within
    the declared bound: the bound is no blanket pass, and no false alarm."""
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": "fp16", "step": 2, "batch": 1, "kv_heads": 2,
                                   "head_dim": 16, "inplace": True, "dtype": "float16"},
           "ops": [{"op": "append", "n": 6}, {"op": "fetch"}, {"op": "snapshot", "name": "a"}, {"op": "fetch"}]}
    assert _replay(doc, resolve("transformers-fp8"), tmp_path).ok


@needs_torch
def test_static_refused_update_is_not_swallowed(tmp_path):
    """The adapter hands IndexError through: a refused update past
    max_cache_len is a refusal on both sides (declared), and the length it
    moved is the divergence, at that op."""
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": "fp16", "step": 4, "batch": 1, "kv_heads": 1,
                                   "head_dim": 8, "inplace": True, "dtype": "float16"},
           "ops": [{"op": "append", "n": 3}, {"op": "append", "n": 2}, {"op": "append", "n": 1}]}
    result = _replay(doc, resolve("transformers-static"), tmp_path)
    assert not result.ok and (result.divergence.index, result.divergence.what) == (1, "offset differs")
    # transformers 5.25 by hand, through the adapter: the refused update moved
    # the length to 5, so the update that fits (4 of 4 rows) is refused too
    import mlx.core as mx

    from kvspec.fuzz.adapters.transformers import StaticCacheAdapter

    def rows(n):
        return mx.ones((1, 1, n, 8), dtype=mx.float16)

    a = StaticCacheAdapter({"step": 4})
    a.update_and_fetch(rows(3), rows(3))
    with pytest.raises(IndexError):
        a.update_and_fetch(rows(2), rows(2))
    assert a.offset == 5
    with pytest.raises(IndexError):
        a.update_and_fetch(rows(1), rows(1))


@needs_torch
@pytest.mark.skipif(HAVE_TORCH and importlib.util.find_spec("hqq") is None, reason="hqq not installed")
def test_quantized_crop_of_the_residual_keeps_the_length(tmp_path):
    """By hand (the search stops generating positive trims at crop's
    IndexError, so it never reaches this one): with rows in the
    full-precision residual, ``crop(-1)`` takes a row off the residual but
    leaves ``cumulative_length``: the length says one row more than the
    window holds (a fault)."""
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": "fp16", "step": 2, "batch": 1, "kv_heads": 1,
                                   "head_dim": 8, "inplace": True, "dtype": "float16"},
           "ops": [{"op": "append", "n": 1}, {"op": "append", "n": 1}, {"op": "trim", "n": 1}]}
    result = _replay(doc, resolve("transformers-hqq"), tmp_path)
    assert not result.ok and (result.divergence.index, result.divergence.what) == (2, "return value differs")


QUANTIZED_TRACE = {"kvtrace": 1, "cache": {"kind": "dense", "mode": "fp16", "step": 2, "batch": 1, "kv_heads": 2,
                                           "head_dim": 8, "inplace": True, "dtype": "float16"},
                   "ops": [{"op": "append", "n": 3}, {"op": "append", "n": 1}, {"op": "append", "n": 1},
                           {"op": "fetch"}, {"op": "append", "n": 2}, {"op": "fetch"}]}


@needs_torch
@pytest.mark.skipif(HAVE_TORCH and importlib.util.find_spec("hqq") is None, reason="hqq not installed")
@pytest.mark.parametrize("plant", [None, "rows reversed", "residual dropped"])
def test_quantized_bound_does_not_hide_a_planted_fault(tmp_path, monkeypatch, plant):
    """The 4-bit bound reads a clean HQQ window as agreeing, and a window
    whose dequantized rows come back in another order, or without the
    full-precision residual, as differing."""
    import torch
    from transformers.cache_utils import HQQQuantizedLayer

    real = HQQQuantizedLayer._dequantize

    def dequantize(self, q):
        out = real(self, q)
        return torch.flip(out, dims=[-2]) if plant == "rows reversed" else out

    monkeypatch.setattr(HQQQuantizedLayer, "_dequantize", dequantize)
    if plant == "residual dropped":
        real_update = HQQQuantizedLayer.update

        def update(self, k, v, *args, **kwargs):
            keys, values = real_update(self, k, v, *args, **kwargs)
            held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            if held and keys.shape[-2] > held + k.shape[-2]:  # the residual's rows left out of the window
                keep = [i for i in range(keys.shape[-2]) if not keys.shape[-2] - k.shape[-2] - held <= i
                        < keys.shape[-2] - k.shape[-2]]
                return keys[:, :, keep], values[:, :, keep]
            return keys, values

        monkeypatch.setattr(HQQQuantizedLayer, "update", update)
    ok = _replay(QUANTIZED_TRACE, resolve("transformers-hqq"), tmp_path).ok
    assert ok is (plant is None)
