"""``kvspec bench`` runs end to end on tiny contexts and reports every row
with its last/first ratio (structure only: timings are never asserted in a
unit test; the figures come from ``make bench``)."""

import json

import jsonschema
import pytest

from kvspec.fuzz.commands import bench


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
    from kvspec.fuzz.bugs.dense import PhysicalTrimFp16
    from kvspec.impl.dense import KVCache

    monkeypatch.setattr(bench, "ROUNDS", 2)
    monkeypatch.setattr(bench, "_decode_round", lambda n, inplace: (lambda: 1.0 if inplace is True else 2.0))
    which = {KVCache: 3.0, PhysicalTrimFp16: 4.0}
    monkeypatch.setattr(bench, "_rollback_round", lambda cls, n: (lambda: which[cls]))
    assert bench.run([16, 48], as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    for col in doc["rows"]:
        assert (col["decode_inplace_ms"], col["decode_copy_ms"], col["rollback_logical_ms"],
                col["rollback_physical_ms"]) == (1e3, 2e3, 3e3, 4e3)


def test_bench_suite_smoke_runs_every_decoder_and_e2e_row_and_writes_a_record(capsys, monkeypatch, tmp_path):
    """One tiny run of ``kvspec bench --decoder --e2e --record``: every
    decoder row at every context beside mlx-lm's, every end-to-end config,
    and the record's JSON, Markdown and PNG (structure only, no timings)."""
    from kvspec.fuzz.commands import bench_decoder as bd

    monkeypatch.setattr(bench, "ROUNDS", 2)
    assert bench.run_suite([16, 40], decoder=True, e2e=True, layers=1, rounds=2, e2e_contexts=[16], tokens=4,
                           repeats=2, as_json=True, record=str(tmp_path), e2e_size="tiny") == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["decoder"]["ms_per_step"]
    assert set(rows) == set(bd.decoder_rows(16, 1, bench.mx.float16))
    assert any("mlx-lm" in name for name in rows) and "attention only (floor)" in rows
    for name, r in rows.items():
        assert set(r) == {"16", "40"} and all(v > 0 for v in r.values()), name
        floor = doc["decoder"]["floor_in_group_ms"][name]  # its floor, measured in its own round-robin
        assert doc["decoder"]["over_floor_ms"][name]["40"] == r["40"] - floor["40"]
    # a rollback of k rows is measured against attention with k queries, not one
    assert bd.floor_of("rollback k=3: ours") == "attention only, 3 queries (floor of rollback k=3)"
    assert bd.floor_of("rollback k=1: ours") == bd.floor_of("decode in place: ours") == "attention only (floor)"
    assert all(bd.floor_of(n) in rows for n in rows)
    # the random-weight target and draft agree on most tokens (acceptance > 0: trims are exercised)
    assert all(0 < a < 1 for by in doc["e2e"]["rows"]["acceptance"].values() for a in by.values())
    for row in ("speculative", "greedy", "sliding window"):
        assert {"mlx-lm caches", "ours, in place", "ours, inplace=False"} <= set(doc["e2e"]["rows"][row])
    assert "ours, physical trim" in doc["e2e"]["rows"]["speculative"]
    # every tokens/s figure is the median of its runs, and the runs are in the record
    import statistics
    for row in ("speculative", "greedy", "sliding window"):
        for name, by in doc["e2e"]["rows"][row].items():
            for n, median in by.items():
                runs = doc["e2e"]["samples"][row][name][n]
                assert len(runs) == 2 and median == statistics.median(runs), (row, name, n)
    # every config but mlx-lm's against mlx-lm's, run by run, in the JSON and the record
    from tests.test_reports import valid

    valid("bench", doc)
    paired = doc["e2e"]["paired"]
    assert set(paired["speculative"]) == set(doc["e2e"]["rows"]["speculative"]) - {"mlx-lm caches"}
    assert all(c["runs"] == 2 for by in paired.values() for v in by.values() for c in v.values())
    stem = tmp_path / f"{doc['date']}-{doc['device']}"
    assert "against mlx-lm's caches in the same round" in stem.with_suffix(".md").read_text()
    # the paired cells themselves, in the record and on the terminal (not "-")
    cell = bench._paired_cell(paired["greedy"]["ours, in place"]["16"])
    assert f"| ours, in place | {cell} |" in stem.with_suffix(".md").read_text()
    bench.print_suite(doc)
    assert cell in capsys.readouterr().out
    assert json.loads(stem.with_suffix(".json").read_text())["decoder"]["layers"] == 1
    assert "| decode in place: ours |" in stem.with_suffix(".md").read_text()
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_end_to_end_blocks_warm_up_each_config_keep_its_caches_and_rotate_the_order(monkeypatch):
    """Every config prefills and decodes ``warmup`` tokens unmeasured before
    any block is timed (the first config at a context ran at a fifth of its
    speed on the H200: kernels compiled on first use); each config keeps one
    generator (one set of caches) for all its blocks; round ``r`` decodes
    one block of every config, started one config later than round
    ``r - 1``; each block ends on an idle stream; block ``r`` of every config
    lands at index ``r`` of its samples."""
    from kvspec.fuzz.commands import bench_decoder as bd

    log: list[tuple] = []
    made: list[str] = []

    def fake_generator(model, caches, context, tokens, draft=None, draft_caches=None):
        name = caches[0]
        made.append(name)

        def gen():
            for i in range(tokens):
                log.append(("token", name, i, context, draft is not None))
                yield (i, None, i % 2 == 0) if draft is not None else (i, None)
        return gen()

    configs = {n: (lambda m, n=n: [n]) for n in ("a", "b", "c")}
    monkeypatch.setattr(bd, "_generator", fake_generator)
    monkeypatch.setattr(bd, "_sync", lambda: log.append(("sync",)))
    clock = iter(range(10**6))
    monkeypatch.setattr(bd.time, "perf_counter", lambda: float(next(clock)))
    samples, share = bd.interleaved_blocks(None, configs, 24, block=3, blocks=4, draft=object(), warmup=2)
    assert made == ["a", "b", "c"]  # one generator per config, for every block
    tokens = [e for e in log if e[0] == "token"]
    # the warm-up: prefill + 2 tokens of each config, before any block
    assert [e[1] for e in tokens[:9]] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    blocks = [e[1] for e in tokens[9:]][::3]
    assert blocks == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # each block is timed to an idle stream: a sync after its last token
    after = [log[i + 1] for i, e in enumerate(log) if e[0] == "token" and e[2] >= 3 and (e[2] - 2) % 3 == 0]
    assert all(x == ("sync",) for x in after)
    assert all(len(v) == 4 for v in samples.values())
    assert all(0 < a <= 1 for a in share.values())
    # the rows: speculative, greedy and the sliding-window model, each context's blocks in its samples
    calls = []

    def fake_blocks(model, makers, context, block, blocks, draft=None, warmup=8):
        calls.append((context, block, blocks, draft is not None, tuple(makers)))
        return {n: [100.0 + i for i in range(blocks)] for n in makers}, (dict.fromkeys(makers, 0.5) if draft else {})

    monkeypatch.setattr(bd, "interleaved_blocks", fake_blocks)
    res = bd.run_e2e([24], tokens=4, repeats=3, size="tiny", say=lambda m: None, warmup=2)
    every = tuple(bd.e2e_configs())
    greedy = tuple(n for n in every if n != "ours, physical trim")
    assert calls[:2] == [(24, 4, 3, True, every), (24, 4, 3, False, greedy)]
    (ctx, block, blocks, d, names), = calls[2:]
    assert (blocks, d, names) == (3, False, greedy) and ctx * 4 == 64 and block * blocks + ctx < 64
    assert res["samples"]["greedy"]["ours, in place"][24] == [100.0, 101.0, 102.0]
    assert res["greedy"]["ours, in place"][24] == 101.0 and res["acceptance"]["ours, in place"][24] == 0.5


def test_median_interval_is_the_distribution_free_one():
    # n = 6: P(Bin(6, 1/2) = 0) = 1/64 <= 0.025 < 7/64: the extreme order statistics
    assert bench.median_interval([5.0, 1.0, 4.0, 2.0, 3.0, 6.0]) == (1.0, 6.0)
    assert bench.median_interval([1.0] * 5) is None  # 1/32 > 0.025: no 95 % interval from 5
    # n = 20: k = 6 (P(Bin(20, 1/2) <= 5) = 0.0207, <= 6: 0.0577)
    xs = [float(i) for i in range(20)]
    assert bench.median_interval(xs) == (5.0, 14.0)
    # coverage, by simulation: the true median lies inside in at least 95 % of samples
    import random

    rng = random.Random(3)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (bench.median_interval([rng.gauss(0, 1) for _ in range(12)])
                                             for _ in range(2000)))
    assert hits >= 0.94 * 2000
    cell = {"median": 1.01, "ci_low": 0.995, "ci_high": 1.02, "low": 0.9, "high": 1.1, "faster_in": 7, "runs": 12}
    assert bench._paired_cell(cell) == "1.010x [0.995, 1.020] (0.90-1.10), 7/12"
    assert bench._paired_cell({**cell, "ci_low": None, "ci_high": None}) == "1.010x (0.90-1.10), 7/12"


