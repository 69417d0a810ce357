"""llama.cpp as a cells target (fuzz/adapters/llama_cpp.py, docs/conformance.md
"llama.cpp"): the state blob parser and the row naming on hand-made input
(always); the recorded minimal traces under tests/traces/llama_cpp/ replay
against our cell cache always (exit 0) and against llama.cpp wherever
llama-cpp-python is importable (exit 1, at the op the report names); the
adapter's protocol answers and the search itself where it is installed.
Which engines the traces were replayed on is printed (and each skip says
why)."""

import contextlib
import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from kvspec.fuzz.adapters import llama_cpp as lc
from kvspec.fuzz.commands import conformance_cells as cc
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.commands.conformance_cells import category
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import load
from kvspec.spec import cells as sc
from kvspec.spec.errors import InvalidArgumentError, StateError

FOLDER = Path(__file__).parent / "traces" / "llama_cpp"
TRACES = sorted(FOLDER.glob("*_[0-9][0-9].json"))
HAVE_LLAMA = all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "gguf"))
NOT_INSTALLED = ("llama-cpp-python not installed (optional extra 'llama-cpp': pip install -e '.[llama-cpp]'): "
                 "replayed against our cell cache only")
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason=NOT_INSTALLED)
DONE = {"ours": 0, "llama.cpp": 0}


# -- the blob parser and row names (no llama.cpp needed) -----------------------


def _store_record(cells, rows_k, rows_v, v_trans=False, dtype=np.float16):
    """One llama_kv_cache::state_write record (one stream, one layer)."""
    out = struct.pack("<I", 1) + struct.pack("<I", len(cells))
    for pos, seqs in cells:
        out += struct.pack("<iI", pos, len(seqs)) + b"".join(struct.pack("<i", s) for s in seqs)
    code = 1 if dtype == np.float16 else 0
    k = np.asarray(rows_k, dtype)
    v = np.asarray(rows_v, dtype)
    out += struct.pack("<II", 1 if v_trans else 0, 1)
    out += struct.pack("<iQ", code, k.shape[1] * k.itemsize) + k.tobytes()
    if v_trans:
        out += struct.pack("<iII", code, v.itemsize, v.shape[1]) + v.T.copy().tobytes()
    else:
        out += struct.pack("<iQ", code, v.shape[1] * v.itemsize) + v.tobytes()
    return out


@pytest.mark.parametrize("v_trans", [False, True])
def test_parse_memory_reads_cells_positions_sequences_and_rows(v_trans):
    k = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    v = -np.arange(12, dtype=np.float32).reshape(3, 4) / 8
    arch = b"llama"
    blob = struct.pack("<I", len(arch)) + arch + _store_record([(0, [0]), (5, [0, 2]), (7, [1])], k, v, v_trans)
    (cells,) = lc.parse_memory(blob, 1)
    assert [(c.pos, c.seqs) for c in cells] == [(0, {0}), (5, {0, 2}), (7, {1})]
    assert np.array_equal(np.stack([c.k[0] for c in cells]), k)
    assert np.array_equal(np.stack([c.v[0] for c in cells]), v)


def test_parse_refuses_a_truncated_or_padded_blob():
    arch = b"llama"
    blob = struct.pack("<I", len(arch)) + arch + _store_record([(0, [0])], [[1, 2]], [[3, 4]])
    with pytest.raises(StateError, match="truncated"):
        lc.parse_memory(blob[:-1], 1)
    with pytest.raises(StateError, match="bytes left"):
        lc.parse_memory(blob + b"\0", 1)
    seq_blob = struct.pack("<Ii", lc.SEQ_MAGIC, 3) + _store_record([(4, [3])], [[1, 2]], [[3, 4]])
    seq, (cells,) = lc.parse_sequence(seq_blob, 1)
    assert seq == 3 and [(c.pos, c.seqs) for c in cells] == [(4, {3})]
    with pytest.raises(StateError, match="magic"):
        lc.parse_sequence(b"\0" * 8 + seq_blob[8:], 1)


