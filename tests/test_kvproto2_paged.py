"""kvproto/2's paged kind (docs/kvproto.md, "Paged pools"), with the
Python adapter tests/kvproto2_paged.py: a block pool whose windows are
read back from its blocks.

It passes every paged trace of tests/traces/ whose ops go over the
protocol (the rest are refused with the reason); each planted fault (no
copy-on-write, a refcount, the masks, the copied blocks, a block table) is
a divergence at the op it starts at; with ``inplace`` undeclared (block ids
not compared) a wrong refcount is still caught by the pool invariants on
what the adapter reports; ``kvspec fuzz`` finds the missing copy-on-write
and shrinks it to a fork and a write."""

from __future__ import annotations

import json
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

from kvspec.fuzz.adapters import exec as ex
from kvspec.fuzz.commands.cli import main
from kvspec.fuzz.replay import replay
from kvspec.fuzz.targets import resolve
from kvspec.fuzz.trace import TraceFormatError, load, loads

REPO = Path(__file__).resolve().parent.parent
ADAPTER = Path(__file__).resolve().parent / "kvproto2_paged.py"


def adapter(*args: str) -> str:
    return "exec:" + " ".join([sys.executable, str(ADAPTER), *args])


@cache
def target(*args: str) -> ex.ExecTarget:
    """The adapter with ``args`` as a target (its hello answered once)."""
    return resolve(adapter(*args))


def paged_traces() -> list[Path]:
    out = []
    for path in sorted((REPO / "tests" / "traces").rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("cache"), dict) and doc["cache"].get("kind") == "paged":
            out.append(path)
    return out


@pytest.fixture(autouse=True, scope="module")
def _sessions():
    yield
    ex.close_sessions()


def test_the_paged_adapter_passes_the_paged_traces():
    target = resolve(adapter())
    assert target.version == 2 and set(target.declared) == {"paged"}
    passed, refused, masks = [], [], 0
    for path in paged_traces():
        try:
            result = replay(load(path), target=target)
        except TraceFormatError as exc:
            # rows of another shape or dtype are built on the Python side only
            assert "append_mismatch" in str(exc) and "not among the ops its hello declares" in str(exc), exc
            refused.append(path.name)
            continue
        assert result.ok, f"{path.name}: {result.divergence}"
        assert result.not_compared == [], (path.name, result.not_compared)
        masks += result.stats.get("masks checked", 0)
        passed.append(path.name)
    assert len(passed) >= 15 and "worked_paged_fork_cow.json" in passed and masks >= 15, (passed, masks)
    assert refused == ["paged_dtype_unchecked.json"], refused


#: blocks of 2 rows: main holds blocks 0 and 1, the fork shares both, its write lands in block 1
FORK_WRITE = [{"op": "append", "n": 3}, {"op": "fork", "from": "main", "as": "b"}, {"op": "append", "n": 1, "seq": "b"}]
#: blocks of 4 rows: the fork takes a row back and writes where main still reads (position 2 of block 0)
FORK_REWRITE = [{"op": "append", "n": 3}, {"op": "fork", "from": "main", "as": "b"}, {"op": "trim", "n": 1, "seq": "b"},
                {"op": "append", "n": 1, "seq": "b"}]

#: fault (adapter arguments) -> (block size, ops, the op index it diverges at, what)
PLANTED = {
    "no_cow": ([], 2, FORK_WRITE, 2, "blocks allocated / copied on write differ"),
    "copied": ([], 2, FORK_WRITE, 2, "blocks allocated / copied on write differ"),
    "refcount": ([], 2, FORK_WRITE, 1, "refcounts differs"),
    "table": ([], 2, FORK_WRITE, 1, "sequences differs"),
    "mask": ([], 2, [{"op": "append", "n": 2}], 0, "make_mask(2, window_size=1)"),
    # block ids unobserved: the refcount is not compared, the pool it reports is still checked
    "refcount ": (["--no-inplace"], 2, FORK_WRITE, 1, "pool invariants broken on the adapter"),
    # and a write into a shared block shows in the other sequence's window
    "no_cow ": (["--no-inplace"], 4, FORK_REWRITE, 3, "view of seq:main changed"),
}


@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_each_planted_pool_fault_is_a_divergence_at_its_op(fault):
    args, block_size, ops, index, what = PLANTED[fault]
    doc = {"kvtrace": 1, "cache": {"kind": "paged", "block_size": block_size, "kv_heads": 1, "head_dim": 2},
           "ops": ops}
    trace = loads(json.dumps(doc))
    assert replay(trace, target=target(*args)).ok
    result = replay(trace, target=target(*args, "--fault", fault.strip()))
    assert not result.ok and result.divergence.index == index and result.divergence.what.startswith(what), \
        result.divergence


def test_fuzz_finds_the_missing_copy_on_write_and_shrinks_it(capsys, tmp_path):
    target = adapter("--fault", "no_cow")
    code = main(["fuzz", "--target", target, "--examples", "25", "--seed", "1", "--inplace", "on",
                 "--out", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1, report
    run0 = report["runs"][0]
    assert run0["result"] == "FAILED" and "copied on write" in run0["failure"], run0
    trace = load(run0["trace"])
    ops = [op for op in trace.ops if op["op"] != "expect"]
    assert [op["op"] for op in ops] == ["append", "fork", "append"], ops
    assert main(["replay", run0["trace"], "--target", adapter()]) == 0
    assert main(["replay", run0["trace"]]) == 0  # and on our pool
    # the printed replay command, split as a shell splits it, runs the same adapter (its arguments
    # quoted): the faulty one diverges again
    words = shlex.split(run0["replay"])
    assert words[:2] == ["kvspec", "replay"] and words[words.index("--target") + 1] == target, words
    assert main(words[1:]) == 1
