"""kvspec render: every shipped trace draws; a bug's trace draws its first
divergence with the rule it broke and the spec function stating it."""

import contextlib
import functools
import importlib
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvspec.fuzz.bugs import catalog, runnable
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.render import page, rule_for, svg, timeline
from kvspec.fuzz.replay import make_lockstep
from kvspec.fuzz.trace import load
from kvspec.spec.errors import KVCacheError

HERE = Path(__file__).parent
TRACES = sorted(p for p in (HERE / "traces").rglob("*.json") if "\"kvtrace\"" in p.read_text()[:200])
BUGS = {b.name: b for b in catalog() if runnable(b)}
NS = "{http://www.w3.org/2000/svg}"
SEMANTICS = (HERE.parent / "docs" / "semantics.md").read_text()


def columns(doc: str) -> list[ET.Element]:
    root = ET.fromstring(doc.split("?>", 1)[1])
    return [g for g in root.iter(f"{NS}g") if "opcol" in g.get("class", "")]


def bug_path(name: str) -> Path:
    return HERE / "traces" / f"{name}.json"


@functools.cache
def picture(path: Path, bug: str | None = None) -> tuple:
    """(timeline, SVG, the SVG's op columns) of the trace at ``path`` on our
    implementation (or with ``bug``'s factories), drawn once for all the
    tests that read it; a test that steps a lockstep of its own loads the
    trace again (a lockstep may keep or change the op dicts it runs)."""
    tl = timeline(load(path), BUGS[bug].factories, bug) if bug else timeline(load(path))
    doc = svg(tl)
    return tl, doc, columns(doc)


@pytest.mark.parametrize("path", TRACES, ids=[str(p.relative_to(HERE / "traces")) for p in TRACES])
def test_every_shipped_trace_draws(path):
    """One column per op, every window the spec holds drawn as a row, and
    no divergence on the real implementation."""
    trace = load(path)
    tl, doc, cols = picture(path)
    assert [int(c.get("data-op")) for c in cols] == list(range(len(trace.ops)))
    assert tl.divergence is None and "data-diverged" not in doc
    # every frame draws the live window or a sequence's view, and a store;
    # a prefix pool draws one view per request it holds, so a frame of a pool
    # holding no request (a probe of an empty pool) draws its stores only
    prefix = tl.cache.get("kind") == "prefix"
    for f in tl.frames:
        views = [r for r in f.rows if r.group == "view"]
        assert any(r.group == "store" for r in f.rows), f.index
        assert views or (prefix and not _prefix_requests(trace, f.index)), f.index
    # the rows drawn are the spec's windows: the last frame's live window
    # (or main sequence, or layer 0) holds what the spec's fetch returns
    last = tl.frames[-1]
    views = [r for r in last.rows if r.group == "view"]
    assert views or prefix
    assert all(c.text.isdigit() for r in views[:1] for c in r.cells)


def _prefix_requests(trace, index):
    """The requests the prefix spec holds after op ``index`` of ``trace``."""
    lock = make_lockstep(trace.cache)
    for op in trace.ops[: index + 1]:
        if op["op"] != "expect":
            with contextlib.suppress(KVCacheError):  # a refused op changes nothing
                _, lock.world = lock.spec_apply(op)
    return dict(lock.world.requests) if hasattr(lock.world, "requests") else {}


