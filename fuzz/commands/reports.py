"""What CI systems and people read besides the tables: JUnit XML, SARIF,
"did you mean", tables that never cut a word, rerun commands.

* :func:`write_junit` writes a JUnit XML report (the ``<testsuites>``
  dialect GitHub Actions, GitLab, Jenkins and pytest's ``--junit-xml``
  read): one ``<testcase>`` per check, campaign, trace or injected bug, a
  ``<failure>`` with the first line as its message and the whole detail as
  its text.
* :func:`write_sarif` writes SARIF 2.1.0 (the format of GitHub code
  scanning) for divergences found in a third-party target: one result per
  divergence, located in its kvtrace file, its rule the observable that
  differed, its message the op and both sides.
* :func:`suggest` is the "(did you mean ...?)" of every error that names a
  bad value.

Nothing here loads MLX.
"""

from __future__ import annotations

import difflib
import re
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def suggest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to ``word``,
    or the empty string when none is close."""
    match = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


# -- JUnit XML ---------------------------------------------------------------------
@dataclass
class Case:
    """One JUnit test case: ``suite`` groups them (one ``<testsuite>`` each)."""

    suite: str
    name: str
    ok: bool
    seconds: float = 0.0
    detail: str = ""
    #: a reason when the case did not run (``<skipped>``)
    skipped: str | None = None
    #: the tool itself failed, not the case (``<error>``, not ``<failure>``)
    error: bool = False


def junit_xml(cases: list[Case], name: str = "kvspec") -> str:
    """The JUnit XML document for ``cases`` (suites in first-seen order)."""
    root = ET.Element("testsuites", name=name)
    suites: dict[str, ET.Element] = {}
    counts: dict[str, list[float]] = {}
    for c in cases:
        if c.suite not in suites:
            suites[c.suite] = ET.SubElement(root, "testsuite", name=c.suite)
            counts[c.suite] = [0, 0, 0, 0.0, 0]
        tc = ET.SubElement(suites[c.suite], "testcase", name=c.name, classname=f"{name}.{c.suite}",
                           time=f"{c.seconds:.3f}")
        n = counts[c.suite]
        n[0] += 1
        n[3] += c.seconds
        if c.skipped is not None:
            ET.SubElement(tc, "skipped", message=c.skipped)
            n[2] += 1
        elif not c.ok:
            first = c.detail.splitlines()[0] if c.detail else "failed"
            ET.SubElement(tc, "error" if c.error else "failure", message=first[:500]).text = c.detail
            n[4 if c.error else 1] += 1
        elif c.detail:
            ET.SubElement(tc, "system-out").text = c.detail
    total = [0, 0, 0, 0.0, 0]
    for suite, el in suites.items():
        tests, failures, skipped, seconds, errors = counts[suite]
        el.set("tests", str(tests))
        el.set("failures", str(failures))
        el.set("errors", str(errors))
        el.set("skipped", str(skipped))
        el.set("time", f"{seconds:.3f}")
        total = [a + b for a, b in zip(total, counts[suite])]
    root.set("tests", str(int(total[0])))
    root.set("failures", str(int(total[1])))
    root.set("errors", str(int(total[4])))
    root.set("skipped", str(int(total[2])))
    root.set("time", f"{total[3]:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | Path, cases: list[Case], name: str = "kvspec") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml(cases, name))
    return path


# -- SARIF -------------------------------------------------------------------------
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _rule_id(what: str) -> str:
    """A divergence's ``what`` ("capacity differs", "view of s1 changed
    (isolation)") as a stable rule id: the observable, names of holders
    left out ("capacity-differs", "view-changed-isolation")."""
    what = re.sub(r"\bof \S+", "", what)
    return re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-") or "divergence"


def sarif(findings: list[dict[str, Any]], tool_version: str = "") -> dict[str, Any]:
    """A SARIF 2.1.0 log. Each finding: ``trace`` (the kvtrace path),
    ``target`` (the implementation that diverged), ``index``, ``op`` (the
    kvtrace op), ``what`` (what differed), ``spec`` and ``impl`` (both
    sides), optionally ``replay`` (the command that reproduces it) and
    ``level`` ("error" by default)."""
    rules: dict[str, dict[str, Any]] = {}
    results = []
    for f in findings:
        rid = _rule_id(str(f.get("what", "")))
        rules.setdefault(rid, {"id": rid, "name": rid.replace("-", " "),
                               "shortDescription": {"text": f"spec and implementation disagree: {f.get('what', '')}"}})
        op = f.get("op") or {}
        text = (f"{f.get('target', 'target')} diverges from the spec at op {f.get('index')} "
                f"({op.get('op', '?') if isinstance(op, dict) else op}): {f.get('what')}; spec says {f.get('spec')}; "
                f"{f.get('target', 'impl')} did {f.get('impl')}")
        if f.get("replay"):
            text += f". Reproduce: {f['replay']}"
        results.append({
            "ruleId": rid,
            "level": f.get("level", "error"),
            "message": {"text": text},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": Path(str(f["trace"])).as_posix()}},
                           "logicalLocations": [{"name": f"op {f.get('index')}", "kind": "member",
                                                 "fullyQualifiedName": f"{f.get('target')}:{op.get('op', '?') if isinstance(op, dict) else op}"}]}],
            "properties": {"target": f.get("target"), "op": op, "index": f.get("index"),
                           "spec": f.get("spec"), "impl": f.get("impl")},
        })
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0",
            "runs": [{"tool": {"driver": {"name": "kvspec", "version": tool_version or "0",
                                          "rules": list(rules.values())}},
                      "results": results}]}


def write_sarif(path: str | Path, findings: list[dict[str, Any]], tool_version: str = "") -> Path:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sarif(findings, tool_version), indent=1) + "\n")
    return path


def writable(path: str) -> str | None:
    """Why a report cannot be written at ``path`` (None: it can): checked
    before a run of minutes, not after it."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a folder; give a file name"
    parent = p.parent if str(p.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".{p.name}.kvspec-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"cannot write into {parent}: {exc.strerror or exc}"
    return None


# -- tables and reruns ---------------------------------------------------------------
def print_table(console: Any, table: Any) -> None:
    """Print a rich table: a terminal's width on a terminal (cells wrap,
    a word longer than its column folds), otherwise as wide as it takes for
    no word to be cut (cells still wrap at spaces beyond 80 columns)."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update(width=100_000), table).minimum
    if need <= console.width:
        console.print(table)
        return
    saved = console.width  # print(width=) cannot exceed the console's own width
    console.width = need
    try:
        console.print(table)
    finally:
        console.width = saved


def rerun(command: str, argv: list[str], set_options: dict[str, str] | None = None) -> str:
    """The command line that reruns ``kvspec <command> argv``, with each
    option of ``set_options`` set to its value (replacing it or added):
    the interrupted command with every option it had, and its seed."""
    args = list(argv)
    if args[:1] == [command]:
        args = args[1:]
    for opt, value in (set_options or {}).items():
        for i, a in enumerate(args):
            if a == opt and i + 1 < len(args):
                args[i + 1] = value
                break
            if a.startswith(opt + "="):
                args[i] = f"{opt}={value}"
                break
        else:
            args += [opt, value]
    return shlex.join(["kvspec", command, *args])


__all__ = ["Case", "junit_xml", "print_table", "rerun", "sarif", "suggest", "writable", "write_junit", "write_sarif"]
