"""kvproto/2 and ``kvspec adapter check`` held against faults an engine's
adapter really has, each one the existing fixed traces let through:

* a ring whose masks are only as wide as its buffer (an ``[n, W]`` mask
  buffer): every mask column is compared, the keys past the ring's
  capacity that a multi-row append returns included;
* a ring whose partial rollback of a multi-row append forgets to shorten
  the append's undo record: the rows a trim can still take back
  (``trimmable_rows``) after the rollback;
* a ring whose undo log forgets the row a decode overwrote, found by a
  campaign (which must draw the undo depth of a ring that declares it);
* a pool that reports its free list in another order than it takes blocks
  from it, or an append's fresh blocks in another order: both compared as
  lists, not as sets;
* a ring without sinks (no ``keep`` declared) fuzzed at keep 0, not refused;
* ``kvspec adapter check`` on a kvproto/2 hello whose ring declares a cache
  field or an op the kind does not have: a problem (exit 1), as ``kvspec
  fuzz --target exec:`` refuses it (exit 2), not "clean"; a dense adapter
  declaring ``inplace_env`` (a dense cache field) is clean, as kvspec runs it;
* ``adapter check``: every schema clause of a hello said (a missing field
  after an unknown one), rows handed in ``wide`` checked in the dtype
  sessions, a trim that answers a boolean for its count, an exit status
  other than 0 on bye.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import loads
from tests.test_adapter_check import check, problems, write_adapter

REPO = Path(__file__).resolve().parent.parent
RING = REPO / "adapters" / "c" / "kvspec_ring.c"
PAGED = REPO / "tests" / "kvproto2_paged.py"

#: ring variants: name -> edits of adapters/c/kvspec_ring.c (each line matching once)
RING_FAULTS: dict[str, list[tuple[str, str]]] = {
    "good": [],
    # the mask rows cut to the ring's capacity W (an engine's [n, W] mask buffer)
    "mask_cap": [("            for (int j = 0; j < len; j++) putchar(",
                  "            for (int j = 0; j < len && j < G.W; j++) putchar(")],
    # a partial rollback of a multi-row append leaves the record's row count as it was
    "partial_rollback": [("        rec->rows = remaining;\n        return;", "        return;")],
    # a kvproto/2 hello with a cache field, an op the ring does not have
    # a rollback through the undo log forgets the row a decode overwrote
    "undo_decode": [("        if (rec->nsaved) s[rec->slot] = rec->saved[0];\n", "")],
    # a ring without sinks: no keep among its fields (held at 0, never sent)
    "no_keep": [('"max_size", "keep", "undo", NULL};', '"max_size", "undo", NULL};')],
    "bad_field": [('"max_size", "keep", "undo", NULL};', '"max_size", "keep", "undo", "window", NULL};')],
    "bad_op": [('\\"copy\\",\\"reload\\"]', '\\"copy\\",\\"reload\\",\\"rewind\\"]')],
}


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no system C compiler (cc)")
    out = tmp_path_factory.mktemp("ring_faults")
    procs = {}
    for name, edits in RING_FAULTS.items():
        src = RING.read_text()
        for old, new in edits:
            assert src.count(old) == 1, f"ring fault {name}: the adapter no longer has {old!r} once"
            src = src.replace(old, new)
        (out / f"{name}.c").write_text(src)
        procs[name] = subprocess.Popen([cc, "-std=c99", "-O0", "-o", str(out / name), str(out / f"{name}.c")],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        output, _ = proc.communicate()
        assert proc.returncode == 0, f"{name} does not compile: {output}"
    yield {name: str(out / name) for name in RING_FAULTS}
    ex.close_sessions()


def ring_trace(cache: dict, ops: list[dict]):
    return loads(json.dumps({"kvtrace": 1, "cache": {"kind": "rotating", "step": 1, "kv_heads": 1, "head_dim": 2,
                                                     **cache}, "ops": ops}))


@pytest.mark.parametrize(("fault", "cache", "ops", "index", "what"), [
    # W = 2, three rows at once: the append returns three keys, the mask rows have three columns
    ("mask_cap", {"max_size": 2}, [{"op": "append", "n": 3}], 0, "make_mask(3"),
    # four rows through a ring of 2 with an undo log of 4, then one taken back: three remain in the record
    ("partial_rollback", {"max_size": 2, "undo": 4}, [{"op": "append", "n": 4}, {"op": "trim", "n": 1}], 1,
     "trimmable_rows differs"),
])
def test_each_ring_fault_is_a_divergence_at_its_op(rings, fault, cache, ops, index, what):
    trace = ring_trace(cache, ops)
    assert replay(trace, target=resolve(f"exec:{rings['good']}")).ok
    result = replay(trace, target=resolve(f"exec:{rings[fault]}"))
    assert not result.ok and result.divergence.index == index and result.divergence.what.startswith(what), \
        result.divergence


def test_fuzz_draws_the_undo_depth_of_a_ring_that_declares_it(rings, capsys, tmp_path):
    """A campaign over a ring that declares ``undo`` draws the depth (the
    machine draws it for this project's ring only): the undo log that
    forgets a decode's row is found within a bounded number of examples,
    at a trim."""
    code = main(["fuzz", "--target", f"exec:{rings['undo_decode']}", "--examples", "30", "--seed", "1",
                 "--inplace", "on", "--out", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1, report
    run0 = report["runs"][0]
    assert run0["result"] == "FAILED", run0
    trace = json.loads(Path(run0["trace"]).read_text())
    assert trace["cache"].get("undo", 0) >= 1 and any(op["op"] in ("trim", "trim_to") for op in trace["ops"]), trace


def test_a_ring_without_sinks_is_fuzzed_at_keep_0(rings, capsys, tmp_path):
    """A ring adapter that does not declare ``keep`` (an engine's sliding
    window without attention sinks) is fuzzed with keep at its default, 0,
    as replay holds it: every campaign runs, none is refused."""
    code = main(["fuzz", "--target", f"exec:{rings['no_keep']}", "--examples", "25", "--seed", "1", "--out",
                 str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["runs"] and all(r["result"] == "ok" and r["steps"] > 0 for r in report["runs"]), \
        report


@pytest.mark.parametrize(("fault", "cache", "n", "what"), [
    # one row, a chunk of 3 blocks allocated, two of them left free: the free list is the order blocks are taken from it
    ("free_order", {"block_size": 1, "chunk": 3}, 1, "free differs"),
    # two rows into blocks of one row: the fresh blocks, in the order the table takes them
    ("fresh_order", {"block_size": 1}, 2, "blocks allocated / copied on write differ"),
])
def test_the_pools_lists_are_compared_in_order(fault, cache, n, what):
    """The free list and an append's fresh blocks are lists
    (docs/kvproto.md): the same blocks in another order differ."""
    doc = {"kvtrace": 1, "cache": {"kind": "paged", "kv_heads": 1, "head_dim": 2, **cache},
           "ops": [{"op": "append", "n": n}]}
    trace = loads(json.dumps(doc))
    adapter = f"exec:{sys.executable} {PAGED}"
    try:
        assert replay(trace, target=resolve(adapter)).ok
        result = replay(trace, target=resolve(f"{adapter} --fault {fault}"))
    finally:
        ex.close_sessions()
    assert not result.ok and result.divergence.index == 0 and result.divergence.what.startswith(what), \
        result.divergence


@pytest.mark.parametrize(("fault", "said"), [("bad_field", "cache fields ['window'] for kind rotating"),
                                             ("bad_op", "ops ['rewind'] for kind rotating")])
def test_adapter_check_holds_a_kvproto2_ring_to_the_registry_as_fuzz_does(rings, capsys, fault, said):
    code, doc = check(capsys, rings[fault])
    assert code == 1 and said in problems(doc) and "kvspec refuses such a hello" in problems(doc), problems(doc)
    code = main(["fuzz", "--target", f"exec:{rings[fault]}", "--examples", "1"])
    out = capsys.readouterr()
    assert code == 2 and "no " in out.out + out.err, out
    code, doc = check(capsys, rings["good"])
    assert code == 0 and doc["passed"] == ["hello"], problems(doc)


def test_a_dense_adapter_declaring_inplace_env_is_clean(tmp_path, capsys):
    path = write_adapter(tmp_path)
    text = path.read_text()
    old = '"dtype", "rows"]'
    assert text.count(old) == 1
    path.write_text(text.replace(old, '"dtype", "inplace_env", "rows"]'))
    code, doc = check(capsys, sys.executable, str(path))
    assert code == 0, problems(doc)
    assert resolve(f"exec:{sys.executable} {path}").declared["dense"].fields >= {"inplace_env"}


#: python skeleton faults: (text, replacement) pairs
PY_FAULTS = {
    # a hello that omits windows and carries a field the protocol does not have: both said
    "hello_two": [('"version": "0.1", "windows": "bytes",', '"version": "0.1", "colour": 1,')],
    # the rows handed in wide ignored (bfloat16 / float32 rows whose exponent the trace widens)
    "ignores_wide": [('cache = Cache(req["cache"], bool(req.get("wide")))', 'cache = Cache(req["cache"], False)')],
    # trim answers whether it trimmed, not how many rows
    "trim_bool": [('        return cache.trim(op["n"]), False', '        return cache.trim(op["n"]) > 0, False')],
    # leaves its read loop on bye with exit status 1
    "bye_status": [("    return 0\n\n\nif __name__", "    return 1\n\n\nif __name__")],
}


@pytest.mark.parametrize(("fault", "said"), [
    ("hello_two", ["omits the required field 'windows'", "has field 'colour'"]),
    ("ignores_wide", ["dtype bfloat16: op append n=3", "dtype float32: op append n=3", "holds rows [0, 1, '?']"]),
    ("trim_bool", ["result is true; the contract's is 1", "result is false; the contract's is 0"]),
    ("bye_status", ["sent bye; the process ended with exit status 1; the protocol wants exit status 0"]),
])
def test_adapter_check_says_each(tmp_path, capsys, fault, said):
    path = write_adapter(tmp_path)
    text = path.read_text()
    for old, new in PY_FAULTS[fault]:
        assert text.count(old) == 1, f"fault {fault}: the skeleton no longer has {old!r} once"
        text = text.replace(old, new)
    path.write_text(text)
    code, doc = check(capsys, sys.executable, str(path))
    text = " ".join(problems(doc).split())
    assert code == 1 and all(s in text for s in said), text