@pytest.mark.parametrize("path", TRACES, ids=[str(p.relative_to(HERE / "traces")) for p in TRACES])
def test_the_picture_is_the_spec_state_op_by_op(path):
    """Independently of the renderer: after every op, the windows drawn are
    exactly the spec's windows (names and token identities); an append's
    badge agrees with the trace's own ``inplace`` check and the counters
    with its ``capacity`` check, where the trace carries them."""
    from kvspec.fuzz.replay import make_lockstep
    from kvspec.spec.dense import regrow_needed

    trace = load(path)
    tl = picture(path)[0]
    lock = make_lockstep(trace.cache)
    for i, (op, frame) in enumerate(zip(trace.ops, tl.frames)):
        before = lock.world
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
        c = getattr(before, "cache", None)
        if op["op"] == "append" and hasattr(c, "entries") and op.get("error") is not True:
            # a dense buffer regrows where kvspec.spec.dense.regrow_needed says so, and the badge says it
            grew = regrow_needed(c.buffer is not None, c.live_len, c.capacity, op["n"])
            assert ("grew" in badges) == grew, (i, op, badges)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_a_bug_trace_draws_its_divergence_and_rule(name):
    trace = load(bug_path(name))
    tl, doc, cols = picture(bug_path(name), name)
    d, rule = tl.divergence, tl.rule
    assert d is not None and rule is not None
    from kvspec.fuzz.replay import replay

    # the same divergence replay reports, at the same op
    got = replay(trace, BUGS[name].factories).divergence
    assert got is not None and (got.index, got.what) == (d.index, d.what)
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
    from kvspec.spec import dense, rotating

    ring = rotating.RotatingWorld(rotating.new_cache(2, 0, 1))
    full = rotating.RotatingWorld(rotating.RotatingCache(max_size=2, offset=2, idx=2))
    op = {"op": "append", "n": 1}
    assert rule_for("kvspec.spec.rotating", op, "in-place decision differs", ring).name == "warm-up in place"
    assert rule_for("kvspec.spec.rotating", op, "in-place decision differs", full).function == \
        "kvspec.spec.rotating.rotating_inplace_allowed"
    assert rule_for("kvspec.spec.dense", op, "view of held changed (isolation)").function == \
        "kvspec.spec.dense.inplace_write_allowed"
    assert rule_for("kvspec.spec.dense", {"op": "trim_front", "n": 1}, "offset differs").function == \
        "kvspec.spec.dense.trim_front_keep_sink"
    assert rule_for("kvspec.spec.rotating", {"op": "append", "n": 3}, "returned window differs").function == \
        "kvspec.spec.rotating.prefill"
    assert dense and rule_for("kvspec.spec.paged", {"op": "fork", "as": "b"}, "refcounts differs").function == \
        "kvspec.spec.paged.fork"


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


def _expected_stores(world, prefix=""):
    """The physical stores of a spec world, read from the spec's own state
    (not the renderer's): label -> (cell texts in physical order, the cells
    that must be styled ``sink`` or ``shared``)."""
    def tok(e):
        return "" if e is None else str(getattr(e, "token", e))

    if hasattr(world, "layers"):
        out = {}
        for j, w in enumerate(world.layers):
            out.update(_expected_stores(w, f"L{j} "))
        return out
    if hasattr(world, "pool"):
        rc = world.pool.refcounts
        out = {f"table {n}": ([("-" if b is None else str(b)) for b in s.table],
                              {i for i, b in enumerate(s.table) if b is not None and rc[b] > 1})
               for n, s in world.seqs.items()}
        out["refcounts"] = ([str(r) for r in rc], {i for i, r in enumerate(rc) if r > 1})
        return out
    if hasattr(world, "cached") and hasattr(world, "requests"):  # a prefix pool: tables, refcounts, free queue
        blocks = world.blocks
        out = {f"table {n}": ([("-" if b is None else str(b)) for b in q.table],
                              {i for i, b in enumerate(q.table) if b is not None and blocks[b].refcount > 1})
               for n, q in world.requests.items()}
        out["refcounts"] = ([str(b.refcount) if b.refcount or b.key is not None else "" for b in blocks],
                            {i for i, b in enumerate(blocks) if b.refcount > 1})
        out["free queue"] = ([str(b) for b in world.free], set())
        return out
    if hasattr(getattr(world, "memory", None), "config"):  # a cells memory: present by position, free, lost
        m, out = world.memory, {}
        for name in m.config.stores:
            here = sorted(m.present(name), key=lambda c: (c.pos, sorted(c.seqs)))
            lost = sorted((c for c in m.store(name) if c.lost), key=lambda c: (c.pos, sorted(c.seqs)))
            free = m.config.size(name) - len(here)
            out[f"{name} store"] = ([str(c.token) for c in here] + [""] * free + [str(c.pos) for c in lost],
                                    {i for i, c in enumerate(here) if len(c.seqs) > 1})
        return out
    c = world.cache
    if hasattr(c, "coverage"):  # a recurrent layer: conv window rows by token, the checkpoint ring's slots
        k = c.kernel - 1
        last = c.toks[max(0, len(c.toks) - k):]
        out = {f"{prefix}conv window": ([""] * (k - len(last)) + [str(t) for t in last], set())}
        if c.depth:
            slots = [""] * (c.depth + 1)
            for x in range(len(c.toks) - c.coverage, len(c.toks) + 1):
                slots[x % (c.depth + 1)] = f"@{x}"
            out[f"{prefix}checkpoints"] = (slots, set())
        return out
    if hasattr(c, "slots"):  # a ring: slots in physical order, the sinks outlined
        out = {f"{prefix}ring slots": ([tok(e) for e in c.slots],
                                       {i for i, e in enumerate(c.slots) if i < c.keep and e is not None})}
        if c.undo:
            out[f"{prefix}undo log"] = ([tok(e) for r in c.log for e in r.saved], set())
        return out
    cap = 0 if c.buffer is None else c.buffer.capacity
    return {f"{prefix}buffer": ([tok(e) for e in c.entries] + [""] * max(0, cap - len(c.entries)), set())}


