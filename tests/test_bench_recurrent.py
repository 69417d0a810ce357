"""``kvspec bench --recurrent`` (issue 48): one tiny run through the CLI
writes a record whose structure is checked (never its timings); the
checkpoint ring's bytes are exact; a rollback the caches refuse stops the
bench (a tool failure, not a figure); the options it does not take are
refused with exit 2."""

import json

import mlx.core as mx
import pytest

from kvspec.fuzz.commands import bench_recurrent as br
from tests.test_reports import valid


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """One smoke run: ``kvspec bench --recurrent --recurrent-size tiny``
    at two contexts, 6 rounds (the least with a 95 % interval), 6 end-to-end
    blocks of 4 tokens, written as a record; the JSON printed too."""
    import contextlib
    import io

    from kvspec.fuzz.commands.cli import main

    out = tmp_path_factory.mktemp("record")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["bench", "--recurrent", "--recurrent-size", "tiny", "--contexts", "16", "48", "--rounds", "6",
                     "--e2e-contexts", "16", "--tokens", "4", "--repeats", "6", "--json", "--record", str(out)])
    assert code == 0
    return json.loads(buf.getvalue()), out


def test_the_smoke_run_gives_every_row_with_its_interval(record):
    doc, _ = record
    valid("bench", doc)
    assert doc["bench"] == "recurrent" and doc["size"] == "tiny" and doc["contexts"] == [16, 48]
    assert set(doc["families"]) == {"qwen3_next", "lfm2"}
    for family, fam in doc["families"].items():
        assert fam["recurrent_layers"] >= 1 and fam["layers"] > fam["recurrent_layers"], family
        assert set(fam["rows"]) == {"16", "48"}
        for n, by_k in fam["rows"].items():
            assert set(by_k) == {str(k) for k in br.KS}
            for k, r in by_k.items():
                assert set(r["rollback_ms"]) == {str(m) for m in range(1, int(k) + 1)}, (family, n, k)
                cells = [r["verify_recorder_on_ms"], r["verify_recorder_off_ms"], r["plain_decode_ms"],
                         r["on_over_off"], r["on_over_plain"], *r["rollback_ms"].values()]
                for c in cells:
                    assert c["runs"] == 6 and c["median"] > 0
                    assert c["ci_low"] <= c["median"] <= c["ci_high"]


def test_the_ring_holds_k_checkpoints_beside_the_live_arrays(record):
    """After a verify block of k + 1 tokens on depth-k caches the coverage
    is k and the ring holds, per recurrent layer, k sets of arrays besides
    the live ones: exactly k times the layer's own bytes."""
    doc, _ = record
    for family, fam in doc["families"].items():
        for k, m in fam["memory"].items():
            assert len(m["per_layer"]) == fam["recurrent_layers"]
            for layer in m["per_layer"]:
                assert layer["coverage"] == int(k)
                assert layer["checkpoint_bytes"] == int(k) * layer["live_bytes"] > 0, (family, k, layer)
            assert m["checkpoint_bytes_total"] == sum(x["checkpoint_bytes"] for x in m["per_layer"])
            assert set(m["cache_list_bytes_by_context"]) == {"16", "48"}


def test_the_end_to_end_rows_pair_every_config_with_mlx_lm_greedy(record):
    import statistics

    doc, _ = record
    e = doc["e2e"]
    names = {br.BASE, "ours, greedy", "ours, speculative, draft = target", "ours, speculative, random draft"}
    assert set(e["rows"]) == names and set(e["paired"]) == names - {br.BASE}
    for name, by in e["rows"].items():
        assert by["16"] == statistics.median(e["samples"][name]["16"]) and len(e["samples"][name]["16"]) == 6
    # the draft that is the target has every draft accepted (k of every k + 1 tokens);
    # the random one nearly none: its rounds roll back
    assert e["acceptance"]["ours, speculative, draft = target"]["16"] == pytest.approx(e["k"] / (e["k"] + 1), abs=0.1)
    assert e["acceptance"]["ours, speculative, random draft"]["16"] < 0.5


def test_the_record_is_written_as_json_and_markdown(record):
    doc, out = record
    stem = out / f"{doc['date']}-cpu-recurrent-rollback"
    assert json.loads(stem.with_suffix(".json").read_text()) == doc
    md = stem.with_suffix(".md").read_text()
    for heading in ("## qwen3_next: one speculative round", "## lfm2: one speculative round",
                    "checkpoint ring's memory", "## End to end, qwen3_next"):
        assert heading in md


def test_a_refused_rollback_stops_the_bench():
    """Caches of depth 0 cannot roll back: the rollback tick raises
    RuntimeError instead of timing a trim that did nothing."""
    model = br.build_model("lfm2", "tiny", 0, mx.float32)
    caches = br.filled_caches(model, "lfm2", "tiny", 8, 0, mx.float32)
    tick = br.rollback_tick(model, caches, br._tokens(3, model.args.vocab_size), 1)
    with pytest.warns(Warning), pytest.raises(RuntimeError, match="refused the rollback"):
        tick()


@pytest.mark.parametrize("argv, says", [
    (["--recurrent", "--decoder"], "--recurrent: "),
    (["--recurrent", "--e2e-size", "tiny"], "--e2e-size"),
    (["--recurrent-size", "tiny"], "--recurrent-size: an option of --recurrent"),
    (["--harness", "--recurrent"], "--recurrent"),
])
def test_options_it_does_not_take_exit_2(capsys, monkeypatch, argv, says):
    from kvspec.fuzz.commands.cli import main

    def never(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(br, "run", never)
    assert main(["bench", *argv]) == 2
    assert says in capsys.readouterr().out
