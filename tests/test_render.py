"""kvspec render: every shipped trace draws; a bug's trace draws its first
divergence with the rule it broke and the spec function stating it."""

import importlib
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fuzz.bugs import catalog, runnable
from fuzz.commands.cli import main
from fuzz.render import page, rule_for, svg, timeline
from fuzz.trace import load

HERE = Path(__file__).parent
TRACES = sorted(p for p in (HERE / "traces").rglob("*.json") if "\"kvtrace\"" in p.read_text()[:200])
BUGS = {b.name: b for b in catalog() if runnable(b)}
NS = "{http://www.w3.org/2000/svg}"
SEMANTICS = (HERE.parent / "docs" / "semantics.md").read_text()


def columns(doc: str) -> list[ET.Element]:
    root = ET.fromstring(doc.split("?>", 1)[1])
    return [g for g in root.iter(f"{NS}g") if "opcol" in g.get("class", "")]


@pytest.mark.parametrize("path", TRACES, ids=[str(p.relative_to(HERE / "traces")) for p in TRACES])
def test_every_shipped_trace_draws(path):
    """One column per op, every window the spec holds drawn as a row, and
    no divergence on the real implementation."""
    trace = load(path)
    tl = timeline(trace)
    doc = svg(tl)
    cols = columns(doc)
    assert [int(c.get("data-op")) for c in cols] == list(range(len(trace.ops)))
    assert tl.divergence is None and "data-diverged" not in doc
    # every frame draws the live window or a sequence's view, and a store
    for f in tl.frames:
        assert any(r.group == "view" for r in f.rows) and any(r.group == "store" for r in f.rows), f.index
    # the rows drawn are the spec's windows: the last frame's live window
    # (or main sequence, or layer 0) holds what the spec's fetch returns
    last = tl.frames[-1]
    first_view = next(r for r in last.rows if r.group == "view")
    assert all(c.text.isdigit() for c in first_view.cells)


@pytest.mark.parametrize("path", TRACES, ids=[str(p.relative_to(HERE / "traces")) for p in TRACES])
def test_the_picture_is_the_spec_state_op_by_op(path):
    """Independently of the renderer: after every op, the windows drawn are
    exactly the spec's windows (names and token identities); an append's
    badge agrees with the trace's own ``inplace`` check and the counters
    with its ``capacity`` check, where the trace carries them."""
    from fuzz.replay import make_lockstep

    trace = load(path)
    tl = timeline(trace)
    lock = make_lockstep(trace.cache)
    for i, (op, frame) in enumerate(zip(trace.ops, tl.frames)):
        lock.step(i, op)
        views = {r.note: [c.text for c in r.cells] for r in frame.rows if r.group == "view"}
        assert views == {n: [str(t) for t in toks] for n, toks in lock.spec_views().items()}, (i, op)
        badges = [b for b, _ in frame.badges]
        if op["op"] == "append" and "inplace" in op and not op.get("error"):
            assert ("in place" if op["inplace"] else "copy") in badges, (i, op, badges)
        if "capacity" in op:
            assert frame.observables.get("capacity") == op["capacity"], (i, op)
        if op.get("error") is True:
            assert "refused" in badges, (i, op, badges)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_a_bug_trace_draws_its_divergence_and_rule(name):
    trace = load(HERE / "traces" / f"{name}.json")
    tl = timeline(trace, BUGS[name].factories, name)
    d, rule = tl.divergence, tl.rule
    assert d is not None and rule is not None
    from fuzz.replay import replay

    # the same divergence replay reports, at the same op
    got = replay(trace, BUGS[name].factories).divergence
    assert got is not None and (got.index, got.what) == (d.index, d.what)
    doc = svg(tl)
    cols = columns(doc)
    flagged = [c for c in cols if c.get("data-diverged") == "true"]
    assert [int(c.get("data-op")) for c in flagged] == [d.index]
    # ops after the divergence are listed, not run
    assert len(cols) == len(trace.ops)
    # the rule's spec function exists and the section it cites is on the page
    module, _, fn = rule.function.rpartition(".")
    assert callable(getattr(importlib.import_module(module), fn))
    assert re.search(rf"^## {rule.section}\. ", SEMANTICS, re.MULTILINE), rule.cite()
    text = " ".join(ET.fromstring(doc.split("?>", 1)[1]).itertext())
    assert rule.function in text and " ".join(d.what.split()[:2]) in text
    html = page(tl, name)
    assert 'id="divergence"' in html and rule.function in html


def test_rules_name_the_ownership_rule_for_write_path_divergences():
    from spec import dense, rotating

    ring = rotating.RotatingWorld(rotating.new_cache(2, 0, 1))
    full = rotating.RotatingWorld(rotating.RotatingCache(max_size=2, offset=2, idx=2))
    op = {"op": "append", "n": 1}
    assert rule_for("spec.rotating", op, "in-place decision differs", ring).name == "warm-up in place"
    assert rule_for("spec.rotating", op, "in-place decision differs", full).function == \
        "spec.rotating.rotating_inplace_allowed"
    assert rule_for("spec.dense", op, "view of held changed (isolation)").function == \
        "spec.dense.inplace_write_allowed"
    assert rule_for("spec.dense", {"op": "trim_front", "n": 1}, "offset differs").function == \
        "spec.dense.trim_front_keep_sink"
    assert rule_for("spec.rotating", {"op": "append", "n": 3}, "returned window differs").function == \
        "spec.rotating.prefill"
    assert dense and rule_for("spec.paged", {"op": "fork", "as": "b"}, "refcounts differs").function == \
        "spec.paged.fork"


def test_cli_render_writes_svg_and_html(tmp_path, capsys):
    src = HERE / "traces" / "steady_state_inplace.json"
    out = tmp_path / "t.svg"
    assert main(["render", str(src), "-o", str(out), "--bug", "steady_state_inplace"]) == 0
    said = capsys.readouterr().out
    assert "first divergence at op 2" in said and "rotating_inplace_allowed" in said
    assert out.read_text().startswith("<?xml") and 'data-diverged-op="2"' in out.read_text()
    assert main(["render", str(src), "--html", "-o", str(tmp_path / "t.html")]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert (tmp_path / "t.html").read_text().startswith("<!DOCTYPE html>")


def test_cli_render_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense"}, "ops": [{"op": "fork", "as": "x"}]}))
    assert main(["render", str(bad), "-o", str(tmp_path / "x.svg")]) == 2
    assert "invalid kvtrace" in capsys.readouterr().out and not (tmp_path / "x.svg").exists()
    src = str(HERE / "traces" / "steady_state_inplace.json")
    assert main(["render", src, "--bug", "no_such_bug"]) == 2
    assert main(["render", src, "--bug", "inplace_after_trim"]) == 2  # a dense bug on a ring trace
    (tmp_path / "file").write_text("")
    assert main(["render", src, "-o", str(tmp_path / "file" / "x.svg")]) == 2
    assert "cannot write" in capsys.readouterr().out


def test_replay_prints_the_render_command(capsys):
    src = str(HERE / "traces" / "steady_state_inplace.json")
    assert main(["replay", src, "--bug", "steady_state_inplace"]) == 1
    out = capsys.readouterr().out
    cmd = out.split("see it: ", 1)[1].split("\n")[0].split()
    assert cmd[:3] == ["kvspec", "render", src] and "--bug" in cmd and "--html" in cmd
