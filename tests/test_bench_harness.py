"""``kvspec bench --harness`` (fuzz/commands/bench_harness.py): every pass
replays the very ops the campaign ran, the lockstep pass runs every check
(a broken implementation diverges there), the floors run the ops without
the checks and refuse to measure an op the implementation could not run,
and bad arguments exit 2. Structure only: the figures come from ``make
bench``, never from a timed unit test."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fuzz.commands import bench_harness as bh
from fuzz.lockstep import Divergence
from fuzz.trace import loads
from tests.test_reports import SCHEMAS, kvspec

TRACE = loads(
    json.dumps(
        {
            "kvtrace": 1,
            "cache": {"kind": "dense", "mode": "fp16", "step": 2},
            "ops": [
                {"op": "append", "n": 3},
                {"op": "snapshot", "name": "s"},
                {"op": "append", "n": 2},
                {"op": "trim", "n": 2},
                {"op": "append", "n": 1},
                {"op": "restore", "name": "s"},
                {"op": "restore", "name": "nobody"},
                {"op": "fetch"},
            ],
        }
    )
)
RUNS = [(TRACE.cache, TRACE.ops)]


def test_the_json_follows_its_schema_and_every_pass_measured_the_campaigns_ops():
    proc = kvspec("bench", "--harness", "--only", "dense/fp16/copy", "--batches", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    schema = json.loads((SCHEMAS / "bench.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    [row] = doc["harness"]
    assert row["config"] == "dense/fp16/copy" and doc["batches"] == 2
    assert row["examples"] == 50 and row["ops"] > 500  # two batches of 25 examples
    assert all(row[p + "_ops_s"] > 0 for p in doc["passes"]) and row["spec_ops_s"] > 0


def test_the_table_names_every_column(monkeypatch, capsys):
    row = bh.HarnessRow("dense/fp16/copy", 50, 3000, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    monkeypatch.setattr(bh, "measure", lambda *c, batches: row)
    assert bh.run(["dense/fp16/copy"], batches=2) == 0
    out = capsys.readouterr().out
    for word in ("all batches", "warm", "no engine", "reads only", "spec+impl", "impl", "3,000"):
        assert word in out
    cells = next(line for line in out.splitlines() if "dense/fp16/copy" in line)
    assert [c.strip() for c in cells.strip("│┃ ").split("│")][2:] == ["1", "2", "3", "4", "5", "6"]


def test_the_lockstep_pass_runs_every_op_through_the_checks(monkeypatch):
    assert bh.replay_lockstep(RUNS)[0] == len(TRACE.ops)
    from impl.dense import KVCache

    monkeypatch.setattr(
        KVCache, "trim", lambda self, n: 0
    )  # trims nothing: the window check sees it
    with pytest.raises(Divergence):
        bh.replay_lockstep(RUNS)


def test_the_floors_run_every_op_without_the_mask_checks():
    seen: list[str] = []
    from fuzz.dense import DenseLockstep

    own = DenseLockstep.impl_apply

    def spy(self, op):
        seen.append(op["op"])
        return own(self, op)

    DenseLockstep.impl_apply = spy
    try:
        for reads in (False, True):
            seen.clear()
            ops, spec_s, impl_s = bh.replay_floor(RUNS, reads=reads)
            assert ops == len(TRACE.ops) and spec_s > 0 and impl_s > 0
            assert seen == [op["op"] for op in TRACE.ops]  # the refused restore too
    finally:
        DenseLockstep.impl_apply = own
    from fuzz.replay import make_lockstep

    lock = make_lockstep(dict(TRACE.cache))
    lock.step(0, TRACE.ops[0])
    assert lock.stats.get("dense masks checked")  # what the floors leave out is a check


def test_a_floor_refuses_an_op_the_implementation_could_not_run(monkeypatch):
    from fuzz.dense import DenseLockstep

    own = DenseLockstep.impl_apply

    def broken(self, op):
        if op["op"] == "trim":
            raise AttributeError("no such field")
        return own(self, op)

    monkeypatch.setattr(DenseLockstep, "impl_apply", broken)
    with pytest.raises(RuntimeError, match="which the spec ran"):
        bh.replay_floor(RUNS, reads=False)


def test_measure_refuses_a_replay_of_other_ops(monkeypatch):
    monkeypatch.setattr(bh, "replay_lockstep", lambda runs: (1, 1.0))
    with pytest.raises(RuntimeError, match="replayed 1 ops"):
        bh.measure("dense", "fp16", False, batches=2)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--harness", "--only", "pagd"], ["--only pagd", "did you mean 'paged'"]),
        (["--harness", "--batches", "1"], ["--batches", "[2, 100]"]),
        (["--only", "paged"], ["--only", "--harness"]),
        (["--harness", "--decoder"], ["--harness", "--decoder"]),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, words):
    proc = kvspec("bench", *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "Traceback" not in text
    for word in words:
        assert word in text
