"""``kvspec bench``: the cost contract, measured as ratios in one run.

Two questions, each at growing context lengths:

* decode step: in-place write (ownership rule allows it) vs the copying write
  (``KV_INPLACE_WRITE=0``) while the previous step's window is held, as a
  pipelined decoder holds it;
* speculative rollback: trim k rows then append k rows, with the logical
  trim (ours) vs a physical re-slice (the ``physical_trim_fp16`` injected
  bug, i.e. the pre-#1209 behaviour).

Every step consumes the keys *and* the values the cache returns (both are
evaluated, as attention evaluates them): evaluating only the keys lets MLX
keep the values lazy, and from ~16k rows on the logical rollback then pays
for a values copy that a decoder never makes.

Times are medians of repeated runs on this machine, taken round-robin over
the contexts after a warm-up (so drift falls on every context alike); only
ratios mean anything across machines. Each row ends with the ratio of its last context
to its first (32k / 1k by default): about 1 for an O(1) operation, about the
context ratio for an O(context) one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvspec.fuzz.bugs.dense import PhysicalTrimFp16
from kvspec.impl.dense import KVCache

HEADS, DIM = 8, 128
#: timed rounds per operation and context (medians of these)
ROUNDS = 64


def _rows(n: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
    mx.eval(k)
    return k, k


def _decode_round(context: int, inplace: bool) -> Callable[[], float]:
    """A cache holding ``context`` rows; each call times one decode step."""
    cache = KVCache("fp16", step=256, inplace=inplace)
    cache.update_and_fetch(*_rows(context))
    one = _rows(1)
    held = [cache.update_and_fetch(*one)]
    mx.eval(*held[0])

    def tick() -> float:
        start = time.perf_counter()
        # The previous step's window stays alive until this step is
        # evaluated, as in a pipelined decoder. (Dropping it before the eval
        # would let MLX donate the buffer and hide the copy's cost.)
        out = cache.update_and_fetch(*one)
        mx.eval(*out)
        seconds = time.perf_counter() - start
        held[0] = out
        return seconds

    return tick


def _rollback_round(cls: type[KVCache], context: int, k: int = 4) -> Callable[[], float]:
    """A cache holding ``context`` rows; each call times one speculative
    rollback: trim ``k`` rows, then append the verified ``k`` rows."""
    cache = cls("fp16", step=256, inplace=True)
    cache.update_and_fetch(*_rows(context))
    block = _rows(k)

    def tick() -> float:
        mx.eval(*cache.update_and_fetch(*block))  # the draft step's keys and values, consumed
        start = time.perf_counter()
        cache.trim(k)
        # the verified block's keys and values, consumed; nothing holds the
        # window afterwards (a rollback loop keeps no view of the old step)
        mx.eval(*cache.update_and_fetch(*block))
        seconds = time.perf_counter() - start
        cache.trim(k)
        return seconds

    return tick


def round_robin(ticks: list[Callable[[], float]], rounds: int, warmup: int) -> list[list[float]]:
    """Seconds of every tick in each of ``rounds`` rounds, run round-robin
    (round r starts at tick r) after ``warmup`` untimed calls of each: drift
    in the machine's load, clocks and caches then falls on every tick alike
    instead of on whichever was measured first."""
    for tick in ticks:
        for _ in range(warmup):
            tick()
    times: list[list[float]] = [[] for _ in ticks]
    for r in range(rounds):
        for j in range(len(ticks)):
            i = (r + j) % len(ticks)
            times[i].append(ticks[i]())
    return times


def _interleaved(ticks: list[Callable[[], float]], rounds: int, warmup: int = 4) -> list[float]:
    """Median seconds of each tick over :func:`round_robin`'s rounds."""
    return [statistics.median(t) for t in round_robin(ticks, rounds, warmup)]


ROWS = (
    ("decode in place", "decode_inplace_ms"),
    ("decode copying", "decode_copy_ms"),
    ("rollback logical", "rollback_logical_ms"),
    ("rollback physical", "rollback_physical_ms"),
)


