"""``kvspec mutants --changed BASE``: mutation testing of a PR's lines.

Mutates only the lines of ``spec/`` and ``impl/`` (mutmut's ``source_paths``
in ``[tool.mutmut]``) that the working tree adds or changes relative to git
revision ``BASE`` (``git diff BASE``: committed and uncommitted changes to
tracked files; a new file counts once it is tracked, ``git add -N`` is
enough), runs each mutant against the tests that execute the statement it
changes (the runner of ``make mutation``, :mod:`kvspec.fuzz.commands.mutation_run`,
on the ``[tool.mutmut]`` test selection), and
reports every mutant that no test detects, with its ``file:line`` and the
mutation as a diff: what a reviewer reads beside the PR ("this line could be
broken and no check would notice").

How: the tree (``git ls-files``: tracked and untracked-not-ignored files) is
copied to a scratch folder, so an existing ``mutants/`` folder of a full
``make mutation`` run is never touched; there mutmut is driven through its
own API with the changed lines as the only lines it may mutate (mutmut's
``covered_lines`` filter, the one ``mutate_only_covered_lines`` uses): a
mutation is made on a node that starts on a changed line.

Statuses are mutmut's. *Detected*: killed, timeout, segfault, suspicious (the
test process died). *Surviving*: survived, and "no tests" (no selected test
runs the function: nothing would notice either). Exit status: 0 no mutant on
the changed lines survives (also when the change has no mutable line),
1 at least one survives, 2 bad arguments (an unknown revision, not a git
checkout, mutmut failing to run the clean tests).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DETECTED = ("killed", "timeout", "segfault", "suspicious", "caught by type check")
SURVIVING = ("survived", "no tests")
HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(?P<start>\d+)(?:,(?P<count>\d+))? @@")


class ChangedError(Exception):
    """A bad argument or an environment that cannot run (exit 2)."""


def _git(root: Path, *args: str) -> str:
    p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise ChangedError(f"git {' '.join(args)}: {p.stderr.strip() or 'failed'}")
    return p.stdout


def source_paths(root: Path) -> list[str]:
    """mutmut's ``source_paths`` from ``[tool.mutmut]`` of ``root/pyproject.toml``."""
    try:
        conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise ChangedError(f"{root / 'pyproject.toml'}: no [tool.mutmut] table ({e})") from None
    return [str(p).rstrip("/") for p in conf.get("source_paths", ["spec", "impl"])]


def parse_diff(diff: str) -> dict[str, set[int]]:
    """``{path: new-side line numbers added or changed}`` from ``git diff -U0``
    output (``.py`` files only; pure deletions add no line)."""
    lines: dict[str, set[int]] = {}
    path: str | None = None
    for raw in diff.splitlines():
        if raw.startswith("+++ "):
            target = raw[4:].strip()
            path = target[2:] if target.startswith("b/") else None  # "/dev/null": a deleted file
            continue
        m = HUNK.match(raw)
        if m and path and path.endswith(".py"):
            start, count = int(m["start"]), int(m["count"] if m["count"] is not None else 1)
            if count:
                lines.setdefault(path, set()).update(range(start, start + count))
    return lines


def changed_lines(root: Path, base: str) -> dict[str, set[int]]:
    """Lines of the mutated packages changed in the working tree since ``base``."""
    _git(root, "rev-parse", "--show-toplevel")
    try:
        _git(root, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}")
    except ChangedError:
        raise ChangedError(f"--changed: {base!r} is not a git revision of {root} (a branch, tag or commit)") from None
    paths = source_paths(root)
    diff = _git(root, "diff", "-U0", "--no-color", "--no-ext-diff", "--no-renames", base, "--", *paths)
    return parse_diff(diff)


#: Runs inside the scratch copy (cwd), with the interpreter that has mutmut;
#: argv: the changed-lines JSON, max children, the result JSON path.
DRIVER = r'''
import json, sys
from pathlib import Path
import mutmut.__main__ as mm
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.configuration import config
from mutmut.state import state
from mutmut.stats import status_by_exit_code

changed = json.loads(Path(sys.argv[1]).read_text())
max_children = int(sys.argv[2])
config().only_mutate = sorted(changed)  # other files are copied, not parsed (do_not_mutate still applies)
state()._covered_lines = {str((Path("mutants") / p).absolute()): set(v) for p, v in changed.items()}
# make mutation's generation and runner (fuzz/commands/mutation_run.py): workers
# that collect the tests once, the tests that execute each mutated statement,
# a timeout re-run with its retry factor before it stands
from kvspec.fuzz.commands.mutation_run import generate, run as run_mutants
generate(Path.cwd(), max_children)

def metas():
    for path in mm.walk_mutatable_files():
        m = SourceFileMutationData(path=path)
        m.load()
        yield path, m

names = [k for _, m in metas() for k in m.exit_code_by_key]
if names:
    run_mutants(Path.cwd(), max_children, log=lambda s: print(s, flush=True))
out = []
for path, m in metas():
    for name, code in m.exit_code_by_key.items():
        status = status_by_exit_code[code]
        diff = get_diff_for_mutant(name, path=path)
        out.append({"name": name, "file": str(path), "status": status, "diff": diff})
Path(sys.argv[3]).write_text(json.dumps(out))
'''


