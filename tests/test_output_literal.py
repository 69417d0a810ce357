"""Names print literally wherever rich prints them (issue 47): a class
named ``Ring`` is not an emoji (``:Ring:`` is rich's emoji code for a ring),
``[bold]x[/bold]`` is not bold x, and ``[/]`` is not a closing tag (rich
raises MarkupError on it: a traceback instead of the output). Names come
from the user (trace paths, target labels, class names) and from traces;
each place that prints one is fed all three."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kvspec.fuzz.commands.cli import _console, _Ticker, main
from tests.target_examples import write_package

TRACES = Path(__file__).parent / "traces"
#: names rich would read as an emoji code, as markup, as a closing tag with nothing open
NAMES = (":Ring:", "[bold]x[/bold]", "[/]")
EMOJI = "\U0001f48d"  # what ":Ring:" becomes when read as an emoji code


def _literal(out: str, *names: str) -> None:
    assert EMOJI not in out, out
    assert "Traceback" not in out and "MarkupError" not in out, out
    for name in names:
        assert name in out, (name, out)


@pytest.fixture
def odd_paths(tmp_path):
    """A folder of traces, one per name, the name in the file's path
    (``[/]`` and ``[bold]x[/bold]`` make folders: '/' is a separator)."""
    root = tmp_path / "traces"
    paths = []
    for name in NAMES:
        p = root / f"{name}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TRACES / "format_example.json", p)
        paths.append(str(p))
    return root, paths


def test_replay_prints_trace_paths_literally(odd_paths, capsys):
    root, paths = odd_paths
    assert main(["replay", str(root)]) == 0
    out = capsys.readouterr().out
    _literal(out, *paths)
    assert out.rstrip().endswith("3 traces: 3 ok, 0 diverged, 0 not applicable to target impl")


def test_an_invalid_trace_at_an_odd_path_is_named_literally(tmp_path, capsys):
    for name in NAMES:
        p = tmp_path / f"{name}bad.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{not json")
        for command in (["replay", str(p)], ["rows", str(p)], ["render", str(p), "-o", str(tmp_path / "o.svg")]):
            assert main(command) == 2, command
            out = capsys.readouterr().out
            _literal(out, str(p))
            assert "invalid kvtrace" in out


def test_a_divergence_names_the_trace_and_its_replay_literally(tmp_path, capsys):
    p = tmp_path / ":Ring:" / "[/]steady.json"
    p.parent.mkdir(parents=True)
    shutil.copy(TRACES / "steady_state_inplace.json", p)
    assert main(["replay", str(p), "--bug", "steady_state_inplace"]) == 1
    _literal(capsys.readouterr().out, str(p), "see it: kvspec render")


@pytest.fixture
def ring_target(tmp_path, monkeypatch):
    """``ringcache.cache:Ring``, a correct dense cache class named Ring in a
    package outside this repository's: its label holds ``:Ring:`` once the
    campaign's config is appended (``ringcache.cache:Ring:dense/fp16/...``)."""
    write_package(tmp_path / "site", "ringcache")
    with open(tmp_path / "site" / "ringcache" / "cache.py", "a") as fh:
        fh.write("\n\nclass Ring(ListCache):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for mod in [m for m in sys.modules if m == "ringcache" or m.startswith("ringcache.")]:
        monkeypatch.delitem(sys.modules, mod)
    return "ringcache.cache:Ring"


def test_fuzz_prints_a_class_named_ring_literally(ring_target, tmp_path, capsys):
    code = main(["fuzz", "--target", ring_target, "--budget", "1", "--seed", "3", "--db", "none",
                 "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 0, out
    # the table's title, its config cells, the "reached" lines and stderr's progress
    _literal(out, f"target {ring_target})", f"{ring_target}:dense/fp16")
    assert any(line.startswith(f"{ring_target}:dense/fp16") and "reached:" in line for line in out.splitlines())


def test_replay_on_a_class_named_ring_prints_its_label_literally(ring_target, odd_paths, capsys):
    root, paths = odd_paths
    assert main(["replay", str(root), "--target", ring_target]) == 0
    out = capsys.readouterr().out
    _literal(out, *paths, f"target {ring_target}")
    assert main(["replay", str(root), "--target", ring_target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == ring_target


@pytest.mark.parametrize("name", NAMES)
def test_the_progress_line_is_literal_on_a_terminal_and_off_it(name):
    """On a terminal the ticker is a live status line (rich reads a string
    there as markup and emoji codes); off it, plain lines."""
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, highlight=False, emoji=False)
    ticker = _Ticker(term)
    try:
        ticker.start(name)
        assert ticker.status.renderable.text.plain == name
        ticker.tick(f"{name} 3 examples")
        assert ticker.status.renderable.text.plain == f"{name}: {name} 3 examples"
    finally:
        ticker.stop()
    plain = io.StringIO()
    ticker = _Ticker(Console(file=plain, force_terminal=False, highlight=False, emoji=False), every=0.0)
    ticker.start(name)
    ticker.tick("failure found after 2 examples")
    ticker.done(f"{name} done")
    assert plain.getvalue().splitlines() == [f"{name}: failure found after 2 examples", f"{name} done"]


def test_the_command_console_reads_no_emoji_codes():
    buf = io.StringIO()
    console = _console()
    console.file = buf
    console.print(":Ring: :ring:", markup=False)
    assert buf.getvalue().strip() == ":Ring: :ring:"


def test_the_conformance_tables_print_class_target_and_finding_literally():
    from kvspec.fuzz.commands.conformance import ClassReport, Finding, print_report

    finding = Finding(":Ring:", "[bold]x[/bold]", 0, {"op": "trim", "n": 1}, "offset differs",
                      "[/] a summary", "/t/[/]x.json", [], "then [bold]x[/bold]", 1, 0)
    report = ClassReport(":Ring:", "[bold]x[/bold]", "dense", "fp16", steps=3, covered={"trim": 1},
                         skipped={"[/]": "no"}, findings=[finding], ended=":Ring: ended")
    buf = io.StringIO()
    print_report([report], 1, 1.0, Console(file=buf, width=200, highlight=False, emoji=False))
    _literal(buf.getvalue(), ":Ring:", "[bold]x[/bold]", "[/] a summary", "then [bold]x[/bold]", ":Ring: ended")