def test_paired_ratios_divide_runs_of_the_same_repeat():
    from kvspec.fuzz.commands import bench_decoder as bd

    samples = {"mlx-lm caches": {1024: [100.0, 20.0, 50.0]}, "ours, in place": {1024: [110.0, 22.0, 45.0]}}
    got = bd.paired_ratios(samples, "ours, in place")[1024]
    # repeat by repeat, not sorted: sorted runs would give 0.9, 1.1, 1.1
    assert got == pytest.approx([1.1, 1.1, 0.9])
    table = bench.paired_table({"greedy": {k: {str(n): v for n, v in by.items()} for k, by in samples.items()}})
    cell = table["greedy"]["ours, in place"]["1024"]
    assert cell["median"] == pytest.approx(1.1) and cell["faster_in"] == 2 and cell["runs"] == 3
    assert bench._paired_cell(cell) == "1.100x (0.90-1.10), 2/3" and cell["ci_low"] is None
    assert "mlx-lm caches" not in table["greedy"] and bench._paired_cell(None) == "-"
    assert bd.rotated(["a", "b", "c"], 4) == ["b", "c", "a"] and bd.rotated([], 2) == []


def test_a_tie_is_not_faster_and_unpaired_runs_are_refused():
    from kvspec.fuzz.commands import bench_decoder as bd

    samples = {"mlx-lm caches": {"16": [100.0, 50.0]}, "ours, in place": {"16": [100.0, 60.0]}}
    cell = bench.paired_table({"greedy": samples})["greedy"]["ours, in place"]["16"]
    assert cell["faster_in"] == 1 and cell["runs"] == 2  # 1.00x is level, not faster
    # run i must pair with run i of the same repeat: a missing run is an error, not a shift
    with pytest.raises(ValueError):
        bd.paired_ratios({"mlx-lm caches": {16: [100.0, 50.0]}, "ours, in place": {16: [100.0]}}, "ours, in place")