@dataclass
class Mutant:
    name: str
    file: str
    status: str
    line: int | None = None
    diff: str = ""
    source: str = ""

    @property
    def survived(self) -> bool:
        return self.status in SURVIVING

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "line": self.line, "status": self.status,
                "survived": self.survived, "source": self.source, **({"diff": self.diff} if self.survived else {})}


@dataclass
class ChangedReport:
    base: str
    changed: dict[str, set[int]] = field(default_factory=dict)
    mutants: list[Mutant] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def survivors(self) -> list[Mutant]:
        return [m for m in self.mutants if m.survived]

    @property
    def ok(self) -> bool:
        return not self.survivors

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for m in self.mutants:
            counts[m.status] = counts.get(m.status, 0) + 1
        detected = sum(not m.survived for m in self.mutants)
        return {
            "base": self.base, "ok": self.ok, "exit": 0 if self.ok else 1,
            "changed_lines": {p: sorted(v) for p, v in sorted(self.changed.items())},
            "mutants": len(self.mutants), "detected": detected, "survived": len(self.survivors),
            "score": round(100.0 * detected / len(self.mutants), 1) if self.mutants else None,
            "statuses": counts, "survivors": [m.to_json() for m in self.survivors],
            "results": [m.to_json() for m in self.mutants], "seconds": round(self.seconds, 3),
        }


def locate(root: Path, m: Mutant, changed: set[int]) -> None:
    """Set ``m.line`` and ``m.source``: the changed line of ``m.file`` whose
    text is the ``-`` side of the mutant's diff (mutmut's diff is of the whole
    function, so its hunk positions are relative to the function)."""
    minus = [ln[1:] for ln in m.diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    try:
        text = (root / m.file).read_text().splitlines()
    except OSError:
        return
    if not minus:
        return
    wanted = minus[0].strip()
    for number in sorted(changed):
        if 0 < number <= len(text) and text[number - 1].strip() == wanted:
            m.line, m.source = number, text[number - 1].strip()
            return


def _copy_tree(root: Path, dest: Path) -> None:
    files = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_changed(root: Path, base: str, max_children: int = 2, python: str | None = None,
                keep: Path | None = None, log=None) -> ChangedReport:
    """Mutate the lines changed since ``base`` in ``root``; see the module docstring.
    ``keep``: run in this folder (kept) instead of a temporary one."""
    t0 = time.perf_counter()
    report = ChangedReport(base, changed_lines(root, base))
    if not report.changed:
        report.seconds = time.perf_counter() - t0
        return report
    with tempfile.TemporaryDirectory(prefix="kvspec-mutants-changed-") as tmp:
        work = keep or Path(tmp) / "tree"
        work.mkdir(parents=True, exist_ok=True)
        _copy_tree(root, work)
        lines_file, result_file = Path(tmp) / "changed.json", Path(tmp) / "result.json"
        lines_file.write_text(json.dumps({p: sorted(v) for p, v in report.changed.items()}))
        # make mutation's Hypothesis profile (no shrinking) unless the caller chose one
        env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutation")}
        p = subprocess.run([python or sys.executable, "-c", DRIVER, str(lines_file), str(max_children), str(result_file)],
                           cwd=work, capture_output=True, text=True, check=False, env=env)
        if log is not None:
            log(p.stdout + p.stderr)
        if p.returncode != 0 or not result_file.exists():
            tail = (p.stdout + p.stderr).strip()[-2000:]
            raise ChangedError(f"mutmut did not finish (exit {p.returncode}); its output ends:\n{tail}")
        for item in json.loads(result_file.read_text()):
            m = Mutant(item["name"], item["file"], item["status"], diff=item["diff"])
            locate(root, m, report.changed.get(m.file, set()))
            report.mutants.append(m)
    report.mutants.sort(key=lambda m: (m.file, m.line or 0, m.name))
    report.seconds = time.perf_counter() - t0
    return report


def print_report(report: ChangedReport, out=None) -> None:
    out = out or sys.stdout
    n_lines = sum(len(v) for v in report.changed.values())
    if not report.mutants:
        print(f"kvspec mutants --changed {report.base}: {n_lines} changed lines in {len(report.changed)} files, "
              "no mutant (nothing mutable on them)", file=out)
        return
    for m in report.survivors:
        where = f"{m.file}:{m.line}" if m.line else m.file
        print(f"SURVIVED {where} {m.name} ({m.status})", file=out)
        for ln in m.diff.splitlines():
            if ln.startswith(("-", "+")) and not ln.startswith(("---", "+++")):
                print(f"    {ln}", file=out)
    j = report.to_json()
    print(f"kvspec mutants --changed {report.base}: {j['mutants']} mutants on {n_lines} changed lines in "
          f"{len(report.changed)} files; {j['detected']} detected, {j['survived']} surviving "
          f"(score {j['score']}%, {report.seconds:.0f} s)", file=out)


def main(base: str, as_json: bool = False, max_children: int = 2, root: Path | None = None) -> int:
    root = root or Path.cwd()
    try:
        report = run_changed(root, base, max_children)
    except ChangedError as e:
        if as_json:
            print(json.dumps({"base": base, "ok": False, "exit": 2, "error": str(e)}))
        else:
            print(f"kvspec mutants: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report.to_json()))
    else:
        print_report(report)
    return 0 if report.ok else 1