def _drawn(col):
    """label -> [(cell class, cell text)] of the spec's rows a column draws
    (the implementation's cells under a divergent window left out)."""
    rows = {}
    for g in col.iter(f"{NS}g"):
        if g.get("class") != "row":
            continue
        cells = []
        impl = False
        for el in g:
            if el.tag == f"{NS}rect":
                impl = "impl" in el.get("class", "")
                if not impl:
                    cells.append([el.get("class"), ""])
            elif el.tag == f"{NS}text" and el.get("class") is None and not impl and cells:
                cells[-1][1] = el.text or ""
        rows[g.get("data-row")] = cells
    return rows


@pytest.mark.parametrize("path", TRACES, ids=[str(p.relative_to(HERE / "traces")) for p in TRACES])
def test_the_svg_draws_the_spec_state_op_by_op(path):
    """What the SVG draws (not the renderer's model of it), column by column,
    against the spec's state after the op read independently: every window
    as its token identities, every store in physical order (a ring's slots
    as they lie, its whole undo log, a dense buffer's dead tail up to the
    capacity, block tables and refcounts), sinks and shared blocks styled as
    such."""
    from kvspec.fuzz.replay import make_lockstep

    trace = load(path)
    cols = picture(path)[2]
    lock = make_lockstep(trace.cache)
    for i, (op, col) in enumerate(zip(trace.ops, cols)):
        lock.step(i, op)
        drawn = _drawn(col)
        for name, toks in lock.spec_views().items():
            label = {"cache": "live window"}.get(name, name.replace("holder:", "holder ").replace("seq:", "seq ")
                                                     .replace("req:", "request "))
            assert [t for _, t in drawn.pop(label)] == [str(t)[:3] for t in toks], (i, op, label)
        for label, (texts, styled) in _expected_stores(lock.world).items():
            cells = drawn.pop(label)
            assert [t for _, t in cells] == [t[:3] for t in texts], (i, op, label)
            marked = {j for j, (cls, _) in enumerate(cells) if cls in ("sink", "shared")}
            assert marked == styled, (i, op, label, marked, styled)
        assert not drawn, (i, op, sorted(drawn))


@pytest.mark.parametrize("name", sorted(BUGS))
def test_the_divergent_column_is_drawn_from_both_sides(name):
    """Read independently of the renderer (a lockstep of its own): the rule
    is the divergent op's own (not a neighbour's) and names a rule of the
    section it cites; the divergent column is outlined, the ops after it
    greyed as not run; every cell where the implementation's window differs
    from the spec's is drawn as wrong, and only those."""
    from kvspec.fuzz.lockstep import Divergence
    from kvspec.fuzz.render import rule_for
    from kvspec.fuzz.replay import make_lockstep
    from tests.test_docs import _rule_resolves, _sections

    trace = load(bug_path(name))
    tl = picture(bug_path(name), name)[0]
    lock = make_lockstep(trace.cache, BUGS[name].factories)
    d = None
    for i, op in enumerate(trace.ops):
        before = lock.world
        try:
            lock.step(i, op)
        except Divergence as exc:
            d = exc
            break
    assert d is not None and d.index == tl.divergence.index
    module = lock.spec_module.__name__
    assert tl.rule == rule_for(module, trace.ops[d.index], d.what, before)
    section = str(tl.rule.section)
    items = [v for k, v in _sections().items() if k.startswith(section + ".")]
    stated = f"`{tl.rule.function.rpartition('.')[2]}`" in _sections()[section]  # the section names the function
    assert stated or _rule_resolves(section, tl.rule.name) or any(tl.rule.name.lower() == v.lower() for v in items), \
        f"{tl.rule.cite()}: no such rule in that section of docs/semantics.md"
    cols = picture(bug_path(name), name)[2]
    classes = [next(r.get("class") for r in c.iter(f"{NS}rect")) for c in cols]
    assert classes == ["col"] * d.index + ["col-diverged"] + ["col-notrun"] * (len(cols) - d.index - 1)
    if lock.world is before:  # the spec's state after the op names the op's own rows
        with contextlib.suppress(Exception):
            lock.world = lock.spec_apply(trace.ops[d.index])[1]
    try:
        impl = {n: [str(t) for t in lock.identify(a, lock.view_mode(n))] for n, a in lock.impl_views().items()}
    except Exception:  # noqa: BLE001 - a broken implementation may not fetch
        return
    spec = {n: [str(t) for t in toks] for n, toks in tl_views(tl, d.index).items()}
    rows = {g.get("data-row"): g for g in cols[d.index].iter(f"{NS}g") if g.get("class") == "row"}
    for n, got in impl.items():
        want = spec.get(n)
        if want is None:
            continue
        label = {"cache": "live window"}.get(n, n.replace("holder:", "holder ").replace("seq:", "seq ")
                                                     .replace("req:", "request "))
        wrong = [j for j, r in enumerate(x for x in rows[label] if x.tag == f"{NS}rect" and "impl" in x.get("class", ""))
                 if "wrong" in r.get("class")]
        assert wrong == [j for j, t in enumerate(got) if j >= len(want) or t != want[j]], (n, got, want)


