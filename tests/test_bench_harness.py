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

from kvspec.fuzz.commands import bench_harness as bh
from kvspec.fuzz.lockstep import Divergence
from kvspec.fuzz.trace import loads
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


def _with_expects(trace):
    """The trace's ops followed by ``expect`` ops pinning every window the
    spec holds at the end (the floors count them as ops and skip them)."""
    from kvspec.fuzz.replay import make_lockstep

    lock = make_lockstep(dict(trace.cache))
    for i, op in enumerate(trace.ops):
        lock.step(i, op)
    return list(trace.ops) + lock.expect_ops()


OPS = _with_expects(TRACE)
RUNS = [(TRACE.cache, OPS)]


def test_the_json_follows_its_schema_and_every_pass_measured_the_campaigns_ops():
    proc = kvspec("bench", "--harness", "--only", "dense/fp16/copy", "--batches", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    schema = json.loads((SCHEMAS / "bench.schema.json").read_text())
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    [row] = doc["harness"]
    assert row["config"] == "dense/fp16/copy" and doc["batches"] == 2
    assert row["examples"] == 50 and row["ops"] > 500  # two batches of 25 examples
    assert doc["passes"] == list(bh.PASSES)
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


def test_a_rate_not_measured_is_a_dash_in_the_table_and_null_in_json(monkeypatch, capsys):
    """No time after the first batch measures no warm rate: "-" and null, never 0."""
    monkeypatch.setattr(bh, "record_campaign", lambda *a: (_Report(1000, 4.0), [], None))
    monkeypatch.setattr(bh, "replay_lockstep", lambda runs: (1000, 0.5))
    monkeypatch.setattr(bh, "replay_floor", lambda runs, reads: (1000, 0.1, 0.4))
    measure = bh.measure
    row = measure("dense", "fp16", True, batches=1, seed=1)
    assert row.campaign_ops_s is None and row.campaign_all_ops_s == 250
    monkeypatch.setattr(bh, "measure", lambda *c, batches: row)
    assert bh.run(["dense/fp16/copy"], batches=2) == 0
    cells = next(line for line in capsys.readouterr().out.splitlines() if "dense/fp16/inplace" in line)
    assert [c.strip() for c in cells.strip("│┃ ").split("│")][2:4] == ["250", "-"]
    assert bh.run(["dense/fp16/copy"], batches=2, as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, json.loads((SCHEMAS / "bench.schema.json").read_text()),
                        cls=jsonschema.Draft202012Validator)
    assert doc["harness"][0]["campaign_ops_s"] is None
    # no op run: no rate at all, whatever the seconds
    monkeypatch.setattr(bh, "record_campaign", lambda *a: (_Report(0, 4.0), [], None))
    monkeypatch.setattr(bh, "replay_lockstep", lambda runs: (0, 0.5))
    monkeypatch.setattr(bh, "replay_floor", lambda runs, reads: (0, 0.1, 0.4))
    empty = measure("dense", "fp16", True, batches=1, seed=1)
    assert all(getattr(empty, p + "_ops_s") is None for p in bh.PASSES)


def test_the_lockstep_pass_runs_every_op_through_the_checks(monkeypatch):
    assert bh.replay_lockstep(RUNS)[0] == len(OPS)
    from kvspec.impl.dense import KVCache

    monkeypatch.setattr(
        KVCache, "trim", lambda self, n: 0
    )  # trims nothing: the window check sees it
    with pytest.raises(Divergence):
        bh.replay_lockstep(RUNS)


def test_the_floors_run_every_op_without_the_mask_checks():
    seen: list[str] = []
    from kvspec.fuzz.dense import DenseLockstep

    own = DenseLockstep.impl_apply

    def spy(self, op):
        seen.append(op["op"])
        return own(self, op)

    DenseLockstep.impl_apply = spy
    try:
        for reads in (False, True):
            seen.clear()
            ops, spec_s, impl_s = bh.replay_floor(RUNS, reads=reads)
            assert ops == len(OPS) and spec_s > 0 and impl_s > 0
            # the refused restore too; the expect ops are counted, not run
            assert seen == [op["op"] for op in TRACE.ops]
    finally:
        DenseLockstep.impl_apply = own
    from kvspec.fuzz.replay import make_lockstep

    lock = make_lockstep(dict(TRACE.cache))
    lock.step(0, TRACE.ops[0])
    assert lock.stats.get("dense masks checked")  # what the floors leave out is a check


def test_a_floor_refuses_an_op_the_implementation_could_not_run(monkeypatch):
    from kvspec.fuzz.dense import DenseLockstep

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
        (["--harness", "--e2e"], ["--harness", "--e2e"]),
        (["--harness", "--record", "x"], ["--harness", "--record"]),
        (["--harness", "--plot", "x.json"], ["--harness", "--plot"]),
        (["--harness", "--contexts", "16"], ["--harness", "--contexts"]),
        (["--harness", "--batches", "x"], ["--batches", "'x'"]),
        (["--batches", "4"], ["--batches", "--harness"]),
        (["--harness", "--only", ""], ["--only", "must not be empty"]),
        (["--harness", "--only", "nosuch", "pagd"], ["did you mean 'paged'"]),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, words):
    proc = kvspec("bench", *argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = " ".join((proc.stdout + proc.stderr).split())
    assert "Traceback" not in text
    for word in words:
        assert word in text


# -- the figures: each pass under its own name, from its own seconds ----------
class _Report:
    def __init__(self, ops, seconds, examples=50):
        self.stats, self.seconds, self.examples, self.failure = (
            {"ops": ops},
            seconds,
            examples,
            None,
        )


def test_measure_puts_each_pass_under_its_name(monkeypatch):
    calls: list[bool] = []
    floors = {
        False: [(0.2, 0.5), (0.1, 0.4), (0.3, 0.6)],
        True: [(0.3, 2.0), (0.2, 1.8), (0.25, 1.9)],
    }

    def floor(runs, reads):
        calls.append(reads)
        spec_s, impl_s = floors[reads][sum(1 for r in calls if r == reads) - 1]
        return 1000, spec_s, impl_s

    monkeypatch.setattr(bh, "record_campaign", lambda *a: (_Report(1000, 4.0), [], 300.0))
    monkeypatch.setattr(bh, "replay_lockstep", lambda runs: (1000, 0.5))
    monkeypatch.setattr(bh, "replay_floor", floor)
    row = bh.measure("dense", "fp16", True, batches=3, seed=1)
    assert calls == [False, True] * bh.FLOOR_REPEATS  # alternated
    assert (row.config, row.examples, row.ops) == ("dense/fp16/inplace", 50, 1000)
    # every figure different: a swap, an inversion or a wrong run kept shows
    assert (
        row.campaign_all_ops_s == 250 and row.campaign_ops_s == 300 and row.lockstep_ops_s == 2000
    )
    assert row.reads_ops_s == pytest.approx(500)  # the fastest reads run: 0.2 + 1.8 s
    assert row.spec_impl_ops_s == pytest.approx(2000)  # the fastest: 0.1 + 0.4 s
    assert row.impl_ops_s == pytest.approx(2500) and row.spec_ops_s == pytest.approx(10000)


def test_measure_refuses_a_floor_of_other_ops(monkeypatch):
    monkeypatch.setattr(bh, "record_campaign", lambda *a: (_Report(1000, 4.0), [], 300.0))
    monkeypatch.setattr(bh, "replay_lockstep", lambda runs: (1000, 0.5))
    monkeypatch.setattr(bh, "replay_floor", lambda runs, reads: (999, 0.1, 0.1))
    with pytest.raises(RuntimeError, match="a floor replayed 999 ops of 1000"):
        bh.measure("dense", "fp16", True, batches=3, seed=1)


def test_the_seconds_add_up_over_every_run(monkeypatch):
    from types import SimpleNamespace

    ticks = iter(range(10**6))
    monkeypatch.setattr(bh, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    # one tick per run's timed block in the lockstep pass; one tick for the
    # spec and one for the implementation per op run in a floor
    assert bh.replay_lockstep(RUNS * 3) == (3 * len(OPS), 3.0)
    run_ops = len(TRACE.ops)  # the expect ops are not run
    for reads in (False, True):
        assert bh.replay_floor(RUNS * 2, reads=reads) == (
            2 * len(OPS),
            2.0 * run_ops,
            2.0 * run_ops,
        )


def test_the_warm_rate_leaves_the_first_batch_out(monkeypatch):
    class FakeCampaign:
        def __init__(self, kind, mode, inplace, seed, **kw):
            self.machine = type("M", (), {"teardown": lambda self: None, "last_run": ({}, [])})
            self.reports = iter([_Report(100, 1.0), _Report(300, 2.0), _Report(600, 4.0)])

        def batch(self):
            return next(self.reports)

    monkeypatch.setattr(bh, "Campaign", FakeCampaign)
    rep, runs, warm = bh.record_campaign("dense", "fp16", True, 3, 1)
    assert (rep.stats["ops"], rep.seconds, runs) == (600, 4.0, [])
    assert warm == pytest.approx((600 - 100) / (4.0 - 1.0))

    class Stuck(FakeCampaign):  # no time after the first batch: no rate, not a division by zero
        def batch(self):
            return _Report(100, 1.0)

    monkeypatch.setattr(bh, "Campaign", Stuck)
    assert bh.record_campaign("dense", "fp16", True, 2, 1)[2] is None  # not a rate of 0 ops/s


def test_a_failed_campaign_is_refused_not_measured(monkeypatch):
    from kvspec.impl.dense import KVCache

    monkeypatch.setattr(KVCache, "trim", lambda self, n: 0)
    with pytest.raises(RuntimeError, match="the campaign failed"):
        bh.record_campaign("dense", "fp16", False, 2, 1)


# -- the table and --only ------------------------------------------------------
def test_each_column_sits_under_its_header(monkeypatch, capsys):
    row = bh.HarnessRow("dense/fp16/copy", 50, 3000, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    monkeypatch.setattr(bh, "measure", lambda *c, batches: row)
    assert bh.run(["dense/fp16/copy"], batches=2) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    cells = next(line for line in lines if "dense/fp16/copy" in line)
    names = [c.strip() for c in header.strip("┃").split("┃")]
    values = [c.strip() for c in cells.strip("│").split("│")]
    assert dict(zip(names, values, strict=True)) == {
        "campaign": "dense/fp16/copy",
        "ops": "3,000",
        "all batches": "1",
        "warm": "2",
        "no engine": "3",
        "reads only": "4",
        "spec+impl": "5",
        "impl": "6",
    }


@pytest.mark.parametrize(
    "only, labels",
    [
        (["layers"], ["layers/fp16/inplace", "layers/fp16/copy", "layers/int8/inplace"]),
        (["int8"], ["dense/int8/inplace", "layers/int8/inplace", "models/int8/inplace"]),
        (["nosuch", "paged"], ["paged/fp16/inplace", "paged/fp16/copy"]),
        (["rotating/fp16/copy", "dense/turbo4/"], ["dense/turbo4/inplace", "rotating/fp16/copy"]),
        (None, [bh.label(*c) for c in bh.configs()]),
    ],
)
def test_only_picks_every_campaign_whose_label_holds_a_word(monkeypatch, capsys, only, labels):
    seen: list[str] = []

    def fake(kind, mode, inplace, batches):
        seen.append(bh.label(kind, mode, inplace))
        return bh.HarnessRow(seen[-1], 50, 10, *([1.0] * 7))

    monkeypatch.setattr(bh, "measure", fake)
    assert bh.run(only, batches=2, as_json=True) == 0
    assert seen == labels
    assert [r["config"] for r in json.loads(capsys.readouterr().out)["harness"]] == labels


def test_the_schema_requires_every_field_and_no_other():
    import dataclasses

    schema = json.loads((SCHEMAS / "bench.schema.json").read_text())
    fields = [f.name for f in dataclasses.fields(bh.HarnessRow)]
    row = dict(zip(fields, ["dense/fp16/copy", 50, 1000, *([1.0] * 7)], strict=True))
    good = {"harness": [row], "batches": 3, "passes": list(bh.PASSES)}
    jsonschema.validate(good, schema, cls=jsonschema.Draft202012Validator)
    bad = [
        *({**good, "harness": [{k: v for k, v in row.items() if k != f}]} for f in fields),
        {**good, "harness": [{**row, "extra_ops_s": 1.0}]},
        {**good, "passes": list(bh.PASSES)[1:]},
        {**good, "harness": []},
        {k: v for k, v in good.items() if k != "batches"},
    ]
    for doc in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


# -- every kind: the floors run its ops and make no mask check ------------------
@pytest.mark.parametrize(
    "kind, mode, inplace",
    [
        ("rotating", "fp16", True),
        ("layers", "int8", True),
        ("paged", "fp16", False),
        ("dense", "turbo4", True),
    ],
)
def test_the_floors_of_every_kind_skip_the_mask_checks_and_advance_the_world(
    monkeypatch, kind, mode, inplace
):
    from kvspec.fuzz.commands.verify import CAMPAIGN_SEED
    from kvspec.fuzz.replay import make_lockstep

    _, runs, _ = bh.record_campaign(kind, mode, inplace, 1, CAMPAIGN_SEED)
    runs = [r for r in runs if len(r[1]) > 3][:4]
    assert runs, "the campaign ran no example of more than three ops"
    lock_type = type(make_lockstep(dict(runs[0][0])))

    def no_mask_check(self, op):
        raise AssertionError("a floor made a mask check")

    monkeypatch.setattr(lock_type, "before_append", no_mask_check)
    monkeypatch.setattr(lock_type, "check_mask", no_mask_check, raising=False)
    # each op's spec runs on the world the previous accepted op returned
    own_spec = lock_type.spec_apply
    last: dict[int, object] = {}
    alive: list[object] = []  # each lockstep kept, so that no id is reused

    def spec_apply(self, op):
        if id(self) in last:
            assert self.world is last[id(self)], f"op {op} ran on a stale world"
        result, world = own_spec(self, op)
        last[id(self)] = world
        alive.append(self)
        return result, world

    monkeypatch.setattr(lock_type, "spec_apply", spec_apply)
    for reads in (False, True):
        last.clear()
        assert bh.replay_floor(runs, reads=reads)[0] == sum(len(ops) for _, ops in runs)
        assert len(last) == len(runs)  # every run's lockstep reached the spec


def test_the_reads_floor_reads_every_window_and_the_other_none(monkeypatch):
    from kvspec.fuzz.dense import DenseLockstep

    calls: list[int] = []
    own = DenseLockstep.impl_views

    def spy(self):
        calls.append(1)
        return own(self)

    monkeypatch.setattr(DenseLockstep, "impl_views", spy)
    bh.replay_floor(RUNS, reads=False)
    assert calls == []
    bh.replay_floor(RUNS, reads=True)
    assert len(calls) == len(TRACE.ops)  # once after every op run (a refused one too)