def run(contexts: list[int], as_json: bool = False) -> int:
    """Measure at each context length; print one row per operation with a
    column per context and the last/first ratio."""
    err = Console(stderr=True, highlight=False, emoji=False)
    makers = {
        "decode_inplace_ms": lambda n: _decode_round(n, True),
        "decode_copy_ms": lambda n: _decode_round(n, False),
        "rollback_logical_ms": lambda n: _rollback_round(KVCache, n),
        "rollback_physical_ms": lambda n: _rollback_round(PhysicalTrimFp16, n),
    }
    cols: list[dict[str, float]] = [{"context": n} for n in contexts]
    for key, make in makers.items():
        err.print(f"bench: {key.removesuffix('_ms').replace('_', ' ')} at {', '.join(map(str, contexts))} ...",
                  markup=False)
        ticks = [make(n) for n in contexts]
        for col, seconds in zip(cols, _interleaved(ticks, ROUNDS)):
            col[key] = seconds * 1e3
        del ticks
    first, last = cols[0], cols[-1]
    ratios = {key: last[key] / first[key] for _, key in ROWS}
    if as_json:
        print(json.dumps({"heads": HEADS, "head_dim": DIM, "contexts": contexts, "rows": cols,
                          "ratio_last_over_first": ratios}))
        return 0
    table = Table(title=f"kvspec bench (fp16, {HEADS} kv heads x {DIM}, medians in ms)")
    table.add_column("operation", no_wrap=True)
    for n in contexts:
        table.add_column(f"{n}", justify="right", no_wrap=True)
    table.add_column(f"{contexts[-1]} / {contexts[0]}", justify="right", no_wrap=True)
    for label, key in ROWS:
        table.add_row(label, *(f"{c[key]:.3f}" for c in cols), f"{ratios[key]:.1f}x")
    console = Console(highlight=False, emoji=False)
    console.print(table)
    console.print(f"copy / in place at {contexts[-1]}: {last['decode_copy_ms'] / last['decode_inplace_ms']:.1f}x; "
                  f"physical / logical rollback at {contexts[-1]}: "
                  f"{last['rollback_physical_ms'] / last['rollback_logical_ms']:.1f}x")
    return 0


def _ratio(row: dict, contexts: list[int]) -> float:
    return row[contexts[-1]] / row[contexts[0]]


def run_suite(contexts: list[int], decoder: bool = True, e2e: bool = False, layers: int | None = None,
              rounds: int | None = None, e2e_contexts: list[int] | None = None, tokens: int = 16, repeats: int = 12,
              as_json: bool = False, record: str | None = None, e2e_size: str = "7b") -> int:
    """The cache rows (:func:`run`'s), the decoder rows and the end-to-end
    rows (kvspec.fuzz.commands.bench_decoder) in one run; printed as tables, or one
    JSON object; with ``record`` also written as a record (JSON, Markdown,
    PNG) under that folder. Exit 0."""
    import io
    import platform
    from contextlib import redirect_stdout
    from datetime import date

    from kvspec.fuzz.commands import bench_decoder as bd
    from kvspec.fuzz.device import current
    from kvspec.impl.write import backend, inplace_mechanism

    err = Console(stderr=True, highlight=False, emoji=False)
    gpu = current() == "gpu"
    layers = layers or (28 if gpu else 4)
    rounds = rounds or (20 if gpu else 8)
    buf = io.StringIO()
    with redirect_stdout(buf):
        run(contexts, as_json=True)
    doc: dict = {"date": date.today().isoformat(), "machine": platform.machine(), "node": platform.node(),
                 "device": current(), "backend": backend(), "inplace_mechanism": inplace_mechanism(),
                 "mlx": mx.__version__, "contexts": contexts, "cache_rows": json.loads(buf.getvalue())}
    try:
        import mlx_lm

        doc["mlx_lm"] = mlx_lm.__version__
    except ImportError:  # pragma: no cover - the e2e extra is installed by make
        doc["mlx_lm"] = None
    if gpu:
        doc["gpu"] = mx.device_info().get("device_name") if hasattr(mx, "device_info") else "gpu"
    if decoder:
        rows, floors = bd.run_decoder(contexts, layers, rounds, lambda t, r: _interleaved(t, r, warmup=3),
                                      say=lambda m: err.print(m, markup=False))
        doc["decoder"] = {"layers": layers, "rounds": rounds, "ms_per_step": {
            name: {str(n): v for n, v in r.items()} for name, r in rows.items()},
            "ratio_last_over_first": {name: _ratio(r, contexts) for name, r in rows.items()}}
        doc["decoder"]["not_measured"] = dict(bd.UNSUPPORTED)
        # each row against the attention-only floor with its own number of
        # queries (a rollback of k rows attends with k queries: bd.floor_of),
        # as measured in the row's own round-robin (bd.run_decoder)
        doc["decoder"]["floor_of"] = {name: bd.floor_of(name) for name in rows}
        doc["decoder"]["floor_in_group_ms"] = {name: {str(n): v for n, v in f.items()} for name, f in floors.items()}
        over = {name: {n: r[n] - floors.get(name, rows.get(bd.floor_of(name), r))[n] for n in contexts}
                for name, r in rows.items()}
        doc["decoder"]["over_floor_ms"] = {name: {str(n): v for n, v in o.items()} for name, o in over.items()}
        # the over-floor cost (what the cache's write costs) has its own 32k/1k ratio; a
        # ratio of near-zero costs is noise, so it is given only where the first is >= 0.05 ms
        doc["decoder"]["over_floor_ratio"] = {
            name: (o[contexts[-1]] / o[contexts[0]] if o[contexts[0]] >= 0.05 else None) for name, o in over.items()}
    if e2e:
        res = bd.run_e2e(e2e_contexts or [1024, 8192, 24576], tokens, repeats, size=e2e_size,
                         say=lambda m: err.print(m, markup=False))
        samples = res.pop("samples", {})
        doc["e2e"] = {"tokens": tokens, "repeats": repeats, "rows": {
            row: {name: {str(n): v for n, v in by.items()} for name, by in res[row].items()}
            for row in res}, "samples": {
            row: {name: {str(n): v for n, v in by.items()} for name, by in samples[row].items()}
            for row in samples}}
        doc["e2e"]["paired"] = paired_table(doc["e2e"]["samples"])
    if as_json:
        print(json.dumps(doc))
    else:
        print_suite(doc)
    if record:
        path = write_record(doc, record)
        err.print(f"bench: record written: {path}", markup=False)
    return 0