def tl_views(tl, index):
    return {r.note: [c.text for c in r.cells] for r in tl.frames[index].rows if r.group == "view"}


def test_a_long_trace_draws_every_op(tmp_path, capsys):
    """No silent cap on the timeline: a 300-op trace draws 300 columns and
    the command says so."""
    ops = [{"op": "append", "n": 1} if i % 3 else {"op": "trim", "n": 1} for i in range(300)]
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"kvtrace": 1, "cache": {"kind": "dense", "step": 4}, "ops": ops}))
    cols = columns(svg(timeline(load(path))))
    assert [int(c.get("data-op")) for c in cols] == list(range(300))
    assert main(["render", str(path), "-o", str(tmp_path / "long.svg")]) == 0
    assert "300 ops" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["steady_state_inplace", "paged_no_cow", "list_trim_partial"])
def test_the_html_page_highlights_the_divergent_op(name):
    """The HTML variant marks the same op as the SVG: its ops table has
    exactly one highlighted row, the divergent op's, and its inline picture
    outlines that column."""
    tl = timeline(load(HERE / "traces" / f"{name}.json"), BUGS[name].factories, name)
    html = page(tl, name)
    rows = re.findall(r'<tr class="diverged"><td>(\d+)</td>', html)
    assert rows == [str(tl.divergence.index)]
    assert html.count('data-diverged="true"') == 1 and f'data-diverged-op="{tl.divergence.index}"' in html


# -- the rule box shows the cited rule's own text; badges are whole ---------------------------

def _plain_md(md: str) -> str:
    text = re.sub(r"\[([^[\]]*)\]\([^)]*\)", r"\1", md)
    return " ".join(text.replace("**", "").replace("`", "").split())


def _rule_lines(section: int) -> list[tuple[str, str]]:
    """(name, whole line) of every rule docs/semantics.md section ``section``
    states: a table row (not a header) or a numbered bold item, read here
    independently of the renderer."""
    body = re.split(r"^## \d+\. ", SEMANTICS, flags=re.MULTILINE)[section]
    lines = body.splitlines()
    out = []
    for k, line in enumerate(lines):
        item = re.match(r"^\d+\. \*\*([^*]+?)\.?\*\*(.*)", line)
        if item:
            rest = [x for x in lines[k + 1:k + 8]]
            cont = []
            for x in rest:
                if not x.startswith("   "):
                    break
                cont.append(x)
            out.append((_plain_md(item.group(1)), _plain_md(" ".join([line, *cont]))))
        elif line.startswith("| ") and not line.startswith("| ---") and not (
                k + 1 < len(lines) and lines[k + 1].startswith("| ---")):
            out.append((_plain_md(line.split("|")[1]), _plain_md(line)))
    return out


def _the_rule_line(section: int, name: str) -> str:
    """The one line of the section stating rule ``name``: named exactly, or
    the one name that begins with it and goes on with a blank, ``(``, ``,``
    or ``:``."""
    rules = _rule_lines(section)
    exact = [line for n, line in rules if n.lower() == name.lower()]
    begins = [line for n, line in rules if n.lower().startswith(name.lower())
              and n[len(name):len(name) + 1] in (" ", "(", ",", ":")]
    found = exact or begins
    assert len(found) == 1, f"semantics.md {section}: {len(found)} rules named {name!r}"
    return found[0]


