"""kvspec replay: exit codes 0/1/2, messages, and the shipped traces."""

import json
from pathlib import Path

import pytest

from kvspec.fuzz.bugs import catalog, runnable
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import load

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json"))
# GPU-only entries (kvspec.fuzz.bugs.runnable) diverge only on MLX's CUDA backend: kvspec verify --device gpu
BUGS = {b.name: b for b in catalog() if runnable(b)}


def write(tmp_path, doc, name="t.json"):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_every_bug_kind_has_a_trace():
    names = {p.stem for p in TRACES}
    assert set(BUGS) <= names


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_shipped_traces_replay_clean(path, capsys):
    assert main(["replay", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_traces_diverge_on_their_bug(name):
    result = replay(load(Path(__file__).parent / "traces" / f"{name}.json"), BUGS[name].factories)
    assert not result.ok


def test_a_failing_trace_check_exits_3_and_names_op(tmp_path, capsys):
    """The trace expects what the spec does not do: not a divergence."""
    doc = {"kvtrace": 1, "cache": {"kind": "dense", "step": 4},
           "ops": [{"op": "append", "n": 2}, {"op": "expect", "window": [0, 2]}]}
    assert main(["replay", write(tmp_path, doc)]) == 3
    out = capsys.readouterr().out
    assert out.startswith("trace check failed") and "op 1" in out and "[0, 1]" in out
    assert "trace expects: [0, 2]" in out
    assert main(["replay", "--json", write(tmp_path, doc)]) == 3
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] is False and got["divergence"]["index"] == 1 and got["exit"] == 3
    assert got["divergence"]["kind"] == "trace check"


def test_a_divergence_exits_1_and_names_every_row(capsys):
    """The rows the failing op wrote are named (here the window is short,
    not garbage: tokens 1 and 2, not '?')."""
    path = Path(__file__).parent / "traces" / "prefill_clamps_return.json"
    assert main(["replay", str(path), "--bug", "prefill_clamps_return"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("diverged") and "spec and impl disagree" in out
    assert "impl did:  [1, 2]" in out and "?" not in out
    assert main(["replay", "--json", str(path), "--bug", "prefill_clamps_return"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["divergence"]["kind"] == "divergence" and got["divergence"]["impl"] == [1, 2]


def test_other_targets_are_named_in_the_report(capsys):
    path = Path(__file__).parent / "traces" / "conformance" / "KVCache_01.json"
    assert main(["replay", str(path), "--target", "mlx-lm"]) == 1
    out = capsys.readouterr().out
    assert "spec and mlx-lm disagree" in out and "mlx-lm did: -1" in out and "impl did" not in out


def test_expect_of_an_unknown_name_is_a_trace_error(tmp_path, capsys):
    doc = {"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1},
                                                              {"op": "expect", "of": "nope", "window": [0]}]}
    assert main(["replay", write(tmp_path, doc)]) == 2
    assert "op 1 field 'of': no snapshot or handle named 'nope'" in capsys.readouterr().out


def test_bug_flag_replays_against_injected_bug(capsys):
    path = Path(__file__).parent / "traces" / "steady_state_inplace.json"
    assert main(["replay", str(path), "--bug", "steady_state_inplace"]) == 1
    assert main(["replay", str(path)]) == 0


@pytest.mark.parametrize("doc,needle", [
    ("{not json", "invalid JSON at line 1"),
    ({"kvtrace": 2, "cache": {"kind": "dense"}, "ops": []}, "kvtrace"),
    ({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 1}, {"op": "frobnicate"}]}, "op 1"),
    ({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "trim"}]}, "op 0"),
    ({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": "3"}]}, "op 0 field 'n'"),
    ({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "append", "n": 0}]}, "op 0 field 'n'"),
    ({"kvtrace": 1, "cache": {"kind": "rotating"}, "ops": []}, "max_size"),
    ({"kvtrace": 1, "cache": {"kind": "dense", "step": 0}, "ops": []}, "cache.step"),
    ({"kvtrace": 1, "ops": []}, "cache"),
])
def test_malformed_traces_exit_2(tmp_path, capsys, doc, needle):
    assert main(["replay", write(tmp_path, doc)]) == 2
    out = capsys.readouterr().out
    assert "invalid kvtrace" in out and needle in out


def test_missing_file_exits_2(capsys):
    assert main(["replay", "/nonexistent/trace.json"]) == 2