def test_the_bench_schema_holds_the_suite_to_its_parts():
    from tests.test_reports import valid

    rows = {"heads": 2, "head_dim": 8, "contexts": [16], "rows": [{"context": 16}], "ratio_last_over_first": {}}
    suite = {"date": "2026-01-01", "machine": "m", "device": "cpu", "backend": "cpu", "inplace_mechanism": "x",
             "mlx": "0", "contexts": [16], "cache_rows": rows}
    valid("bench", rows)
    valid("bench", suite)
    for broken in ({k: v for k, v in suite.items() if k != "cache_rows"}, {**suite, "cache_rows": {}},
                   {**suite, "e2e": {"tokens": 4, "repeats": 2, "rows": {}, "samples": {}}}):
        with pytest.raises(jsonschema.ValidationError):
            valid("bench", broken)


def test_an_end_to_end_cell_shows_the_spread_of_its_runs():
    assert bench._e2e_cell(99.94, [95.2, 99.94, 104.6]) == "99.9 (95-105)"
    assert bench._e2e_cell(99.94, [99.94]) == "99.9"
    assert bench._e2e_cell(None, None) == "-"


def test_each_comparison_is_measured_in_one_round_robin_with_its_floor():
    """Ours, mlx-lm's and their floor at every context go to one
    interleaved measurement (drift falls on all alike), not one row after
    another; each row's over-floor cost uses the floor of its own round."""
    from kvspec.fuzz.commands import bench_decoder as bd

    calls: list[int] = []

    def interleave(ticks, rounds):
        calls.append(len(ticks))
        return [0.001 * (len(calls) + i) for i in range(len(ticks))]

    only = ["decode in place", "rollback k=2", "attention only (floor)"]
    rows, floors = bd.run_decoder([16, 24], 1, 1, interleave, only=only, say=lambda m: None)
    groups = bd.groups(list(bd.decoder_rows(16, 1, bench.mx.float16)))
    assert ["attention only (floor)", "decode in place: ours", "decode in place: mlx-lm KVCache"] in groups
    assert ["attention only, 2 queries (floor of rollback k=2)", "rollback k=2: ours",
            "rollback k=2: mlx-lm KVCache"] in groups
    # decode in place: floor + ours + mlx-lm at 2 contexts; rollback k=2 likewise
    assert sorted(calls) == [6, 6]
    assert floors["rollback k=2: ours"] == rows["attention only, 2 queries (floor of rollback k=2)"]
    assert floors["decode in place: ours"] == floors["decode in place: mlx-lm KVCache"]
    assert set(rows) == {"attention only (floor)", "decode in place: ours", "decode in place: mlx-lm KVCache",
                         "attention only, 2 queries (floor of rollback k=2)", "rollback k=2: ours",
                         "rollback k=2: mlx-lm KVCache"}