def print_suite(doc: dict) -> None:
    console = Console(highlight=False, emoji=False)
    contexts = doc["contexts"]
    if "decoder" in doc:
        d = doc["decoder"]
        t = Table(title=f"decoder step, {d['layers']} layers, write + attention ({doc['device']}, "
                        f"{doc['inplace_mechanism']}), medians in ms")
        t.add_column("row", no_wrap=True)
        for n in contexts:
            t.add_column(str(n), justify="right")
        t.add_column(f"{contexts[-1]} / {contexts[0]}", justify="right")
        t.add_column("over its floor, " + " / ".join(str(n) for n in contexts), justify="right")
        for name, r in d["ms_per_step"].items():
            t.add_row(escape(name), *(f"{r[str(n)]:.3f}" for n in contexts), f"{d['ratio_last_over_first'][name]:.2f}x",
                      " / ".join(f"{d['over_floor_ms'][name][str(n)]:+.3f}" for n in contexts))
        console.print(t)
    if "e2e" in doc:
        for row, by in doc["e2e"]["rows"].items():
            if row == "acceptance" or not by:
                continue
            ctxs = _contexts(by)
            t = Table(title=f"end to end, {row}: tokens/s")
            t.add_column("caches", no_wrap=True)
            for n in ctxs:
                t.add_column(str(n), justify="right")
            spread = doc["e2e"].get("samples", {}).get(row, {})
            for name, v in by.items():
                t.add_row(escape(name), *(_e2e_cell(v.get(str(n)), spread.get(name, {}).get(str(n))) for n in ctxs))
            console.print(t)
        if doc["e2e"].get("samples") and doc["e2e"]["repeats"] > 1:
            console.print(f"each cell: the median of {doc['e2e']['repeats']} blocks of {doc['e2e']['tokens']} tokens, "
                          f"the caches decoding their blocks in turn; {RANGE_LEGEND}", markup=False, soft_wrap=True)
        paired = doc["e2e"].get("paired") or {}
        for row, by in paired.items():
            ctxs = _contexts(by)
            t = Table(title=f"end to end, {row}: tokens/s against mlx-lm's caches in the same round")
            t.add_column("caches", no_wrap=True)
            for n in ctxs:
                t.add_column(str(n), justify="right")
            for name, v in by.items():
                t.add_row(escape(name), *(_paired_cell(v.get(str(n))) for n in ctxs))
            console.print(t)
        if paired:
            console.print(f"each cell: the median of the block-by-block ratios, {INTERVAL_LEGEND}, "
                          f"{RANGE_LEGEND.replace('block', 'ratio')}, and in how many blocks the row was the faster; "
                          "above 1.000x: faster than mlx-lm's caches", markup=False, soft_wrap=True)