def test_unimplemented_mode_exits_2(tmp_path, capsys):
    doc = {"kvtrace": 1, "cache": {"kind": "rotating", "mode": "turbo4", "max_size": 4}, "ops": []}
    assert main(["replay", write(tmp_path, doc)]) == 2
    assert "is not one of" in capsys.readouterr().out


def test_turbo_modes_of_the_dense_kind_replay(tmp_path):
    for mode in ("turbo4asym", "turbo4", "turbo3asym", "turbo4delegated"):
        doc = {"kvtrace": 1, "cache": {"kind": "dense", "mode": mode},
               "ops": [{"op": "append", "n": 2}, {"op": "trim", "n": 1, "capacity": 1}]}
        assert main(["replay", write(tmp_path, doc)]) == 0


# -- a folder on a target that cannot run every trace (issue 47) -----------------------
def _folder(tmp_path, *names):
    d = tmp_path / "traces"
    d.mkdir()
    for name in names:
        (d / name).write_text((Path(__file__).parent / "traces" / name).read_text())
    return d


def test_a_folder_counts_not_applicable_apart_and_exits_0(tmp_path, capsys):
    """Traces the target cannot run are said, not failed: nothing diverged,
    exit 0, and the summary counts ok / diverged / not applicable."""
    import jsonschema

    d = _folder(tmp_path, "format_example.json", "dense_name_refusals.json")
    assert main(["replay", str(d), "--target", "mlx-lm"]) == 0
    out = capsys.readouterr().out
    assert "not applicable" in out and "dense_name_refusals.json" in out
    assert out.rstrip().splitlines()[-1] == "2 traces: 1 ok, 0 diverged, 1 not applicable to target mlx-lm"
    xml = tmp_path / "r.xml"
    assert main(["replay", str(d), "--target", "mlx-lm", "--json", "--junit-xml", str(xml)]) == 0
    doc = json.loads(capsys.readouterr().out)
    schema = json.loads((Path(__file__).parent.parent / "fuzz" / "schemas" / "replay.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert doc["ok"] is True and doc["failed"] == 0
    assert doc["counts"]["ok"] == 1 and doc["counts"]["not_applicable"] == 1 and doc["counts"]["diverged"] == 0
    assert [t["status"] for t in doc["traces"]] == ["not applicable", "ok"]
    text = xml.read_text()
    assert 'failures="0"' in text and 'skipped="1"' in text and "<skipped" in text


def test_a_divergence_beside_not_applicable_traces_exits_1(tmp_path, capsys):
    d = _folder(tmp_path, "dense_name_refusals.json", "decode_mask_window_ignores_sinks.json")
    assert main(["replay", str(d), "--target", "mlx-lm"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("0 ok, 1 diverged, 1 not applicable to target mlx-lm")


def test_a_folder_the_target_can_run_none_of_exits_2(tmp_path, capsys):
    d = _folder(tmp_path, "dense_name_refusals.json")
    assert main(["replay", str(d), "--target", "mlx-lm"]) == 2
    out = capsys.readouterr().out
    assert "1 trace: 0 ok, 0 diverged, 1 not applicable" in out and "can run none of these traces" in out


def test_the_harness_failing_is_a_tool_failure_not_a_divergence(tmp_path, capsys, monkeypatch):
    """An exception out of the harness itself is exit 2 and says so; never
    'diverged', never a traceback."""
    import kvspec.fuzz.replay

    def broken(*args, **kwargs):
        raise RuntimeError("lockstep fell over")

    monkeypatch.setattr(kvspec.fuzz.replay, "replay", broken)
    d = _folder(tmp_path, "format_example.json")
    assert main(["replay", str(d)]) == 2
    out = capsys.readouterr().out
    assert "tool failure" in out and "RuntimeError: lockstep fell over" in out and "diverged" not in out.replace(
        "0 diverged", "")
    assert out.rstrip().endswith("1 trace: 0 ok, 0 diverged, 0 not applicable to target impl, 1 tool failure")
    xml = tmp_path / "r.xml"
    assert main(["replay", str(d), "--json", "--junit-xml", str(xml)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts"]["tool_failure"] == 1 and doc["traces"][0]["status"] == "tool failure"
    # JUnit: an <error> (the tool's), not a <failure> (the case's)
    text = xml.read_text()
    assert 'errors="1"' in text and 'failures="0"' in text and "<error" in text and "<failure" not in text
