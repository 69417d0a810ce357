"""Recording real decoding (kvspec.fuzz.record) and checking recordings on the spec
alone (kvspec replay --spec-only): mlx-lm's own caches under a server-style
prompt cache are refused at the op that overwrote a saved state; ours pass,
speculative decoding included; a tampered recording is refused at the op
tampered with; bad input exits 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import KVCache as LmKVCache
from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache
from mlx_lm.models.cache import trim_prompt_cache

from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.commands.e2e.models import (
    LATE_LAYER_SCALE,
    early_exit_draft,
    tiny_llama,
    token_ids,
)
from kvspec.fuzz.record import RecordError, record, replay_spec_only
from kvspec.fuzz.trace import parse, schema
from kvspec.impl.dense import KVCache as OurKVCache
from kvspec.impl.models import make_prompt_cache

SCHEMAS = Path(__file__).resolve().parent.parent / "fuzz" / "schemas"


def valid(doc, name):
    """``doc`` follows fuzz/schemas/NAME.schema.json (docs/json.md)."""
    jsonschema.validate(doc, json.loads((SCHEMAS / f"{name}.schema.json").read_text()))
    return doc


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


class Logged:
    """The model, logging how many rows each call feeds every layer."""

    def __init__(self, model):
        self.model, self.calls = model, []

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, inputs, cache=None, **kw):
        self.calls.append(int(inputs.shape[1]))
        return self.model(inputs, cache=cache, **kw)


def generate(model, cache, prompt, n=3):
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)]


def server(model, cache):
    """Request 1 decodes; the server keeps ``[c.state for c in cache]``;
    requests 2 and 3 put it back, trim the last 2 tokens and decode their own."""
    tokens = generate(model, cache, token_ids(1, 8))
    saved = [c.state for c in cache]
    for seed in (2, 3):
        for c, s in zip(cache, saved):
            c.state = s
        trim_prompt_cache(cache, 2)
        tokens += generate(model, cache, token_ids(seed, 3))
    return tokens


def recorded(model, cache, workload):
    with record(cache) as rec:
        out = workload(model, cache)
    return rec, out


def first_append_after_restore_and_trim(ops):
    """The op that writes into a restored state's buffer: the first append
    after the first trim that follows the first state_restore (worked out
    from the ops, not from the verdict)."""
    restore = next(i for i, op in enumerate(ops) if op["op"] == "state_restore")
    trim = next(i for i in range(restore, len(ops)) if ops[i]["op"] == "trim")
    return next(i for i in range(trim, len(ops)) if ops[i]["op"] == "append")


# -- the line: mlx-lm's own caches refused at the aliasing op; ours pass ---------
def test_mlx_lm_server_prompt_cache_refused_at_the_aliasing_op(model, tmp_path, capsys):
    rec, _ = recorded(model, lm_make_prompt_cache(model), server)
    traces = rec.traces()
    assert [i for i, _ in traces] == [0, 1]
    for _, trace in traces:
        result = replay_spec_only(trace)
        assert not result.ok
        aliasing = first_append_after_restore_and_trim(trace.ops)
        assert result.index == aliasing
        assert trace.ops[aliasing]["op"] == "append"
        seen = result.divergence
        assert seen.index == aliasing + 1 and seen.op["op"] == "expect" and seen.op["of"] == "state0"
        # the saved rows the trim gave back were overwritten by the rows this append wrote
        spec, got = list(seen.spec), list(seen.impl)
        assert spec[:-2] == got[:-2] and spec[-2:] != got[-2:]
        assert set(got[-2:]) <= set(trace.ops[aliasing]["returns"])
    rec.write(tmp_path / "lm")
    assert main(["replay", "--spec-only", str(tmp_path / "lm" / "layer00.json")]) == 1
    out = capsys.readouterr().out
    aliasing = first_append_after_restore_and_trim(traces[0][1].ops)
    assert out.startswith("impossible ")
    assert f"\nop {aliasing} " in out and "the window of state 'state0' after this op is impossible" in out
    assert f"seen at op {aliasing + 1} " in out and "spec says:" in out and "recorded:" in out
    assert main(["replay", "--spec-only", "--json", str(tmp_path / "lm" / "layer00.json")]) == 1
    doc = valid(json.loads(capsys.readouterr().out), "replay-spec-only")
    assert doc["exit"] == 1 and doc["status"] == "impossible"
    assert doc["impossible"]["index"] == aliasing and doc["impossible"]["seen_at"]["index"] == aliasing + 1


def test_our_caches_pass_the_same_workload_and_decode_the_same(model, tmp_path, capsys):
    rec, tokens = recorded(model, make_prompt_cache(model), server)
    for _, trace in rec.traces():
        assert [op["op"] for op in trace.ops].count("state_restore") == 2
        result = replay_spec_only(trace)
        assert result.ok, str(result)
    # the recorder changes nothing of the run: the same tokens unrecorded, and
    # the cache objects are of their own class again
    cache = make_prompt_cache(model)
    assert server(model, cache) == tokens
    assert all(type(c) is OurKVCache for c in cache)
    paths = rec.write(tmp_path / "ours")
    assert main(["replay", "--spec-only", str(tmp_path / "ours")]) == 0
    assert "2 recordings: 2 possible, 0 impossible" in capsys.readouterr().out
    # a recording is a kvtrace like any other: the schema takes it, and our
    # implementation replays it in lockstep
    for p in paths:
        jsonschema.validate(json.loads(p.read_text()), schema())
    assert main(["replay", *map(str, paths)]) == 0


def test_speculative_decoding_of_our_caches_passes(model):
    main_model = tiny_llama(0, late_scale=LATE_LAYER_SCALE)
    draft = early_exit_draft(main_model)
    cache = make_prompt_cache(main_model, num_draft_tokens=3) + make_prompt_cache(draft, num_draft_tokens=3)
    with record(cache) as rec:
        for _ in speculative_generate_step(token_ids(0, 12), main_model, draft, num_draft_tokens=3, max_tokens=8,
                                           prompt_cache=cache):
            pass
    traces = rec.traces()
    assert [i for i, _ in traces] == [0, 1, 2]
    trimmed = [op["returns"] for _, t in traces for op in t.ops if op["op"] == "trim"]
    assert any(r > 0 for r in trimmed), "no draft token was rejected: the run trimmed nothing"
    for _, trace in traces:
        assert replay_spec_only(trace).ok


def test_every_model_call_is_one_append_and_windows_name_their_rows(model):
    """The recorder drops no op: each forward call of the model appends its
    rows to every layer, in order; each returned window names the rows
    appended so far, the new ones last."""
    logged = Logged(model)
    cache = lm_make_prompt_cache(model)
    with record(cache) as rec:
        generate(logged, cache, token_ids(5, 9), 4)
        generate(logged, cache, token_ids(6, 4), 2)
    for _, trace in rec.traces():
        appends = [op for op in trace.ops if op["op"] == "append"]
        assert [op["n"] for op in appends] == logged.calls
        total = 0
        for op in appends:
            total += op["n"]
            assert op["returns"] == list(range(total))
        assert trace.ops == appends  # no trims, no states: nothing else


# -- tampering: the check is seen failing at the op tampered with -------------------------
@pytest.fixture(scope="module")
def our_server_trace(model):
    rec, _ = recorded(model, make_prompt_cache(model), server)
    return rec.traces()[0][1]


def tampered(trace, change):
    doc = copy.deepcopy(trace.to_json())
    index = change(doc["ops"])
    return parse(doc), index


def test_a_tampered_row_is_refused_at_its_append(our_server_trace):
    def swap_row(ops):
        i = first_append_after_restore_and_trim(ops)
        ops[i]["returns"][3] = ops[i]["returns"][4]
        return i

    trace, index = tampered(our_server_trace, swap_row)
    result = replay_spec_only(trace)
    assert not result.ok and result.index == index and result.after is None
    assert result.divergence.what == "the returned window is impossible"
    assert list(result.divergence.impl) == trace.ops[index]["returns"]


def test_a_tampered_trim_count_is_refused_at_the_trim(our_server_trace):
    def more_trimmed(ops):
        i = next(i for i, op in enumerate(ops) if op["op"] == "trim")
        ops[i]["returns"] += 1
        return i

    trace, index = tampered(our_server_trace, more_trimmed)
    result = replay_spec_only(trace)
    assert not result.ok and result.index == index
    assert result.divergence.what == "the value trim returned is impossible"


def test_a_tampered_saved_window_is_refused_after_the_op_before_it(our_server_trace):
    def stale(ops):
        i = next(i for i, op in enumerate(ops) if op["op"] == "expect")
        ops[i]["window"][-1] = 0
        return i

    trace, index = tampered(our_server_trace, stale)
    result = replay_spec_only(trace)
    assert not result.ok and result.divergence.index == index and result.index == index - 1
    assert trace.ops[index - 1]["op"] == "state_snapshot"


def test_an_unrecorded_refusal_and_a_refusal_the_spec_does_not_make_are_refused(our_server_trace):
    trace, _ = tampered(our_server_trace, lambda ops: ops.__setitem__(0, {**ops[0], "error": True}) or 0)
    result = replay_spec_only(trace)
    assert not result.ok and result.index == 0 and "recorded as refused" in result.divergence.what
    doc = {"kvtrace": 1, "cache": {"kind": "dense"},
           "ops": [{"op": "append", "n": 2, "returns": [0, 1]}, {"op": "state_restore", "name": "nothing"}]}
    result = replay_spec_only(parse(doc))
    assert not result.ok and result.index == 1 and "recorded as done; the spec refuses it" in result.divergence.what


# -- bad input: one line, exit 2 --------------------------------------------------------------
def test_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1}')
    assert main(["replay", "--spec-only", str(bad)]) == 2
    assert "invalid kvtrace" in capsys.readouterr().out
    paged = tmp_path / "paged.json"
    paged.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "paged", "block_size": 2},
                                 "ops": [{"op": "append", "n": 1}]}))
    assert main(["replay", "--spec-only", str(paged)]) == 2
    assert "--spec-only checks recordings of kinds dense, rotating" in capsys.readouterr().out
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1}]}))
    for flags, said in ((["--target", "mlx-lm"], "--target:"), (["--bug", "x"], "--bug:"),
                        (["--waive", "capacity"], "--waive:")):
        assert main(["replay", "--spec-only", *flags, str(ok)]) == 2
        err = capsys.readouterr().out
        assert err.startswith("error: ") and said in err and "Traceback" not in err
    assert main(["replay", "--spec-only", str(ok)]) == 0
    capsys.readouterr()
    assert main(["replay", "--spec-only", "--json", str(bad), str(ok)]) == 2
    doc = valid(json.loads(capsys.readouterr().out), "replay-spec-only")
    assert doc["counts"] == {"possible": 1, "impossible": 0, "invalid": 1, "tool_failure": 0}
    assert main(["replay", "--spec-only", "--json", "--target", "mlx-lm", str(ok)]) == 2
    valid(json.loads(capsys.readouterr().out), "replay-spec-only")
    assert main(["record", "server", "-o", str(tmp_path / "r"), "--tokens", "0"]) == 2
    assert "--tokens: between 1 and 64" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()
    assert main(["record", "server", "-o", str(tmp_path / "r"), "--tokens", "65", "--json"]) == 2
    valid(json.loads(capsys.readouterr().out), "record")
    assert main(["record", "server", "-o", str(tmp_path / "r"), "--seed", "-1"]) == 2
    assert "--seed: an integer in [0, 2^32), got -1" in capsys.readouterr().out
    assert main(["record", "server", "-o", str(ok)]) == 2
    assert f"--out {ok}: exists and is not a folder" in capsys.readouterr().out
    assert main(["record", "server", "-o", str(ok / "sub")]) == 2
    assert f"cannot create the folder ({ok} is a file)" in capsys.readouterr().out
    assert main(["record", "server", "-o", str(tmp_path / "r"), "--cache", "nosuch.module:Cache"]) == 2
    assert "--cache nosuch.module:Cache: cannot import it (ModuleNotFoundError" in capsys.readouterr().out
    assert main(["record", "server", "-o", str(tmp_path / "r"), "--cache", "json:dumps", "--tokens", "1"]) == 2
    assert "--cache json:dumps: decoding with it raised TypeError" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()  # nothing was written


def test_record_command_takes_any_cache_class_by_module_and_name(tmp_path, capsys):
    """--cache MODULE:ATTR: mlx-lm's KVCache named as a class of any
    package gives the same verdict as --cache mlx-lm."""
    out = tmp_path / "k"
    assert main(["record", "server", "-o", str(out), "--cache", "mlx_lm.models.cache:KVCache", "--tokens", "2"]) == 0
    assert "recorded server on mlx_lm.models.cache:KVCache's caches: 2 layers" in capsys.readouterr().out
    assert main(["replay", "--spec-only", str(out / "layer00.json")]) == 1


def test_record_command_writes_one_trace_per_layer(tmp_path, capsys):
    assert main(["record", "generate", "-o", str(tmp_path / "g"), "--tokens", "1", "--json"]) == 0
    doc = valid(json.loads(capsys.readouterr().out), "record")
    assert sorted(Path(p).name for p in doc["traces"]) == ["layer00.json", "layer01.json"] and not doc["notes"]
    assert main(["replay", "--spec-only", str(tmp_path / "g")]) == 0


def test_record_refuses_what_it_cannot_wrap(model):
    cache = lm_make_prompt_cache(model)
    with pytest.raises(RecordError, match=r"layer 1: object has no update_and_fetch \(not a KV cache\)"):
        record([cache[0], object()]).__enter__()
    assert type(cache[0]) is LmKVCache  # nothing was swapped
    with record(cache), pytest.raises(RecordError, match="already being recorded"):
        record(cache).__enter__()
    assert type(cache[0]) is LmKVCache


def test_a_state_from_elsewhere_stops_the_recording_with_a_note(model):
    cache, other = lm_make_prompt_cache(model), lm_make_prompt_cache(model)
    generate(model, other, token_ids(7, 5))
    with record(cache) as rec:
        generate(model, cache, token_ids(8, 5))
        for c, s in zip(cache, [c.state for c in other]):
            c.state = s
        generate(model, cache, token_ids(9, 2))
    assert any("state assigned from an object the recorder did not see taken" in n for n in rec.notes)
    for _, trace in rec.traces():
        assert "recording stopped at op" in trace.title
        assert replay_spec_only(trace).ok


def test_sliding_window_rings_recorded_as_rotating_traces():
    """gemma3's sliding-window layers are rings (kind rotating, their window
    and sinks from the class); a request that goes on after the state was
    kept, then one from the kept state (state, then meta_state where the
    class has one), passes on both engines' rings."""
    from kvspec.fuzz.commands.e2e.models import tiny_gemma3

    gemma = tiny_gemma3(0, 6)
    for make in (lm_make_prompt_cache, make_prompt_cache):
        cache = make(gemma)
        with record(cache) as rec:
            generate(gemma, cache, token_ids(1, 9))
            saved = [(c.state, getattr(c, "meta_state", None)) for c in cache]
            generate(gemma, cache, token_ids(2, 3))
            for c, (s, m) in zip(cache, saved):
                c.state = s
                if m:
                    c.meta_state = m
            generate(gemma, cache, token_ids(3, 3), 2)
        assert not rec.notes
        traces = rec.traces()
        assert [t.cache["kind"] for _, t in traces] == ["rotating", "rotating", "dense"]
        assert traces[0][1].cache["max_size"] == 6
        for _, trace in traces:
            assert [op["op"] for op in trace.ops].count("state_restore") == 1
            assert replay_spec_only(trace).ok, str(replay_spec_only(trace))