def paired_table(samples: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, dict[str, dict]]]:
    """``{row: {config: {context: {"median": m, "low": lo, "high": hi,
    "ci_low": a, "ci_high": b, "faster_in": k, "runs": n}}}}``: each
    config's block-by-block ratio to mlx-lm's caches in the same round
    (``bench_decoder.paired_ratios``; above 1: faster than mlx-lm's), its
    median, a 95 % interval of that median (:func:`median_interval`; None
    with fewer than 6 blocks), its range and the blocks in which the config
    was the faster, for every config but mlx-lm's."""
    from kvspec.fuzz.commands import bench_decoder as bd

    out: dict[str, dict[str, dict[str, dict]]] = {}
    for row, by in samples.items():
        if "mlx-lm caches" not in by:
            continue
        for name in by:
            if name == "mlx-lm caches":
                continue
            for n, ratios in bd.paired_ratios(by, name).items():
                if ratios:
                    ci = median_interval(ratios)
                    out.setdefault(row, {}).setdefault(name, {})[n] = {
                        "median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
                        "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
                        "faster_in": sum(r > 1 for r in ratios), "runs": len(ratios)}
    return out


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of
    ``values`` (independent draws): the order statistics ``k`` and
    ``n + 1 - k``, ``k`` the largest with ``P(Binomial(n, 1/2) < k) <=
    (1 - level) / 2``, so the interval holds the true median with
    probability at least ``level`` whatever the distribution. None where
    ``n`` is too small for any such ``k`` (fewer than 6 values at 95 %)."""
    import math

    n = len(values)
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n and below + math.comb(n, k) / 2 ** n <= tail:
        below += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return None
    xs = sorted(values)
    return xs[k - 1], xs[n - k]


def _contexts(by: dict[str, dict[str, Any]]) -> list[int]:
    """The contexts of an end-to-end row's configs (JSON keys), in order."""
    return sorted({int(n) for v in by.values() for n in v})


#: the legends of the end-to-end cells, in the notation the cells use
#: (:func:`_e2e_cell`, :func:`_paired_cell`): a confidence interval in square
#: brackets, a range of measurements in round brackets
INTERVAL_LEGEND = "95 % confidence interval of the median in square brackets [lo, hi]"
RANGE_LEGEND = "the lowest and highest block in round brackets (lo-hi)"


def _paired_cell(p: dict | None) -> str:
    """``1.03x [0.99, 1.06] (0.90-1.10), 14/24``: the median ratio, its 95 %
    confidence interval (:func:`median_interval`; left out where there are
    too few blocks), the range of the ratios and in how many blocks the
    config was the faster one."""
    if not p:
        return "-"
    ci = f" [{p['ci_low']:.3f}, {p['ci_high']:.3f}]" if p.get("ci_low") is not None else ""
    return f"{p['median']:.3f}x{ci} ({p['low']:.2f}-{p['high']:.2f}), {p['faster_in']}/{p['runs']}"


def _e2e_cell(median: float | None, samples: list[float] | None) -> str:
    """An end-to-end cell: the median tokens/s and, with more than one run,
    the range of the runs (``-`` when the row was not measured there)."""
    if median is None:
        return "-"
    if not samples or len(samples) < 2:
        return f"{median:.1f}"
    return f"{median:.1f} ({min(samples):.0f}-{max(samples):.0f})"