def test_each_reported_cell_holds_the_tick_that_measured_it(monkeypatch):
    """run_decoder maps interleave's medians back to (row, context) cells:
    with fake ticks that each return their own identity, every cell must
    hold its own row's tick at its own context (a transposed index passed
    the consistency checks above)."""
    from kvspec.fuzz.commands import bench_decoder as bd

    made: dict[int, tuple[str, int]] = {}

    def fake_rows(context, layers, dtype):
        def maker(name):
            def make():
                key = len(made)
                made[key] = (name, context)
                tick = lambda: float(key)
                tick.key = key
                return tick
            return make
        return {name: maker(name) for name in real(16, 1, dtype)}

    real = bd.decoder_rows
    monkeypatch.setattr(bd, "decoder_rows", fake_rows)
    only = ["decode in place", "rollback k=3"]
    rows, floors = bd.run_decoder([16, 24, 40], 1, 1, lambda ticks, r: [t.key * 1e-3 for t in ticks], only=only,
                                  say=lambda m: None)
    assert set(rows) == {"decode in place: ours", "decode in place: mlx-lm KVCache", "rollback k=3: ours",
                         "rollback k=3: mlx-lm KVCache", "attention only, 3 queries (floor of rollback k=3)"}
    for name, by in rows.items():
        for n, ms in by.items():
            # the last tick made for (name, n): the one interleaved (earlier ones were the probes)
            assert made[round(ms)] == (name, n), (name, n, ms)
    for name, by in floors.items():
        for n, ms in by.items():
            floor = name if name.startswith("attention only") else bd.floor_of(name)  # a floor is its own
            assert made[round(ms)] == (floor, n), (name, n, ms)