def _rope_table(n_vocab=5, n_pos=16, dim=8):
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 1.5, (n_vocab, dim)) * rng.choice([-1, 1], (n_vocab, dim))
    half = dim // 2
    inv = 10000.0 ** (-np.arange(half) / half)
    k = np.zeros((n_vocab, n_pos, dim), np.float32)
    for p in range(n_pos):
        c, s = np.cos(p * inv), np.sin(p * inv)
        x0, x1 = base[:, 0::2], base[:, 1::2]
        k[:, p, 0::2], k[:, p, 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    v = rng.standard_normal((n_vocab, dim)).astype(np.float32)
    return k, v


def test_rows_are_named_by_token_and_the_position_of_their_rotation():
    k, v = _rope_table()
    table = (k, v)
    good = lc.BlobCell(6, frozenset({0}), [k[3, 6].astype(np.float16).astype(np.float32)], [v[3]])
    assert lc.name_rows(table, good) == ((3, 6), 3)
    # a cell that claims position 9 but holds the K row rotated for 6 (a shift lost)
    stale = lc.BlobCell(9, frozenset({0}), [k[3, 6]], [v[3]])
    assert lc.name_rows(table, stale) == ((3, 6), 3)
    noise = lc.BlobCell(2, frozenset({0}), [k[1, 2] + 0.5], [v[1] + 0.5])
    assert lc.name_rows(table, noise) == (None, None)


def test_the_naming_tolerance_tells_neighbouring_positions_apart():
    """The check behind every K name: a row one step of rotation away is
    far outside the tolerance (else position 6 would pass for 5)."""
    k, _ = _rope_table()
    step = float(np.abs(k[3, 6] - k[3, 5]).max())
    assert step > 10 * lc.K_TOLERANCE * max(1.0, float(np.abs(k[3, 6]).max()))


@needs_llama
def test_the_models_row_tables_tell_every_name_apart():
    """On the models' own tables (float16 rows from llama.cpp): every K row is
    farther than 3x the tolerance from every other (token, position) of the
    first 64 positions, every V row from every other token's."""
    for window in (None, 4):
        t = lc.LlamaCppCells(window=window, n_seq=1)
        for k_tab, v_tab in t.loaded.rows(64).values():
            k = k_tab[:, :64].reshape(-1, k_tab.shape[2])
            scale = max(1.0, float(np.abs(k).max()))
            d = np.abs(k[:, None, :] - k[None, :, :]).max(axis=2) + np.eye(len(k)) * 1e9
            assert d.min() > 3 * lc.K_TOLERANCE * scale
            dv = np.abs(v_tab[:, None, :] - v_tab[None, :, :]).max(axis=2) + np.eye(len(v_tab)) * 1e9
            assert dv.min() > 3 * lc.K_TOLERANCE * scale


def test_a_tiny_model_refuses_an_inconsistent_configuration():
    with pytest.raises(InvalidArgumentError, match="window"):
        lc.TinyModel(arch="gemma2")
    with pytest.raises(InvalidArgumentError, match="arch"):
        lc.TinyModel(arch="mamba")


# -- the recorded traces ------------------------------------------------------


def _report():
    return json.loads((FOLDER / "report.json").read_text())


def _finding(path: Path) -> dict:
    (f,) = [f for c in _report()["classes"] for f in c["findings"] if Path(f["trace"]).name == path.name]
    return f


def test_every_recorded_trace_is_listed_and_classified():
    assert TRACES, "no recorded llama.cpp traces"
    doc = _report()
    listed = {Path(f["trace"]).name for c in doc["classes"] for f in c["findings"]}
    assert listed == {p.name for p in TRACES} and doc["ok"] is True
    for c in doc["classes"]:
        for f in c["findings"]:
            assert f["category"] == category(f["what"]) and f["confirmed"]


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_passes_on_ours(path):
    assert main(["replay", str(path)]) == 0
    DONE["ours"] += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_diverges_on_llama_cpp(path):
    """The regression gate: llama.cpp diverges exactly where the report pins
    it (op index and what differs), in paranoid mode too."""
    if not HAVE_LLAMA:
        pytest.skip(NOT_INSTALLED)
    f = _finding(path)
    result = replay(load(path), target="llama.cpp")
    assert not result.ok and result.divergence.index == f["index"] and result.divergence.what == f["what"]
    doc = json.loads(path.read_text())
    para = cc.first_divergence(doc["cache"], doc["ops"], True, paranoid=True)
    assert para is not None and (para.index, para.what) == (f["index"], f["what"])
    DONE["llama.cpp"] += 1


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_states_the_spec_refusals(path):
    """Every op the spec refuses carries "error": true, and no other does."""
    doc = json.loads(path.read_text())
    assert cc.annotate_refusals(doc["cache"], doc["ops"]) == doc["ops"]


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_trace_is_one_minimal_and_its_culprit_recomputes(path):
    """Removing any one op (op 0 included) loses the recorded divergence
    (same what, op name and culprit class); the culprit op and its class,
    recomputed from the trace, are the recorded ones."""
    if not HAVE_LLAMA:
        pytest.skip(NOT_INSTALLED)
    f = _finding(path)
    doc = json.loads(path.read_text())
    cache, ops = doc["cache"], doc["ops"]
    assert cc.same_divergence(cache, ops, f["what"], f["op"]["op"], f["excluded"]) == f["index"]
    d = cc.first_divergence(cache, ops, True)
    culprit = cc._culprit(ops, d, cc.spec_refused(cache, ops))
    assert culprit == f["culprit"] and cc._class_at(cache, ops, culprit) == f["excluded"]
    for i in range(len(ops)):
        assert cc.same_divergence(cache, ops[:i] + ops[i + 1:], f["what"], f["op"]["op"], f["excluded"]) is None, \
            f"op {i} can be removed"


def test_say_which_engines_the_traces_were_replayed_on(capsys):
    on = (f"and against llama.cpp ({DONE['llama.cpp']})" if DONE["llama.cpp"] else
          "only (llama-cpp-python not installed: optional extra 'llama-cpp')")
    with capsys.disabled():
        print(f"\nkvspec: recorded llama.cpp traces replayed against our cell cache ({DONE['ours']}) {on}")


def test_without_llama_cpp_the_target_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(["replay", str(TRACES[0]), "--target", "llama.cpp", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "not applicable" and "pip install -e '.[llama-cpp]'" in doc["unsupported"]
    assert main(["conformance", "--target", "llama.cpp", "--examples", "1", "--json"]) == 2
    assert "pip install -e '.[llama-cpp]'" in json.loads(capsys.readouterr().out)["error"]


def test_a_trace_llama_cpp_cannot_build_is_not_applicable(tmp_path, capsys):
    if not HAVE_LLAMA:
        pytest.skip(NOT_INSTALLED)
    doc = json.loads(TRACES[0].read_text())
    doc["cache"]["n_cells"] = 16
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["replay", str(path), "--target", "llama.cpp", "--json"]) == 2
    assert "cache.n_cells" in json.loads(capsys.readouterr().out)["unsupported"]


# -- the adapter against llama.cpp ---------------------------------------------


@needs_llama
def test_decode_observe_and_shared_cells():
    t = lc.LlamaCppCells(window=None, n_seq=2)
    assert t.decode((0,), (3, 4, 5), 0) is True
    t.seq_cp(0, 1, 0, None)
    assert t.decode((1,), (6,), 3) is True
    got = sorted(t.observe()["full"], key=lambda c: c[0])
    assert got == [(0, {0, 1}, (3, 0), 3), (1, {0, 1}, (4, 1), 4), (2, {0, 1}, (5, 2), 5), (3, {1}, (6, 3), 6)]
    assert (t.pos_min(1), t.pos_max(1), t.pos_max(0)) == (0, 3, 2)


@needs_llama
def test_observation_applies_a_pending_shift_and_the_update_is_what_does_it(monkeypatch):
    t = lc.LlamaCppCells(window=None, n_seq=1)
    t.decode((0,), (3, 4, 5, 6), 0)
    t.seq_add(0, 2, None, 3)
    assert sorted(t.observe(rows=False)["full"]) == [(0, {0}, None, None), (1, {0}, None, None),
                                                   (5, {0}, None, None), (6, {0}, None, None)]
    with monkeypatch.context() as m:  # the broken variant: no forced update, the rows stay stale
        m.setattr(lc.Context, "update", lambda self, used: None)
        stale = sorted(t.observe()["full"])
    assert stale[2][2] == (5, 2)
    t._shifted = True  # the broken observation believed it had applied the shift
    assert sorted(t.observe()["full"])[2][2] == (5, 5)


@needs_llama
def test_a_save_while_a_shift_is_pending_keeps_the_old_rotation():
    """A save while a shift is pending keeps the unrotated K rows, through the adapter alone."""
    t = lc.LlamaCppCells(window=None, n_seq=1)
    t.decode((0,), (3, 4, 5, 6), 0)
    t.seq_add(0, 2, None, 3)
    snap = t.save(0)
    assert sorted(t.observe_snapshot(snap)["full"]) == [(0, (3, 0), 3), (1, (4, 1), 4), (5, (5, 2), 5), (6, (6, 3), 6)]


@needs_llama
def test_the_window_store_saves_its_live_window_and_drops_out_of_window_cells():
    t = lc.LlamaCppCells(window=4, n_seq=1)
    assert t.stores == ("full", "window")
    t.decode((0,), tuple(range(3, 13)), 0)
    snap = t.observe_snapshot(t.save(0))
    assert [p for p, _, _ in sorted(snap["window"])] == [6, 7, 8, 9] and len(snap["full"]) == 10
    assert t.seq_rm(0, 0, 5) is True
    t.decode((0,), (3,) * 10, 10)
    window = {p for p, _, _, _ in t.observe()["window"]}
    assert {5, 6} - window  # reused while free cells were left: llama.cpp's choice
    assert t.seq_rm(0, 7, None) is True  # a windowed partial removal: the spec refuses it


@needs_llama
def test_arguments_llama_cpp_would_abort_on_are_refused_first():
    t = lc.LlamaCppCells(window=None, n_seq=2)
    t.decode((0,), (3,), 0)
    before = t.observe()
    for call in (lambda: t.seq_rm(2, 0, None), lambda: t.seq_cp(0, 5, 0, None), lambda: t.seq_div(0, 0, None, 0),
                 lambda: t.decode((0,), (3,) * (t.c.n_ubatch + 1), 1), lambda: t.pos_max(9)):
        with pytest.raises(InvalidArgumentError):
            call()
    with pytest.raises(InvalidArgumentError, match="-1"):
        t.decode((0,), (3,), 5)  # not pos_max + 1: llama_decode's -1
    with pytest.raises(InvalidArgumentError, match="-1"):
        t.decode((0,), (99,), 1)  # a token outside the vocabulary
    assert t.observe() == before


@needs_llama
def test_no_slot_is_false_and_changes_nothing():
    t = lc.LlamaCppCells(window=None, n_seq=2)
    assert t.decode((0,), (3,) * 200, 0) is True
    before = t.observe()
    assert t.decode((1,), (4,) * 100, 0) is False
    assert t.observe() == before


@needs_llama
def test_the_search_finds_the_windowed_removal_by_itself(tmp_path, capsys):
    import jsonschema

    code = main(["conformance", "--target", "llama.cpp", "--class", "llama_kv_cache_iswa", "--examples", "10",
                 "--steps", "30", "--seed", "5", "--max-findings", "3", "--out", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    schema = json.loads((Path(__file__).parent.parent / "fuzz" / "schemas" / "conformance.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert code == 0 and doc["ok"] and doc["budget"] == 10 and doc["budget_unit"] == "examples per round"
    found = {f["excluded"]: f for c in doc["classes"] for f in c["findings"]}
    assert "seq_rm partial" in found and found["seq_rm partial"]["confirmed"]
    assert found["seq_rm partial"]["what"] == "return value differs"
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True
    assert main(["conformance", "--target", "llama.cpp", "--class", "NoSuchMemory", "--json"]) == 2
    assert "llama_kv_cache_iswa" in json.loads(capsys.readouterr().out)["error"]


@needs_llama
def test_the_harness_campaign_plugs_llama_cpp_in():
    """kvspec.fuzz.cells_runs.cells_campaign (the kind's own machine, no rounds)
    drives the same target: on the iSWA layout it diverges, and its minimal
    trace replays 1 on llama.cpp and 0 on ours through replay_cells."""
    from kvspec.fuzz.cells_runs import cells_campaign, replay_cells

    cache = {"stores": ["full", "window"], "window": 4, "n_seq": 3}
    cache.update(lc.cache_sizes(cache))
    r = cells_campaign(lc.target_factory, cache=cache, max_examples=50, seed=1)
    assert r.status == "diverged" and r.trace is not None
    assert not replay_cells(r.trace, lc.target_factory).ok
    assert replay_cells(r.trace).ok


def test_examples_and_steps_belong_to_the_llama_cpp_search(capsys):
    # mlx-lm's search takes --examples too (a bound by examples), but never beside --budget seconds
    assert main(["conformance", "--examples", "5", "--budget", "3", "--json"]) == 2
    assert "--budget" in json.loads(capsys.readouterr().out)["error"]


@needs_llama
def test_store_sizes_are_read_from_llama_cpp(monkeypatch):
    """The gemma2 model's window store is smaller than its full store, as
    llama.cpp sizes it (n_swa * n_seq_max + n_ubatch, padded to 256); the
    sizes come from llama.cpp's own report, and a trace must carry them."""
    assert lc.memory_sizes(None, 3) == {"full": 256}
    assert lc.memory_sizes(4, 3) == {"full": 512, "window": 256}
    assert lc.cache_sizes({"stores": ["full", "window"], "window": 4, "n_seq": 3}) == {"n_cells": 512,
                                                                                         "window_cells": 256}
    t = lc.LlamaCppCells(window=4, n_seq=3)
    assert t.sizes == {"full": 512, "window": 256} and t.n_cells == 512
    for bad in ({"n_cells": 512}, {"n_cells": 512, "window_cells": 512}, {"n_cells": 256, "window_cells": 256}):
        with pytest.raises(InvalidArgumentError, match="cache.n_cells|cache.window_cells"):
            lc.target_factory({"stores": ["full", "window"], "window": 4, "n_seq": 3, **bad})
    with monkeypatch.context() as m:  # the broken variant: nothing logged, no size read
        m.setattr(lc, "_captured_log", lambda: contextlib.nullcontext([]))
        with pytest.raises(StateError, match="KV cache sizes"):
            lc.LlamaCppCells(window=4, n_seq=2)


@needs_llama
def test_the_window_store_reuses_cells_while_the_full_store_has_room():
    """With 256 window and 512 full cells, decodes past 256 positions reuse
    out-of-window cells of the window store (the spec's droppable cells):
    the lockstep agrees, adopting llama.cpp's choice where it differs."""
    from kvspec.fuzz.cells import CellsLockstep

    cache = {"kind": "cells", "stores": ["full", "window"], "window": 4, "n_seq": 2, "kv_heads": 2,
             "head_dim": 16, "dtype": "float16"}
    cache.update(lc.cache_sizes(cache))
    lock = CellsLockstep(cache, {"target": lc.target_factory})
    for k in range(5):
        lock.step(k, {"op": "decode", "seqs": [0], "tokens": [3 + (j % 20) for j in range(60)], "pos0": 60 * k})
    got = lock.target.observe(rows=False)
    assert len(got["full"]) == 300 and len(got["window"]) == 256
    assert lock.stats["windowed cells reused"] == 1 and len(sc.lost(lock.world.memory, 0)) == 44


@needs_llama
def test_a_restore_reusing_out_of_window_cells_is_no_longer_a_divergence():
    """The earlier recorded finding llama_kv_cache_iswa_01 (a restore reuses
    another sequence's out-of-window window cell, as find_slot does at a
    decode) was a spec gap: the spec now grants that reuse at restore, so
    the trace agrees with llama.cpp (sizes as llama.cpp builds them)."""
    cache = {"kind": "cells", "window": 4, "stores": ["full", "window"], "n_seq": 3, "kv_heads": 2,
             "head_dim": 16, "dtype": "float16"}
    cache.update(lc.cache_sizes(cache))
    ops = [{"op": "decode", "seqs": [1], "tokens": [23, 14, 21, 7, 13, 4, 13, 11, 10, 12, 14, 12, 9, 23, 6, 5],
            "pos0": 0},
           {"op": "seq_add", "seq": 2, "p0": 1, "p1": None, "delta": -1},
           {"op": "decode", "seqs": [0], "tokens": [23], "pos0": 0},
           {"op": "save", "seq": 0, "name": "s1"},
           {"op": "restore", "name": "s1", "seq": 2}]
    from kvspec.fuzz.cells import CellsLockstep

    lock = CellsLockstep(cache, {"target": lc.target_factory})
    for i, op in enumerate(ops):
        lock.step(i, op)


def test_the_kept_iswa_seq_div_sign_trace_diverges_on_llama_cpp_only():
    """The seq_div sign fault on the iSWA memory, kept beside the search's
    traces (the recorded search's budget did not reach it there)."""
    path = FOLDER / "llama_kv_cache_iswa_seq_div_sign.json"
    assert main(["replay", str(path)]) == 0
    if not HAVE_LLAMA:
        pytest.skip(NOT_INSTALLED)
    result = replay(load(path), target="llama.cpp")
    assert not result.ok and result.divergence.index == 3 and "rows differ" in result.divergence.what


# -- the tool's failure is never a finding ------------------------------------


class _Recorder:
    """The llama_cpp module, its memory and decode calls recorded."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        f = getattr(self.lib, name)
        if not (name.startswith("llama_memory_seq") or name == "llama_decode"):
            return f

        def call(*args):
            self.calls.append((name, args[1:] if name != "llama_decode" else (args[1].n_tokens,)))
            return f(*args)
        return call


EDGE_OPS = [  # (op, the llama.cpp call it must make): arguments the spec accepts
    ({"op": "seq_rm", "seq": -1, "p0": 5, "p1": None}, ("llama_memory_seq_rm", (-1, 5, -1))),
    ({"op": "seq_rm", "seq": 0, "p0": -3, "p1": None}, ("llama_memory_seq_rm", (0, -3, -1))),
    ({"op": "seq_rm", "seq": 1, "p0": 0, "p1": -1}, ("llama_memory_seq_rm", (1, 0, -1))),
    ({"op": "seq_add", "seq": 0, "p0": 2, "p1": None, "delta": 0}, ("llama_memory_seq_add", (0, 2, -1, 0))),
    ({"op": "seq_add", "seq": 0, "p0": -4, "p1": None, "delta": 2}, ("llama_memory_seq_add", (0, -4, -1, 2))),
    ({"op": "seq_div", "seq": 0, "p0": 0, "p1": None, "d": 1}, ("llama_memory_seq_div", (0, 0, -1, 1))),
    ({"op": "seq_cp", "src": 0, "dst": 1, "p0": -1, "p1": None}, ("llama_memory_seq_cp", (0, 1, -1, -1))),
    ({"op": "seq_keep", "seq": 1}, ("llama_memory_seq_keep", (1,))),
    ({"op": "pos_max", "seq": 1}, ("llama_memory_seq_pos_max", (1,))),
    ({"op": "decode", "seqs": [1], "tokens": [5] * 200, "pos0": 0}, ("llama_decode", (200,))),
]


@needs_llama
@pytest.mark.parametrize("op,call", EDGE_OPS, ids=[f"{o['op']}-{i}" for i, (o, _) in enumerate(EDGE_OPS)])
def test_edge_arguments_the_spec_accepts_reach_llama_cpp(op, call):
    """Every edge argument the spec accepts (seq -1 of seq_rm, p1 None or
    < 0, p0 < 0, delta 0, d == 1, a group of the most tokens one call takes)
    is passed to llama.cpp as it is: the ctypes call is made, and the
    adapter refused nothing itself."""
    from kvspec.fuzz.cells import CellsWorld, _spec_run, spec_memory

    cache = {"kind": "cells", "stores": ["full"], "window": None, "n_seq": 2, "n_cells": 256}
    world = CellsWorld(spec_memory(cache))
    _, world = _spec_run(world, {"op": "decode", "seqs": [0], "tokens": [3, 4, 5, 6], "pos0": 0})
    _spec_run(world, op)  # the spec accepts it (raises otherwise)
    t = lc.LlamaCppCells(window=None, n_seq=2)
    t.decode((0,), (3, 4, 5, 6), 0)
    rec = _Recorder(t.lib)
    t.lib = t.c.lib = rec
    args = {"seq_rm": ("seq", "p0", "p1"), "seq_add": ("seq", "p0", "p1", "delta"), "seq_div": ("seq", "p0", "p1", "d"),
            "seq_cp": ("src", "dst", "p0", "p1"), "seq_keep": ("seq",), "pos_max": ("seq",),
            "decode": ("seqs", "tokens", "pos0")}[op["op"]]
    getattr(t, op["op"])(*(op[a] for a in args))
    assert call in rec.calls and t.refused_first is None


@needs_llama
def test_exactly_n_ubatch_tokens_reach_llama_cpp_and_one_more_is_the_targets_limit(tmp_path, capsys):
    t = lc.LlamaCppCells(window=None, n_seq=1)
    assert t.decode((0,), (3,) * t.c.n_ubatch, 0) is True and t.refused_first is None
    cache = {"kind": "cells", "stores": ["full"], "window": None, "n_seq": 1, "n_cells": 256, **lc.MODEL_FIELDS}
    for ops, field in (([{"op": "decode", "seqs": [0], "tokens": [3] * 257, "pos0": 0}], "op 0 field 'tokens'"),
                       ([{"op": "decode", "seqs": [0], "tokens": [3], "pos0": 0},
                         {"op": "decode", "seqs": [0], "tokens": [30], "pos0": 1}], "op 1 field 'tokens'")):
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"kvtrace": 1, "cache": cache, "ops": ops}))
        assert main(["replay", str(path), "--target", "llama.cpp", "--json"]) == 2
        out = json.loads(capsys.readouterr().out)
        assert out["status"] == "not applicable" and field in out["unsupported"]


@needs_llama
@pytest.mark.parametrize("name,value", [("dtype", "float32"), ("kv_heads", 4), ("head_dim", 8)])
def test_model_fields_the_target_cannot_take_are_not_applicable(name, value, tmp_path, capsys):
    """dtype, kv_heads and head_dim are the models' (2 KV heads of 16, a
    float16 cache): another value is not applicable (exit 2, naming the
    field), not silently ignored."""
    doc = json.loads(TRACES[0].read_text())
    doc["cache"][name] = value
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["replay", str(path), "--target", "llama.cpp", "--json"]) == 2
    assert f"cache.{name}" in json.loads(capsys.readouterr().out)["unsupported"]


@needs_llama
@pytest.mark.parametrize("window", [None, 4])
def test_decodes_past_the_first_256_positions_are_named(window):
    """The row table grows past 256 positions: rows at 255, 256, 300 and
    600 are named by their own (token, position)."""
    for p in (255, 256, 300, 600):
        t = lc.LlamaCppCells(window=window, n_seq=1)
        assert t.decode((0,), (5, 6), p) is True
        for store, cells in t.observe().items():
            assert sorted(cells) == [(p, {0}, (5, p), 5), (p + 1, {0}, (6, p + 1), 6)], (store, p)
        t.close()


@needs_llama
def test_a_refusal_of_the_adapter_on_an_op_the_spec_accepts_is_a_harness_failure(monkeypatch):
    """The broken variant: an adapter whose own limit refuses a 3-token
    decode the spec accepts. That is the harness's failure, never a finding."""
    real = lc.LlamaCppCells.decode

    def small(self, seqs, tokens, pos0):
        self.c.n_ubatch = 2
        return real(self, seqs, tokens, pos0)

    monkeypatch.setattr(lc.LlamaCppCells, "decode", small)
    cache = {"kind": "cells", "stores": ["full"], "window": None, "n_seq": 1, "n_cells": 256, **lc.MODEL_FIELDS}
    with pytest.raises(cc.HarnessFailure, match="adapter refused"):
        cc.first_divergence(cache, [{"op": "decode", "seqs": [0], "tokens": [3, 4, 5], "pos0": 0}], True)
    # both refusing (the spec too: seq 5 is out of range) is no failure of anyone
    assert cc.first_divergence(cache, [{"op": "decode", "seqs": [5], "tokens": [3], "pos0": 0}], True) is None


SHIFT_THEN_READ = [{"op": "decode", "seqs": [0], "tokens": [3, 4, 5, 6], "pos0": 0},
                   {"op": "seq_rm", "seq": 0, "p0": 1, "p1": 2},
                   {"op": "seq_add", "seq": 0, "p0": 2, "p1": None, "delta": -1},
                   {"op": "pos_max", "seq": 0}]


@needs_llama
@pytest.mark.parametrize("broken", ["shift never seen", "refused decode taken as an update"])
def test_a_divergence_the_paranoid_mode_loses_is_not_confirmed(broken, monkeypatch, tmp_path):
    """Broken variants of the adapter's pending-shift bookkeeping: a shift it
    does not note, or a decode refused before llama.cpp's memory update
    taken to have applied it. Its rows read stale: a divergence in normal
    mode, none in paranoid mode (every read forces the update), so the
    finding is not confirmed: ok false, exit 1."""
    cache = {"kind": "cells", "stores": ["full"], "window": None, "n_seq": 1, "n_cells": 256, **lc.MODEL_FIELDS}
    ops = list(SHIFT_THEN_READ)
    if broken == "shift never seen":
        real = lc.LlamaCppCells.seq_add

        def seq_add(self, *a):
            real(self, *a)
            self._shifted = False
        monkeypatch.setattr(lc.LlamaCppCells, "seq_add", seq_add)
    else:
        real = lc.LlamaCppCells.decode

        def decode(self, seqs, tokens, pos0):
            try:
                return real(self, seqs, tokens, pos0)
            finally:
                self._shifted = False
        monkeypatch.setattr(lc.LlamaCppCells, "decode", decode)
        ops[3:3] = [{"op": "decode", "seqs": [0], "tokens": [3], "pos0": 9, "error": True}]
    assert cc.first_divergence(cache, ops, True) is not None
    assert cc.first_divergence(cache, ops, True, paranoid=True) is None
    d = cc.first_divergence(cache, ops, True)
    finding = cc._record("llama_kv_cache", cache, ops, d.what, "seq_add guarded", 1, tmp_path, 1)
    assert (finding.on_target, finding.on_impl, finding.on_paranoid) == (1, 0, 0) and not finding.confirmed
    report = cc.CellsClassReport("llama_kv_cache", findings=[finding])
    doc = cc.to_json([report], 1, 1, 1)
    assert doc["ok"] is False and doc["exit"] == 1 and doc["classes"][0]["findings"][0]["confirmed"] is False
    # the unbroken adapter: no divergence at all
    monkeypatch.undo()
    assert cc.first_divergence(cache, ops, True) is None


def test_a_report_with_an_unconfirmed_finding_is_not_ok():
    finding = cc.CellsFinding("llama_kv_cache", 2, {"op": "pos_max"}, "full store differs", "s", "t.json",
                              "restore", 1, on_target=1, on_impl=0, culprit=2, on_paranoid=0)
    good = cc.CellsFinding("llama_kv_cache", 2, {"op": "pos_max"}, "full store differs", "s", "t.json",
                           "restore", 1, on_target=1, on_impl=0, culprit=2, on_paranoid=1)
    assert cc.to_json([cc.CellsClassReport("llama_kv_cache", findings=[good])], 1, 1, 1)["exit"] == 0
    doc = cc.to_json([cc.CellsClassReport("llama_kv_cache", findings=[good, finding])], 1, 1, 1)
    assert doc["ok"] is False and doc["exit"] == 1


def test_an_earlier_runs_findings_are_cleared_first(tmp_path):
    for name in ("llama_kv_cache_01.json", "llama_kv_cache_iswa_03.json", "report.json", "kept.json"):
        (tmp_path / name).write_text("{}")
    assert cc.clear_findings(tmp_path) == ["llama_kv_cache_01.json", "llama_kv_cache_iswa_03.json", "report.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]


@pytest.mark.parametrize("option", [["--budget", "5"], ["--sarif", "x.sarif"]])
def test_options_of_the_seconds_budgeted_search_do_not_apply_to_llama_cpp(option, capsys):
    assert main(["conformance", "--target", "llama.cpp", *option, "--json"]) == 2
    assert f"{option[0]}: does not apply to --target llama.cpp" in json.loads(capsys.readouterr().out)["error"]