def _check_rule_text(rule) -> None:
    """The text shown for ``rule`` is on its own row and on no other row of
    the section (so a rule sharing its spec function with another, like
    warm-up in place and steady state copies, shows its own)."""
    line = _the_rule_line(rule.section, rule.name)
    shown = rule.doc.rstrip(".")
    assert shown and shown in line, (rule, shown, line)
    others = [x for _, x in _rule_lines(rule.section) if x != line and shown in x]
    assert not others, (rule, shown, others)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_the_rule_box_shows_the_cited_rules_own_text(name):
    """Every bug's divergence box (SVG and HTML) shows the text of the rule it
    cites, read off that rule's row of docs/semantics.md."""
    from html.parser import HTMLParser

    tl, doc, _ = picture(bug_path(name), name)
    _check_rule_text(tl.rule)
    root = ET.fromstring(doc.split("?>", 1)[1])
    box = next(g for g in root.iter(f"{NS}g") if g.get("class") == "divergence")
    assert tl.rule.doc in " ".join(" ".join(box.itertext()).split())

    class Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.parts: list[str] = []

        def handle_data(self, data):
            self.parts.append(data)

    parser = Text()
    parser.feed(page(tl, name))
    assert tl.rule.doc in " ".join("".join(parser.parts).split())


def test_steady_state_and_warm_up_boxes_show_their_own_rules():
    """The report: the steady-state box showed the warm-up rule's text (both
    rules are stated by kvspec.spec.rotating.rotating_inplace_allowed)."""
    steady = timeline(load(HERE / "traces" / "steady_state_inplace.json"),
                      BUGS["steady_state_inplace"].factories, "steady_state_inplace").rule
    warm = timeline(load(HERE / "traces" / "warmup_inplace_ignores_marker.json"),
                    BUGS["warmup_inplace_ignores_marker"].factories, "warmup_inplace_ignores_marker").rule
    assert (steady.name, warm.name) == ("steady state copies", "warm-up in place")
    assert steady.function == warm.function == "kvspec.spec.rotating.rotating_inplace_allowed"
    assert "once the window is full" in steady.doc and "warm" not in steady.doc.lower()
    assert "not yet full" in warm.doc and steady.doc != warm.doc


def test_every_rule_the_renderer_can_cite_is_a_row_with_its_text():
    """rule_for over every op each kind runs or refuses, with or without an
    expected error, under each kind of check: the rule it names is a row of
    the section it cites and the text shown is that row's."""
    from kvspec.fuzz import kinds
    from kvspec.fuzz.render import SECTIONS

    whats = ["returned window differs", "refusal differs", "offset differs", "capacity differs",
             "in-place decision differs", "view of holder:s changed (isolation)", "make_mask(1) differs",
             "refcounts differs", "trimmable differs", "log_saved_rows differs", "live window differs"]
    seen = set()
    for module in SECTIONS:
        kind = kinds.KINDS[module.split(".")[2]]
        for op in kind.all_ops + kind.refuses:
            for what in whats:
                for extra in ({}, {"error": True}, {"n": 3}):
                    rule = rule_for(module, {"op": op, "n": 1, **extra}, what)
                    if (rule.section, rule.name) not in seen:
                        seen.add((rule.section, rule.name))
                        _check_rule_text(rule)
    assert len(seen) >= 20


def _whole_prefix(shown: str, full: str) -> bool:
    """``shown`` is ``full``, or ``full`` cut between words (at a blank or a
    punctuation mark, never inside a word or a number) with an ellipsis."""
    if shown == full:
        return True
    if not shown.endswith("\u2026"):
        return False
    stem = shown[:-1]

    def word(ch: str) -> bool:
        return ch.isalnum() or ch in "._-"

    return full.startswith(stem) and bool(stem) and not (word(stem[-1]) and word(full[len(stem)]))


@pytest.mark.parametrize("name", sorted(BUGS))
def test_badges_are_whole_words_and_fit_their_column(name):
    """Every badge of a bug's picture shows its whole text or its text cut
    between words with an ellipsis (never ``impl: capacit``), and its box
    holds its text and lies inside its column."""
    tl, _, cols = picture(bug_path(name), name)
    for frame, col in zip(tl.frames, cols, strict=True):
        outline = next(r for r in col.iter(f"{NS}rect"))
        right = float(outline.get("x")) + float(outline.get("width"))
        badges = [g for g in col.iter(f"{NS}g") if "badge" in g.get("class", "").split()]
        assert [g.get("data-badge") for g in badges] == [n for n, _ in frame.badges]
        for g, (badge, detail) in zip(badges, frame.badges):
            rect, text = g.find(f"{NS}rect"), g.find(f"{NS}text").text
            full = f"{badge} {detail}" if badge in ("returns", "expect") else badge
            assert _whole_prefix(text, full), (frame.index, text, full)
            if badge.endswith("\u2026") and ": " in badge:  # the implementation's side, cut for the badge
                assert _whole_prefix(badge.split(": ", 1)[1], detail.split(": ", 1)[1]), (badge, detail)
            x, w = float(rect.get("x")), float(rect.get("width"))
            assert w >= len(text) * 6 + 8 and x + w <= right, (frame.index, text, x, w, right)