def test_an_unwritable_record_folder_exits_2_before_the_bench_runs(capsys, monkeypatch, tmp_path):
    from kvspec.fuzz.commands.cli import main

    def never(*a, **k):
        raise AssertionError("the bench ran before the record folder was checked")

    monkeypatch.setattr(bench, "run_suite", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--record", str(blocker / "sub"), "--contexts", "16", "32"]) == 2
    assert "--record:" in capsys.readouterr().out


def test_a_record_without_matplotlib_is_written_and_plotted_later(capsys, monkeypatch, tmp_path):
    """The GPU machine has no matplotlib: the record's JSON and Markdown are
    written and say how to draw the PNG; ``kvspec bench --plot`` draws it."""
    import builtins

    from kvspec.fuzz.commands.cli import main

    doc = {"date": "2026-12-01", "device": "gpu", "backend": "cuda", "inplace_mechanism": "donate", "mlx": "0",
           "machine": "x", "contexts": [16, 32],
           "cache_rows": {"rows": [{key: 1.0 for _, key in bench.ROWS}] * 2,
                          "ratio_last_over_first": {key: 1.0 for _, key in bench.ROWS}},
           "decoder": {"layers": 1, "ms_per_step": {"attention only (floor)": {"16": 1.0, "32": 1.5}},
                       "ratio_last_over_first": {"attention only (floor)": 1.5},
                       "over_floor_ms": {"attention only (floor)": {"16": 0.0, "32": 0.0}}}}
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    path = bench.write_record(doc, str(tmp_path))
    monkeypatch.undo()
    png = tmp_path / "2026-12-01-gpu.png"
    assert not png.exists() and "kvspec bench --plot" in (tmp_path / "2026-12-01-gpu.md").read_text()
    assert main(["bench", "--plot", path]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "--plot", str(tmp_path / "2026-12-01-gpu.md")]) == 2


def test_an_end_to_end_row_s_contexts_are_every_config_s_in_numeric_order():
    # JSON keys are strings: "1024" sorts before "512" unless read as numbers;
    # a context only one config reached still gets a column
    by = {"mlx-lm caches": {"512": 1.0, "1024": 2.0}, "ours, in place": {"512": 1.0, "1024": 2.0, "16384": 3.0}}
    assert bench._contexts(by) == [512, 1024, 16384]


def test_the_end_to_end_legends_name_the_brackets_the_cells_use(tmp_path, capsys):
    """A range of blocks is printed in round brackets (lo-hi) and a
    confidence interval in square brackets [lo, hi]: each legend, on the
    terminal and in the record, says so, and every cell has that shape."""
    import re
    from pathlib import Path

    e2e = {"repeats": 8, "tokens": 16,
           "rows": {"greedy": {"mlx-lm caches": {"16": 10.0}, "ours, in place": {"16": 11.0}}},
           "samples": {"greedy": {"mlx-lm caches": {"16": [9.0, 10.0, 12.0]}, "ours, in place": {"16": [10.0, 11.0, 13.0]}}},
           "paired": {"greedy": {"ours, in place": {"16": {"median": 1.1, "low": 0.9, "high": 1.3, "ci_low": 1.0,
                                                           "ci_high": 1.2, "faster_in": 6, "runs": 8}}}}}
    doc = {"date": "2026-12-06", "device": "cpu", "backend": "cpu", "inplace_mechanism": "x", "mlx": "0",
           "machine": "x", "contexts": [16],
           "cache_rows": {"rows": [{key: 1.0 for _, key in bench.ROWS}],
                          "ratio_last_over_first": {key: 1.0 for _, key in bench.ROWS}}, "e2e": e2e}
    bench.print_suite(doc)
    terminal = capsys.readouterr().out
    record = Path(bench.write_record(doc, str(tmp_path))).with_suffix(".md").read_text()
    for text in (terminal, record):
        assert "10.0 (9-12)" in text and "1.100x [1.000, 1.200] (0.90-1.30), 6/8" in text
        legends = [line for line in text.splitlines() if line.lower().startswith("each")]
        assert len(legends) == 2, legends
        tokens, ratios = legends
        assert "round brackets (lo-hi)" in tokens and "square brackets" not in tokens
        assert "square brackets [lo, hi]" in ratios and "round brackets (lo-hi)" in ratios
        # no legend promises a bracket kind it does not name
        assert not re.search(r"(?<!round )(?<!square )brackets", tokens + ratios)
