"""``kvspec conformance --baseline`` and ``kvspec fuzz --target --baseline``:
a head compared with a base (fuzz/commands/review.py, docs/review.md).

The engine is mlx-lm, copied into a temporary folder: an unchanged copy, and
a copy whose ``KVCache.trim`` no longer clamps ``n`` to the offset. The head
is the environment the command runs in (the planted copy first on its
``PYTHONPATH``), the base an import folder, another install (a Python
executable) or a saved report. Every run is one class, a few examples."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from kvspec.fuzz.commands.review import (
    Divergences,
    check_of,
    compare,
    divergences,
    key_of,
)

REPO = Path(__file__).resolve().parents[1]
#: examples a round: the planted fault is caught in the second round
EXAMPLES = "25"
TRIM_KEY = "KVCache | return value differs | trim n>0"


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two copies of the installed mlx_lm: ``same`` unchanged, ``planted``
    with KVCache.trim not clamping n to the offset."""
    import mlx_lm

    src = Path(mlx_lm.__file__).parent
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for name in ("same", "planted"):
        shutil.copytree(src, root / name / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
        out[name] = root / name
    cache = root / "planted" / "mlx_lm" / "models" / "cache.py"
    text = cache.read_text()
    start, end = text.index("class KVCache(_BaseCache):"), text.index("class RotatingKVCache")
    clamped = "        n = min(self.offset, n)\n        self.offset -= n\n        return n"
    assert text[start:end].count(clamped) == 1
    cache.write_text(text[:start] + text[start:end].replace(clamped, "        self.offset -= n\n        return n")
                     + text[end:])
    return out


def kvspec(*args: str, head: Path | None = None, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run the CLI as its own process (the head is its environment:
    ``head`` first on its PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if head is not None:
        env["PYTHONPATH"] = str(head)
    p = subprocess.run([sys.executable, "-m", "kvspec.fuzz.commands.cli", *args], check=False, capture_output=True,
                       text=True, env=env, cwd=cwd or REPO, timeout=600)
    return p.returncode, p.stdout, p.stderr


def conformance(*args: str, head: Path | None = None, cwd: Path | None = None) -> tuple[int, dict, str]:
    code, out, err = kvspec("conformance", "--class", "KVCache", "--examples", EXAMPLES, "--json", *args, head=head,
                            cwd=cwd)
    try:
        doc = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise AssertionError(f"no JSON (exit {code}):\n{out}\n{err}") from None
    return code, doc, err


def keys(entries: list[dict]) -> set[str]:
    return {e["key"] for e in entries}


def follows(doc: dict, name: str) -> None:
    """``doc`` follows fuzz/schemas/NAME.schema.json (docs/json.md)."""
    import jsonschema

    jsonschema.validate(doc, json.loads((REPO / "fuzz" / "schemas" / f"{name}.schema.json").read_text()))


def test_a_planted_trim_fault_is_added_and_an_unchanged_copy_adds_nothing(copies, tmp_path):
    # head: the planted copy, run from its folder (as from an engine's checkout); base: this environment's own
    # install (a Python executable), which must not import the folder it is run from
    code, doc, err = conformance("--baseline", sys.executable, "--out", str(tmp_path / "planted"),
                                 "--sarif", str(tmp_path / "added.sarif"), "--junit-xml", str(tmp_path / "r.xml"),
                                 cwd=copies["planted"])
    assert code == 1, err
    assert doc["exit"] == 1 and doc["base"]["how"] == "python"
    follows(doc, "baseline")
    follows(doc["head"]["report"], "conformance")
    assert keys(doc["added"]) == {TRIM_KEY}, doc["added"]
    assert not doc["fixed"]
    # mlx-lm's own divergences of KVCache are on both sides
    assert "KVCache | capacity differs | state_restore" in keys(doc["both"])
    added = doc["added"][0]
    assert Path(added["trace"]).exists() and added["trace"].startswith(str(tmp_path / "planted" / "head"))
    sarif = json.loads((tmp_path / "added.sarif").read_text())
    assert [r["ruleId"] for r in sarif["runs"][0]["results"]] == ["return-value-differs"]
    xml = (tmp_path / "r.xml").read_text()
    assert xml.count("<failure") == 1 and TRIM_KEY.split(" | ")[1] in xml
    # the planted copy's minimal trace replays as a divergence on the planted head, not on the install
    replay = ["replay", "--target", "mlx-lm", *[a for w in added["waived"] for a in ("--waive", w)], added["trace"]]
    assert kvspec(*replay, head=copies["planted"])[0] == 1
    assert kvspec(*replay)[0] == 0

    # an unchanged copy as the base (an import folder): nothing added, nothing fixed
    code, same, err = conformance("--baseline", str(copies["same"]), "--out", str(tmp_path / "same"))
    assert code == 0, err
    assert not same["added"] and not same["fixed"] and same["both"]
    assert same["base"]["how"] == "path"
    assert keys(same["both"]) == keys(doc["both"])

    # a saved report as the base (the install's side of the first run, its traces still on disk): the same verdict
    saved = tmp_path / "base-report.json"
    saved.write_text(json.dumps(doc["base"]["report"]))
    code, again, err = conformance("--baseline", str(saved), "--out", str(tmp_path / "saved"), head=copies["planted"])
    assert code == 1, err
    assert keys(again["added"]) == {TRIM_KEY} and not again["fixed"]
    assert again["base"]["how"] == "report" and again["seed"] == doc["seed"]
    assert keys(again["both"]) == keys(doc["both"])


def test_a_base_that_cannot_run_is_no_verdict_never_a_divergence(copies, tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no such engine' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    # the head adds a divergence, but without a base there is no verdict: exit 2, not 1
    code, doc, err = conformance("--baseline", str(broken), "--examples", "25", "--out", str(tmp_path / "o"),
                                 head=copies["planted"])
    assert code == 2 and doc["exit"] == 2, (doc, err)
    assert "no verdict" in doc["error"] and "base could not run" in doc["error"]
    assert "added" not in doc


def test_fuzz_target_baseline_unchanged_copy(copies, tmp_path):
    code, out, err = kvspec("fuzz", "--target", "mlx-lm", "--kind", "dense", "--mode", "fp16", "--examples", "25",
                            "--baseline", str(copies["same"]), "--out", str(tmp_path), "--json")
    assert code == 0, err
    doc = json.loads(out.strip().splitlines()[-1])
    assert not doc["added"] and not doc["fixed"] and doc["base"]["how"] == "path"
    assert all(r["examples"] > 0 for r in doc["head"]["report"]["runs"])
    follows(doc, "baseline")
    follows(doc["head"]["report"], "fuzz")


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d / "missing"), "does not exist"),
    (lambda d: _write(d / "notes.txt", "hello"), "neither a .json report"),
    (lambda d: _write(d / "bad.json", "{"), "not a readable JSON report"),
    (lambda d: _write(d / "other.json", json.dumps({"runs": []})), "not a conformance report"),
    (lambda d: _write(d / "seconds.json", json.dumps({"classes": [], "budget": 120, "examples": None})),
     "bounded by seconds"),
    (lambda d: _write(d / "seed.json", json.dumps({"classes": [{"cache_class": "KVCache", "findings": []}],
                                                   "seed": 1, "examples": 50})), "--seed 1"),
])
def test_bad_input_exits_2_naming_it(tmp_path, capsys, make, message):
    from kvspec.fuzz.commands.cli import main

    code = main(["conformance", "--class", "KVCache", "--examples", EXAMPLES, "--seed", "7", "--json",
                 "--out", str(tmp_path / "o"), "--baseline", make(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and "--baseline" in doc["error"] and message in doc["error"], doc
    assert not (tmp_path / "o" / "head").exists()  # nothing ran


def test_bounds_by_seconds_are_refused_beside_a_baseline(tmp_path, capsys):
    from kvspec.fuzz.commands.cli import main

    assert main(["conformance", "--budget", "5", "--baseline", str(tmp_path), "--json"]) == 2
    assert "--budget" in json.loads(capsys.readouterr().out)["error"]
    assert main(["fuzz", "--target", "mlx-lm", "--budget", "5", "--baseline", str(tmp_path), "--json"]) == 2
    assert "--budget" in json.loads(capsys.readouterr().out)["error"]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- the key ----------------------------------------------------------------------------
def test_the_key_leaves_out_what_varies_from_run_to_run():
    assert check_of("view of s1 changed (isolation)") == check_of("view of s17 changed (isolation)")
    assert check_of("view of state snapshot holder:st1 changed (isolation)") == \
        "view of state snapshot stN changed (isolation)"
    assert check_of("make_mask(1, {'window_size': 3}) differs") == check_of("make_mask(4, {}) differs")
    assert key_of("KVCache", "offset differs", {"op": "trim", "n": 3}) == \
        key_of("KVCache", "offset differs", {"op": "trim", "n": 9}) != \
        key_of("KVCache", "offset differs", {"op": "trim", "n": -1})


def _finding(what: str, op: dict, trace: str, seed_text: str) -> dict:
    return {"what": what, "op": op, "trace": trace, "index": 3, "summary": f"{seed_text}: {what}", "waived": []}


def test_compare_by_key_not_by_trace_or_text():
    head = {"classes": [{"cache_class": "KVCache", "findings": [
        _finding("offset differs", {"op": "trim", "n": 2}, "/h/KVCache_01.json", "seed 1"),
        _finding("capacity differs", {"op": "append", "n": 1}, "/h/KVCache_02.json", "seed 1")]}]}
    base = {"classes": [{"cache_class": "KVCache", "findings": [
        _finding("capacity differs", {"op": "append", "n": 1}, "/b/KVCache_01.json", "seed 2"),
        _finding("live window differs", {"op": "trim", "n": -1}, "/b/KVCache_02.json", "seed 2")]}]}
    comp = compare(divergences(head, "conformance"), divergences(base, "conformance"))
    assert keys(comp.added) == {"KVCache | offset differs | trim n>0"}
    assert keys(comp.fixed) == {"KVCache | live window differs | trim n<0"}
    assert keys(comp.both) == {"KVCache | capacity differs | append n=1"}
    assert comp.exit_code == 1
    same = compare(divergences(head, "conformance"), divergences(head, "conformance"))
    assert not same.added and not same.fixed and same.exit_code == 0
    # a class without a verdict on a side is compared on neither, and is no verdict (2) unless something is added
    nv = Divergences(no_verdict={"KVCache": "tool failure: boom"})
    assert compare(Divergences(), nv).exit_code == 2


def test_fuzz_rows_keyed_from_their_failure_line():
    row = {"config": "mlx-lm:dense/fp16/inplace", "result": "FAILED",
           "failure": 'op 2 {"op": "state_restore", "name": "st5"}: capacity differs'}
    d = divergences({"runs": [row], "target": "mlx-lm"}, "fuzz")
    assert list(d.by_key) == ["dense/fp16/inplace | capacity differs | state_restore"]
    assert divergences({"runs": [{**row, "result": "tool failure"}]}, "fuzz").no_verdict


def test_the_new_flags_are_on_the_cli_page_and_in_help():
    from kvspec.fuzz.commands.cli import build_parser

    page = (REPO / "docs" / "cli.md").read_text()
    subs = build_parser().get_default("_subparsers")
    for command, flags in (("conformance", ("--baseline", "--examples", "--junit-xml")),
                           ("fuzz", ("--baseline", "--examples"))):
        text = subs[command].format_help()
        for flag in flags:
            assert flag in text, (command, flag)
            assert f"{command} " in page and flag in page, (command, flag)
    assert "`kvspec conformance --baseline" in page and "`kvspec fuzz --target" in page