def write_record(doc: dict, folder: str) -> str:
    """``<folder>/<date>-<device>.json``, ``.md`` (the tables) and ``.png``
    (cost vs context per decoder row, log-scale context). Returns the JSON
    path."""
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{doc['date']}-{doc['device']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# kvspec bench, {doc['date']}", "",
             f"- device: {doc['device']} ({doc['backend']}, in-place writes: {doc['inplace_mechanism']})"
             + (f", {doc.get('gpu')}" if doc.get("gpu") else ""),
             f"- MLX {doc['mlx']}, mlx-lm {doc.get('mlx_lm')}; machine {doc['machine']}", "",
             (f"Raw figures: `{stem.with_suffix('.json').name}`; plot: `{stem.with_suffix('.png').name}`."
              if "decoder" in doc else f"Raw figures: `{stem.with_suffix('.json').name}` (no decoder rows, so no plot)."),
             ""]
    contexts = doc["contexts"]
    if "decoder" in doc:
        d = doc["decoder"]
        ratio_of = d.get("over_floor_ratio", {})
        lines += [f"## Decoder step ({d['layers']} layers, write + attention), ms", "",
                  ("Each row's over-floor cost is against the attention-only floor with as many queries as the "
                  "row attends with (rollback k: k queries); the write is what the cache controls."), "",
                  "| row | " + " | ".join(map(str, contexts))
                  + f" | {contexts[-1]}/{contexts[0]} | over floor at {contexts[0]} | over floor at {contexts[-1]} "
                  f"| over-floor {contexts[-1]}/{contexts[0]} |",
                  "| --- |" + " --- |" * (len(contexts) + 4)]
        for name, r in d["ms_per_step"].items():
            o, q = d["over_floor_ms"][name], ratio_of.get(name)
            lines.append(f"| {name} | " + " | ".join(f"{r[str(n)]:.3f}" for n in contexts)
                         + f" | {d['ratio_last_over_first'][name]:.2f}x | {o[str(contexts[0])]:+.3f} "
                         f"| {o[str(contexts[-1])]:+.3f} | {'-' if q is None else f'{q:.2f}x'} |")
        lines.append("")
    cr = doc["cache_rows"]
    lines += ["## Cache rows (no attention), ms", "", "| row | " + " | ".join(map(str, contexts)) + " | ratio |",
              "| --- |" + " --- |" * (len(contexts) + 1)]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{c[key]:.3f}" for c in cr["rows"])
                     + f" | {cr['ratio_last_over_first'][key]:.2f}x |")
    lines.append("")
    if "e2e" in doc:
        for row, by in doc["e2e"]["rows"].items():
            if not by:
                continue
            ctxs = _contexts(by)
            unit = "share of tokens from the draft" if row == "acceptance" else "tokens/s"
            lines += [f"## End to end, {row} ({unit})", "", "| caches | " + " | ".join(map(str, ctxs)) + " |",
                      "| --- |" + " --- |" * len(ctxs)]
            spread = doc["e2e"].get("samples", {}).get(row, {})
            for name, v in by.items():
                cells = (f"{v[str(n)]:.3g}" if row == "acceptance" else _e2e_cell(v.get(str(n)), spread.get(name, {}).get(str(n)))
                         for n in ctxs)
                lines.append(f"| {name} | " + " | ".join(c if c else "-" for c in cells) + " |")
            lines.append("")
        if doc["e2e"].get("samples") and doc["e2e"]["repeats"] > 1:
            lines += [(f"Each tokens/s cell: the median of {doc['e2e']['repeats']} blocks of {doc['e2e']['tokens']} "
                      f"tokens, the caches decoding their blocks in turn from caches kept alive; {RANGE_LEGEND}."), ""]
        for row, by in (doc["e2e"].get("paired") or {}).items():
            ctxs = _contexts(by)
            lines += [f"## End to end, {row}: against mlx-lm's caches in the same round", "",
                      "| caches | " + " | ".join(map(str, ctxs)) + " |", "| --- |" + " --- |" * len(ctxs)]
            lines += [f"| {name} | " + " | ".join(_paired_cell(v.get(str(n))) for n in ctxs) + " |"
                      for name, v in by.items()]
            lines.append("")
        if doc["e2e"].get("paired"):
            lines += [("Each cell: the median of the block-by-block ratios of tokens/s to mlx-lm's caches, each "
                       f"block divided by mlx-lm's block of the same round, its distribution-free {INTERVAL_LEGEND} "
                       f"(none with fewer than 6 blocks), {RANGE_LEGEND.replace('block', 'ratio')}, and in how "
                       "many blocks the row was the faster; above 1.000x: faster than mlx-lm's caches."), ""]
    png = stem.with_suffix(".png")
    if "decoder" in doc:
        try:
            _plot(doc, png)
        except ImportError:  # the GPU machine has no matplotlib: draw it later from the JSON
            lines += [(f"The plot was not drawn here (no matplotlib): `kvspec bench --plot {stem.with_suffix('.json').name}` "
                      "draws it from the JSON."), ""]
            Console(stderr=True, highlight=False, emoji=False).print(
                f"bench: no matplotlib here: {png.name} not drawn; `kvspec bench --plot "
                f"{stem.with_suffix('.json')}` draws it from the JSON", markup=False)
    stem.with_suffix(".md").write_text("\n".join(lines))
    return str(stem.with_suffix(".json"))


def plot_record(json_path: str) -> str:
    """Draw the PNG of a record's JSON beside it (for a record made where
    matplotlib is missing). Returns the PNG's path. Raises OSError for an
    unreadable file, ValueError for one that is not JSON, KeyError for a
    record without decoder rows."""
    from pathlib import Path

    path = Path(json_path)
    doc = json.loads(path.read_text())
    doc["decoder"]["ms_per_step"]
    png = path.with_suffix(".png")
    _plot(doc, png)
    return str(png)


def _plot(doc: dict, path: Any) -> None:
    """Cost vs context of every decoder row (ms per step, log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = doc["contexts"]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for name, r in doc["decoder"]["ms_per_step"].items():
        style = "--" if "mlx-lm" in name else ("-" if "ours" in name else ":")
        ax.plot(contexts, [r[str(n)] for n in contexts], style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (rows)")
    ax.set_ylabel("ms per decoder step")
    ax.set_title(f"kvspec bench {doc['date']}: {doc['decoder']['layers']} layers, {doc['device']} "
                 f"({doc['inplace_mechanism']}), MLX {doc['mlx']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
