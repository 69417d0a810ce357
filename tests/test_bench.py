"""``kvspec bench`` runs end to end on tiny contexts and reports every row
with its last/first ratio (structure only: timings are never asserted in a
unit test; the figures come from ``make bench``)."""

import json

from fuzz.commands import bench


def test_bench_reports_every_row_and_ratio(capsys, monkeypatch):
    monkeypatch.setattr(bench, "ROUNDS", 3)
    assert bench.run([16, 48], as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    keys = [key for _, key in bench.ROWS]
    assert doc["contexts"] == [16, 48]
    assert [c["context"] for c in doc["rows"]] == [16, 48]
    for col in doc["rows"]:
        assert all(col[k] > 0 for k in keys)
    first, last = doc["rows"]
    assert doc["ratio_last_over_first"] == {k: last[k] / first[k] for k in keys}


def test_interleaved_takes_rounds_round_robin_after_a_warmup():
    calls: list[str] = []

    def tick(name):
        def f():
            calls.append(name)
            return {"a": 1.0, "b": 2.0}[name]
        return f

    assert bench._interleaved([tick("a"), tick("b")], rounds=3, warmup=2) == [1.0, 2.0]
    assert calls[:4] == ["a", "a", "b", "b"]  # the warm-up, untimed
    assert calls[4:] == ["a", "b", "b", "a", "a", "b"]  # each round starts one further on


def test_interleaved_gives_each_tick_its_own_times():
    """Three ticks, so a median of times filed under the call's slot rather
    than the tick that made them cannot come out right by symmetry."""
    ticks = [lambda v=v: v for v in (1.0, 2.0, 3.0)]
    for rounds in (3, 4):
        assert bench._interleaved(ticks, rounds=rounds, warmup=0) == [1.0, 2.0, 3.0]


def test_each_row_measures_its_own_operation(capsys, monkeypatch):
    from fuzz.bugs.dense import PhysicalTrimFp16
    from impl.dense import KVCache

    monkeypatch.setattr(bench, "ROUNDS", 2)
    monkeypatch.setattr(bench, "_decode_round", lambda n, inplace: (lambda: 1.0 if inplace is True else 2.0))
    which = {KVCache: 3.0, PhysicalTrimFp16: 4.0}
    monkeypatch.setattr(bench, "_rollback_round", lambda cls, n: (lambda: which[cls]))
    assert bench.run([16, 48], as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    for col in doc["rows"]:
        assert (col["decode_inplace_ms"], col["decode_copy_ms"], col["rollback_logical_ms"],
                col["rollback_physical_ms"]) == (1e3, 2e3, 3e3, 4e3)
