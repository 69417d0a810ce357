"""Summarise a mutmut run (``make mutation``) per package.

Reads ``mutmut results --all true`` and rewrites the generated block of
``docs/mutation.md`` (between the ``<!-- mutation:begin -->`` and
``<!-- mutation:end -->`` markers): killed, survived, timeout, no tests and
the score per package, plus the list of survivors to triage. A mutant that
no selected test executes ("no tests") counts as surviving; a timeout counts
as killed (the mutant made the suite hang), as mutmut's own score does.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "mutation.md"
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"
LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+__mutmut_\d+): (?P<status>.+)$")


def collect(text: str) -> dict[str, Counter]:
    by_package: dict[str, Counter] = defaultdict(Counter)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            by_package[m["name"].split(".", 1)[0]][m["status"].strip()] += 1
    return by_package


def survivors(text: str) -> list[str]:
    return [m["name"] for line in text.splitlines() if (m := LINE.match(line)) and m["status"].strip() in ("survived", "no tests")]


def render(text: str) -> str:
    rows = ["| package | mutants checked | killed | timeout | survived | no tests | not checked | score |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for package, c in sorted(collect(text).items()):
        total = sum(c.values()) - c["skipped"] - c["not checked"]
        killed = c["killed"] + c["timeout"]
        score = 100.0 * killed / total if total else 0.0
        rows.append(f"| {package}/ | {total} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} "
                    f"| {c['not checked']} | {score:.1f}% |")
    lines = [BEGIN, "", *rows, "", "Survivors (triaged below):", ""]
    lines += [f"- `{name}`" for name in survivors(text)] or ["- none"]
    return "\n".join(lines + ["", END])


def main() -> int:
    proc = subprocess.run([str(Path(sys.executable).parent / "mutmut"), "results", "--all", "true"],
                          check=False, capture_output=True, text=True)
    block = render(proc.stdout)
    doc = DOC.read_text() if DOC.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc += "\n" + block + "\n"
    DOC.write_text(doc)
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