def test_a_ring_put_back_without_its_meta_state_stops_the_recording(tmp_path):
    """Our ring loads a state in two steps; the rows alone are an unwrapped
    ring under other counters, which no kvtrace op says: the recording stops
    there (written even though the block raised)."""
    from kvspec.fuzz.commands.e2e.models import tiny_gemma3

    gemma = tiny_gemma3(0, 6)
    cache = make_prompt_cache(gemma)
    with pytest.raises(RuntimeError, match="the program failed"), record(cache, out=tmp_path / "r") as rec:
        generate(gemma, cache, token_ids(1, 9))
        saved = [c.state for c in cache]
        for c, s in zip(cache, saved):
            c.state = s
        generate(gemma, cache, token_ids(3, 3), 2)
        raise RuntimeError("the program failed")
    assert [n.split(":")[0] for n in rec.notes] == ["layer 0", "layer 1"]
    assert all("without the meta_state taken with it" in n for n in rec.notes)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["layer00.json", "layer01.json", "layer02.json"]
    assert main(["replay", "--spec-only", str(tmp_path / "r")]) == 0


def test_speculative_decoding_on_our_rings_records_their_undo_depth():
    """Our rings built for speculative decoding keep an undo log (depth =
    draft tokens): the recording carries it, so the spec takes back the
    rows a trim after a wrap removes, as the ring did."""
    from kvspec.fuzz.commands.e2e.models import speculative_gemma3

    main_model, draft = speculative_gemma3(0, 6)
    cache = make_prompt_cache(main_model, num_draft_tokens=3) + make_prompt_cache(draft, num_draft_tokens=3)
    with record(cache, layers=[0, 3]) as rec:
        for _ in speculative_generate_step(token_ids(0, 12), main_model, draft, num_draft_tokens=3, max_tokens=12,
                                           prompt_cache=cache):
            pass
    traces = rec.traces()
    assert [(i, t.cache["kind"], t.cache["undo"]) for i, t in traces] == [(0, "rotating", 3), (3, "rotating", 3)]
    for _, trace in traces:
        appended = 0
        wrapped_trims = 0
        for op in trace.ops:
            if op["op"] == "append":
                appended += op["n"]
            elif op["op"] == "trim":
                wrapped_trims += appended > 6 and op["returns"] > 0
                appended -= op["returns"]
        assert wrapped_trims > 0, "no trim after the ring wrapped"
        assert replay_spec_only(trace).ok
        trace.cache["undo"] = 0  # the same ops on a ring without an undo log are impossible
        assert not replay_spec_only(parse(trace.to_json())).ok


