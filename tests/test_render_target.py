"""``kvspec render --target``: the picture of a third-party target's run
(drawn against the spec, up to the op where it diverges), the ``see it``
line on the target failures of ``kvspec replay --target`` and ``kvspec fuzz
--target``, and bad input (exit 2, one line naming the argument)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvspec.fuzz.commands.cli import main
from tests.broken_targets.classes import DenseControl

CLASSES = "tests.broken_targets.classes"
#: trim drops the newest rows; the planted fault drops the oldest ones
TRACE = {"kvtrace": 1, "title": "trim drops the newest rows", "cache": {"kind": "dense", "mode": "fp16", "step": 4},
         "ops": [{"op": "append", "n": 3}, {"op": "append", "n": 2}, {"op": "trim", "n": 2}, {"op": "fetch"},
                 {"op": "append", "n": 1}, {"op": "fetch"}]}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trim.json"
    path.write_text(json.dumps(TRACE))
    return path


def _see_it(out: str) -> list[str]:
    """The argv (after ``kvspec``) of the one ``see it:`` line in ``out``."""
    lines = [ln for ln in out.splitlines() if "see it: " in ln]
    assert len(lines) == 1, out
    cmd = shlex.split(lines[0].split("see it: ", 1)[1])
    assert cmd[:2] == ["kvspec", "render"], cmd
    return cmd[1:]


def test_render_draws_the_target_run_up_to_its_divergence(trace, tmp_path, capsys):
    out = tmp_path / "t.html"
    assert main(["render", str(trace), "--html", "-o", str(out), "--target", f"{CLASSES}:TrimDropsOldest"]) == 0
    said = capsys.readouterr().out
    assert "first divergence at op 2: live window differs" in said, said
    page = out.read_text()
    assert "First divergence at op 2" in page and "agree on all" not in page
    assert f"{CLASSES}:TrimDropsOldest did" in page  # the target's side, named
    assert f"run on target <code>{CLASSES}:TrimDropsOldest</code>" in page
    assert page.count('class="diverged"') == 1 and page.count("after the first divergence") == 3
    from kvspec.fuzz.render import timeline
    from kvspec.fuzz.trace import load

    tl = timeline(load(trace), target=f"{CLASSES}:TrimDropsOldest")
    assert [f.index for f in tl.frames if f.diverged] == [2]  # the flag on the op that diverged
    svg_out = tmp_path / "t.svg"
    assert main(["render", str(trace), "-o", str(svg_out), "--target", f"{CLASSES}:TrimDropsOldest"]) == 0
    svg = svg_out.read_text()
    assert 'data-diverged-op="2"' in svg and f"target {CLASSES}:TrimDropsOldest" in svg
    # the same trace on our caches and on a correct target: no divergence
    assert main(["render", str(trace), "--html", "-o", str(out)]) == 0
    assert "spec and impl agree on all 6 ops" in out.read_text()
    assert main(["render", str(trace), "--html", "-o", str(out), "--target", f"{CLASSES}:DenseControl"]) == 0
    page = out.read_text()
    assert f"spec and {CLASSES}:DenseControl agree on all 6 ops" in page and "First divergence" not in page


@pytest.mark.parametrize("argv, words", [
    (["--target", "no_such_target"], "--target: unknown target 'no_such_target'"),
    (["--target", "no_such_module_xyz:Cls"], "--target no_such_module_xyz:Cls: module"),
    (["--target", f"{CLASSES}:NoSuchClass"], f"--target {CLASSES}:NoSuchClass"),
    (["--target", f"{CLASSES}:RingControl"], f"--target {CLASSES}:RingControl: cannot run"),
    (["--target", f"{CLASSES}:DenseControl", "--bug", "inplace_after_trim"], "--bug cannot be combined with --target"),
])
def test_bad_target_exits_2_with_one_line(trace, tmp_path, capsys, argv, words):
    out = tmp_path / "x.html"
    assert main(["render", str(trace), "--html", "-o", str(out), *argv]) == 2
    said = capsys.readouterr()
    text = " ".join(said.out.split())
    assert words in text and "Traceback" not in said.out + said.err, said
    assert said.out.strip().startswith("error:") and not out.exists()


class RaisesOnBuild(DenseControl):
    """A target that raises while its cache is built: outside a compared op
    (no divergence to draw)."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("planted failure outside a compared op")


def test_a_target_that_raises_is_a_usage_error_not_a_picture_of_our_caches(trace, tmp_path, capsys):
    out = tmp_path / "x.html"
    code = main(["render", str(trace), "--html", "-o", str(out), "--target", f"{__name__}:RaisesOnBuild"])
    said = capsys.readouterr()
    assert code == 2 and said.out.strip().startswith("error:"), said
    assert "the target raised RuntimeError" in " ".join(said.out.split()) and not out.exists()


def test_replay_target_prints_a_see_it_line_that_draws_the_failure(trace, tmp_path, capsys):
    target = f"{CLASSES}:TrimDropsOldest"
    assert main(["replay", str(trace), "--target", target, "--waive", "capacity"]) == 1
    cmd = _see_it(capsys.readouterr().out)
    assert cmd[cmd.index("--target") + 1] == target and cmd[cmd.index("--waive") + 1] == "capacity"
    assert main(cmd) == 0
    assert "first divergence at op 2" in capsys.readouterr().out
    assert "First divergence at op 2" in Path(cmd[cmd.index("-o") + 1]).read_text()
    # a target that passes prints no see-it line
    assert main(["replay", str(trace), "--target", f"{CLASSES}:DenseControl"]) == 0
    assert "see it" not in capsys.readouterr().out


def test_fuzz_target_failure_prints_a_see_it_line(tmp_path, capsys):
    target = f"{CLASSES}:TrimDropsOldest"
    code = main(["fuzz", "--target", target, "--kind", "dense", "--budget", "3", "--shrink-budget", "1",
                 "--seed", "1", "--inplace", "on", "--db", "none", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    cmd = _see_it(out)
    assert cmd[cmd.index("--target") + 1] == target
    assert main(cmd) == 0
    said = capsys.readouterr().out
    assert re.search(r"first divergence at op \d+", said), said
    html = Path(cmd[cmd.index("-o") + 1]).read_text()
    assert "First divergence at op" in html and f"{target} did" in html
