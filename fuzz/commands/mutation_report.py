"""Summarise a mutmut run (``make mutation``) per package, with the triage.

Reads ``mutmut results --all true`` and rewrites the generated block of
``docs/mutation.md`` (between the ``<!-- mutation:begin -->`` and
``<!-- mutation:end -->`` markers):

* per package: killed, timeout, crashed, survived, no tests, not checked and
  the score. A mutant is *detected* when the selected tests do not pass on
  it: killed (a test failed), timeout (the suite hung) or crashed (the test
  process died: a segfault, or an exit status mutmut calls "suspicious").
  score = detected / checked; "no tests" counts as surviving.
* every survivor with the line it changes and its triage verdict from
  :data:`TRIAGE`: the Z3 check in ``proofs/equivalents.py`` that proves it
  equivalent, or the section of ``docs/mutation.md`` that argues it. A
  survivor no entry covers is listed as **not triaged**, and the exit
  status is then 1 (so ``make mutation`` fails until it is triaged).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from kvspec.fuzz.commands.mutation_triage import TRIAGE_BATCH, TRIAGE_WHOLE_TREE
from kvspec.fuzz.commands.mutation_verdict import (
    EVAL,
    IDENT,
    LABELS,
    MARKER,
    Verdict,
    stale_verdicts,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "mutation.md"
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"
LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+__mutmut_\d+): (?P<status>.+)$")
DETECTED = ("killed", "timeout", "segfault", "suspicious")


Z3 = "Proved equivalent by Z3"

#: One entry per surviving mutant (see Verdict), matched on the function
#: and the exact mutated line, so that a new mutant, or an old one after its
#: line changed, shows up as not triaged. Kept next to the arguments in
#: docs/mutation.md; tests/test_mutation_report.py checks that every Z3 name
#: exists and every section is a heading of that page.
TRIAGE: tuple[Verdict, ...] = (
    # spec: buffer identities only ever meet the marker
    Verdict("spec.dense.x__with_new_buffer",
            "return replace(cache, buffer=Buffer(cache.next_ident, capacity), next_ident=cache.next_ident - 1)", IDENT),
    Verdict("spec.dense.x__with_new_buffer",
            "return replace(cache, buffer=Buffer(cache.next_ident, capacity), next_ident=cache.next_ident + 2)", IDENT),
    Verdict("spec.rotating.x__new_buffer",
            "return replace(cache, slots=slots, ident=cache.next_ident, next_ident=cache.next_ident - 1)", IDENT),
    Verdict("spec.rotating.x__new_buffer",
            "return replace(cache, slots=slots, ident=cache.next_ident, next_ident=cache.next_ident + 2)", IDENT),
    Verdict("spec.rotating.x_decode",
            "cache = replace(cache, slots=slots) if (inplace) or True else _new_buffer(cache, slots)", IDENT),
    Verdict("spec.dense.x_w_detach", "empty = DenseCache(mode=c.mode, step=c.step, inplace=c.inplace, )", IDENT),
    Verdict("spec.rotating.x_trim", "cache = replace(cache, slots=(), ident=None, )", IDENT),
    # spec: the marker a multi-row append records is never consulted
    Verdict("spec.rotating.x_prefill", "cache = replace(cache, marker=None)", MARKER),
    Verdict("spec.rotating.x_prefill", "cache = replace(cache, )", MARKER),
    Verdict("spec.rotating.x_prefill", "cache = replace(cache, marker=RingMarker(None, cache.idx))", MARKER),
    Verdict("spec.rotating.x_prefill", "cache = replace(cache, marker=RingMarker(cache.ident, None))", MARKER),
    # integer arithmetic, proved
    Verdict("spec.rotating.x_visible_positions", "if offset < max_size:", Z3, "visible_at_window"),
    Verdict("impl.rotating.xǁRotatingKVCacheǁ_inplace_write_allowed", "and self.offset <= self.max_size", Z3,
            "inplace_offset_bound"),
    Verdict("spec.rotating.x_decode", "if cache.idx >= cache.capacity and cache.capacity <= W:", Z3, "grow_at_window"),
    Verdict("spec.rotating.x_decode",
            "cache = replace(_new_buffer(cache, cache.slots[:K] + cache.slots[cache.capacity - (W - K):]), )", Z3,
            "cut_cursor"),
    Verdict("spec.rotating.x_prefill", "if len(old) >= budget:", Z3, "prefill_guard"),
    Verdict("impl.rotating.xǁRotatingKVCacheǁ_prefill", "if kept >= budget:", Z3, "prefill_guard"),
    Verdict("spec.rotating.x_prefill",
            "old = old[:sinks] + old[len(old) - (budget - sinks):] if budget >= sinks else old[:budget]", Z3,
            "prefill_sinks"),
    Verdict("spec.rotating.x_prefill",
            "old = old[:sinks] + old[len(old) - (budget - sinks):] if (budget > sinks) or True else old[:budget]", Z3,
            "prefill_sinks"),
    Verdict("spec.dense.x_is_empty", "return cache.offset == 0 or cache.live_start == 0 and cache.buffer is None", Z3,
            "is_empty"),
    # labels nobody reads, asserts that only narrow types, equal operands
    Verdict("spec.dense.x_w_append", 'returned = holder_of(cache, None)', LABELS),
    Verdict("spec.dense.x_w_append", 'returned = holder_of(cache, "XXheldXX")', LABELS),
    Verdict("spec.dense.x_w_append", 'returned = holder_of(cache, "HELD")', LABELS),
    Verdict("impl.rotating.xǁRotatingKVCacheǁ_write_row", "assert self.keys is not None or self.values is not None",
            LABELS),
    Verdict("impl.rotating.xǁRotatingKVCacheǁ_prefill", "kept = old[1].shape[SEQ_AXIS]", LABELS),
    # MLX / NumPy mechanics
    Verdict("impl.dense.x_write_rows_inplace", "mx.eval(None)", EVAL),
    Verdict("impl.dense.x_write_rows_inplace",
            "np.array(dst, copy=None)[:, :, at : at + src.shape[SEQ_AXIS], :] = src", EVAL),
) + TRIAGE_WHOLE_TREE + TRIAGE_BATCH


def verdict_for(name: str, change: str) -> Verdict | None:
    """The verdict for mutant ``name`` whose mutated line is ``change``."""
    function = name.rsplit("__mutmut_", 1)[0]
    for v in TRIAGE:
        if v.function == function and v.change == change.strip():
            return v
    return None


def collect(text: str) -> dict[str, Counter]:
    by_package: dict[str, Counter] = defaultdict(Counter)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            by_package[m["name"].split(".", 1)[0]][m["status"].strip()] += 1
    return by_package


def survivors(text: str) -> list[str]:
    return [m["name"] for line in text.splitlines() if (m := LINE.match(line)) and m["status"].strip() in ("survived", "no tests")]


def change_of(name: str, show: str) -> str:
    """The mutated line (``+`` side of ``mutmut show``), stripped."""
    plus = [ln[1:].strip() for ln in show.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return plus[0] if plus else "(no diff)"


def render(text: str, changes: dict[str, str]) -> tuple[str, int]:
    """The generated block and the number of survivors not triaged."""
    rows = ["| package | mutants checked | killed | timeout | crashed | survived | no tests | not checked | score |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for package, c in sorted(collect(text).items()):
        total = sum(c.values()) - c["skipped"] - c["not checked"]
        detected = sum(c[s] for s in DETECTED)
        score = 100.0 * detected / total if total else 0.0
        rows.append(f"| {package}/ | {total} | {c['killed']} | {c['timeout']} | {c['segfault'] + c['suspicious']} "
                    f"| {c['survived']} | {c['no tests']} | {c['not checked']} | {score:.1f}% |")
    lines = [BEGIN, "", *rows, "", "Survivors and their triage:", ""]
    names = survivors(text)
    untriaged = 0
    if names:
        lines += ["| mutant | mutated line | verdict |", "| --- | --- | --- |"]
        for name in names:
            change = changes.get(name, "")
            v = verdict_for(name, change)
            untriaged += v is None
            shown = change.replace("|", "\\|")
            lines.append(f"| `{name}` | `{shown}` | {v.text() if v else '**not triaged**'} |")
    else:
        lines.append("- none")
    return "\n".join(lines + ["", END]), untriaged


def _diff(mutmut: str, name: str) -> str:
    """``mutmut show NAME``'s diff, from mutmut's own function in this process
    (a ``mutmut show`` process costs about 0.5 s, and a whole-tree run leaves
    hundreds of survivors); the command itself where that function is not there."""
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant
    except ImportError:
        return subprocess.run([mutmut, "show", name], check=False, capture_output=True, text=True).stdout
    module = name.rpartition(".")[0]
    return get_diff_for_mutant(name, path=Path(*module.split(".")).with_suffix(".py"))


def main() -> int:
    mutmut = str(Path(sys.executable).parent / "mutmut")
    proc = subprocess.run([mutmut, "results", "--all", "true"], check=False, capture_output=True, text=True)
    changes = {}
    for name in survivors(proc.stdout):
        changes[name] = change_of(name, _diff(mutmut, name))
    block, untriaged = render(proc.stdout, changes)
    codes: dict[str, object] = {}
    for meta in Path("mutants").rglob("*.py.meta"):
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    stale = stale_verdicts(Path.cwd(), codes, verdict_for, {v.function for v in TRIAGE})
    doc = DOC.read_text() if DOC.exists() else f"# Mutation testing\n\n{BEGIN}\n{END}\n"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc += "\n" + block + "\n"
    DOC.write_text(doc)
    print(block)
    for name in stale:
        print(f"stale verdict: {name} was detected, but its verdict says no test can kill it: remove the "
              "Verdict (or correct its argument)", file=sys.stderr)
    if untriaged:
        print(f"\n{untriaged} survivor(s) not triaged: kill them with a test or argue them in docs/mutation.md "
              "and add a Verdict to fuzz/commands/mutation_report.py TRIAGE", file=sys.stderr)
        return 1
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