def test_the_new_command_and_flag_are_in_help_and_on_the_cli_page():
    from kvspec.fuzz.commands.cli import build_parser

    repo = Path(__file__).resolve().parent.parent
    page = (repo / "docs" / "cli.md").read_text()
    page = page[page.index("## `kvspec record` and `kvspec replay --spec-only`"):]
    page = page[: page.index("\n## ", 3)]  # that section alone
    subs = build_parser().get_default("_subparsers")
    assert "--spec-only" in subs["replay"].format_help() and "`kvspec replay --spec-only" in page
    text = subs["record"].format_help()
    for flag in ("--cache", "--out", "--seed", "--tokens", "--json", "generate", "server", "speculative"):
        assert flag in text and f"`{flag}" in page, flag
    assert "record.md" in (repo / "mkdocs.yml").read_text()


def test_what_no_kvtrace_op_says_stops_the_recording_there():
    """A batch cache's filter (sequences leave the batch) and rows of
    another shape have no kvtrace op: the trace ends before them, with a
    note, and what it holds is still checked."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    def rows(b, n):
        return mx.random.normal((b, 2, n, 8)).astype(mx.float16), mx.random.normal((b, 2, n, 8)).astype(mx.float16)

    batch, plain = BatchKVCache(left_padding=[0, 0]), LmKVCache()
    with record([batch, plain]) as rec:
        batch.update_and_fetch(*rows(2, 3))
        batch.update_and_fetch(*rows(2, 1))
        batch.filter([0])
        batch.update_and_fetch(*rows(1, 1))
        plain.update_and_fetch(*rows(1, 2))
        with pytest.raises(ValueError):  # mlx-lm's own refusal, after the recording stopped
            plain.update_and_fetch(*rows(2, 1))
    assert [n.split(": ", 1)[1] for n in rec.notes] == [
        "recording stopped at op 2: filter() has no kvtrace op (a batch cache keeps some of its sequences)",
        ("recording stopped at op 1: rows of shape (2, 2, 1, 8)/(2, 2, 1, 8) and dtype mlx.core.float16, not the "
         "first rows' (batch, kv_heads, head dims (1, 2, 8, 8), float16): a kvtrace cache keeps one shape")]
    (_, t0), (_, t1) = rec.traces()
    assert [op["n"] for op in t0.ops] == [3, 1] and t0.cache["batch"] == 2
    assert [op["n"] for op in t1.ops] == [2]
    assert replay_spec_only(t0).ok and replay_spec_only(t1).ok


def test_a_state_kept_as_its_arrays_is_still_recognised_when_put_back(model):
    """A program may keep a state's arrays rather than the tuple: the state
    stays tracked while anyone holds them, and putting them back is a
    state_restore of it (mlx-lm refused at the write into them, ours pass)."""
    for make, ok in ((lm_make_prompt_cache, False), (make_prompt_cache, True)):
        cache = make(model)
        with record(cache) as rec:
            generate(model, cache, token_ids(1, 8))
            parts = [list(c.state) for c in cache]  # the tuple itself is dropped
            generate(model, cache, token_ids(2, 2))
            for c, arrays in zip(cache, parts):
                c.state = tuple(arrays)
            trim_prompt_cache(cache, 1)
            generate(model, cache, token_ids(3, 2))
        assert not rec.notes
        for _, trace in rec.traces():
            assert [op["op"] for op in trace.ops].count("state_restore") == 1
            result = replay_spec_only(trace)
            assert result.ok is ok
            if not ok:
                assert result.index == first_append_after_restore_and_trim(trace.ops)
