"""More of ``kvspec bench --e2e`` without a model: what each block's time
holds (its own tokens and the step still queued at its end, never the
prefill or the warm-up), the config and round each figure is filed under,
the acceptance share, the draft's caches, run_e2e's bookkeeping across rows
and contexts, the sliding-window block, the paired cells' interval and the
schema's types for it. The generator, the sync and the clock are fakes, so
every figure is known exactly."""

import importlib
import statistics
from types import SimpleNamespace

import jsonschema
import pytest

from kvspec.fuzz.commands import bench
from kvspec.fuzz.commands import bench_decoder as bd

#: seconds per measured token of each config, before the host's slow-down
COST = {"a": 1.0, "b": 2.0, "c": 4.0}
#: seconds of the step each config's generator leaves queued when it yields
QUEUED = {"a": 0.25, "b": 0.5, "c": 0.125}
#: seconds of a prefill or warm-up token (kernels built on first use)
WARM = 1000.0


class FakeHost:
    """One generation stream and a clock that moves only when work is
    waited for. ``next`` on a generator waits for whatever the stream has
    queued (any config's), then for its own token, and leaves its next step
    queued; ``sync`` waits for what is queued. A measured token of block
    ``r`` costs ``COST[name] * (1 + r)`` (the host slows down round by round,
    so block ``r`` is told apart from every other block); a prefill or
    warm-up token costs WARM. Token ``j`` of the measured ones is from the
    draft unless ``j % 3 == 2``; every warm-up token is from the draft."""

    def __init__(self, block: int, warmup: int):
        self.block, self.warmup = block, warmup
        self.now, self.pending = 0.0, 0.0
        self.made: list[tuple] = []
        self.log: list[tuple] = []

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.log.append(("sync",))
        self.now += self.pending
        self.pending = 0.0

    def generator(self, model, caches, context, tokens, draft=None, draft_caches=None):
        (name, _), = caches
        self.made.append((name, model, caches, draft, draft_caches, tokens))

        def gen():
            for i in range(tokens):
                j = i - (self.warmup + 1)  # the measured token's index (negative: prefill / warm-up)
                self.now += self.pending + (WARM if j < 0 else COST[name] * (1 + j // self.block))
                self.pending = WARM if j < 0 else QUEUED[name]
                self.log.append(("token", name, j))
                yield (i, None, j < 0 or j % 3 != 2) if draft is not None else (i, None)
        return gen()


def _blocks(monkeypatch, block=3, blocks=4, warmup=2, draft=True):
    host = FakeHost(block, warmup)
    monkeypatch.setattr(bd, "_generator", host.generator)
    monkeypatch.setattr(bd, "_sync", host.sync)
    monkeypatch.setattr(bd.time, "perf_counter", host.clock)
    makers = {n: (lambda m, n=n: [(n, m)]) for n in COST}
    model, d = object(), (object() if draft else None)
    samples, share = bd.interleaved_blocks(model, makers, 24, block=block, blocks=blocks, draft=d,
                                           warmup=warmup)
    return host, model, d, samples, share


@pytest.mark.parametrize("draft", [True, False])
def test_block_r_of_each_config_is_its_own_tokens_of_round_r_and_the_queued_step(monkeypatch, draft):
    """tokens/s of block ``r`` of config ``x`` is ``block`` over the time of
    its own ``block`` tokens in round ``r``, counting the step still queued
    when its last token came out (waited for before the clock stops) and
    nothing of the prefill or the warm-up: filed under another config or
    round, timed before the sync, without the sync, or from before the
    warm-up, it is another number."""
    block, blocks = 3, 4
    _, _, _, samples, _ = _blocks(monkeypatch, block, blocks, draft=draft)
    assert set(samples) == set(COST)
    for name, cost in COST.items():
        want = [block / (block * (cost * (1 + r) + QUEUED[name])) for r in range(blocks)]
        assert samples[name] == pytest.approx(want, rel=1e-12), name


def test_the_stream_is_synced_after_each_warm_up_and_each_block_and_nowhere_else(monkeypatch):
    """A sync right after each config's warm-up and each block's last token
    (the block ends on an idle stream) and none inside a block (a sync
    there drains mlx-lm's pipeline, which a decoder never does)."""
    block, blocks, warmup = 3, 4, 2
    host, _, _, _, _ = _blocks(monkeypatch, block, blocks, warmup)
    log = host.log
    ends = [i for i, e in enumerate(log) if e[0] == "token" and (e[2] == -1 or e[2] % block == block - 1)]
    assert len(ends) == len(COST) * (1 + blocks)
    syncs = [i for i, e in enumerate(log) if e == ("sync",)]
    assert syncs == [i + 1 for i in ends]


def test_the_acceptance_share_counts_the_measured_tokens_only(monkeypatch):
    """The share of the measured tokens that came from the draft: the
    warm-up's drafted tokens are not in it, and the denominator is the
    measured tokens (``block * blocks``), not every token generated."""
    block, blocks = 3, 4
    _, _, _, _, share = _blocks(monkeypatch, block, blocks)
    measured = block * blocks
    want = sum(j % 3 != 2 for j in range(measured)) / measured
    assert share == pytest.approx(dict.fromkeys(COST, want), rel=1e-12)
    _, _, _, _, share = _blocks(monkeypatch, block, blocks, draft=False)
    assert share == {}


def test_each_config_has_one_generator_with_its_own_caches_and_its_draft_s(monkeypatch):
    """One generator per config, over caches made for the target and draft
    caches made for the draft (mlx-lm's speculative step splits the two by
    the target's layer count), for the prefill, warm-up and every block."""
    block, blocks, warmup = 3, 4, 2
    host, model, draft, _, _ = _blocks(monkeypatch, block, blocks, warmup)
    assert [m[0] for m in host.made] == list(COST)
    for name, m, caches, d, draft_caches, tokens in host.made:
        assert m is model and caches == [(name, model)] and d is draft
        assert draft_caches == [(name, draft)], name
        assert tokens == warmup + 1 + block * blocks
    host, model, _, _, _ = _blocks(monkeypatch, block, blocks, warmup, draft=False)
    assert all(d is None and dc is None for _, _, _, d, dc, _ in host.made)


def _run_e2e(monkeypatch, contexts, tokens, repeats, warmup):
    """run_e2e at tiny shapes with fake models and a fake interleaved_blocks
    that records its calls and gives every (row, context, config, round) its
    own figure, in falling order (sorting would reorder them)."""
    calls: list[dict] = []

    def fake_blocks(model, makers, context, block, blocks, draft=None, warmup=8):
        row = "speculative" if draft is not None else ("greedy" if context in contexts else "sliding window")
        ri = ["speculative", "greedy", "sliding window"].index(row)
        runs = {name: [1e4 * ri + 1e3 * context + 10.0 * ci + (blocks - r) for r in range(blocks)]
                for ci, name in enumerate(makers)}
        share = {name: (ci + 1) / (10 + context) for ci, name in enumerate(makers)} if draft else {}
        calls.append({"row": row, "model": model, "context": context, "block": block, "blocks": blocks,
                      "warmup": warmup, "makers": tuple(makers), "runs": runs, "share": share})
        return {n: list(v) for n, v in runs.items()}, dict(share)

    monkeypatch.setattr(bd, "interleaved_blocks", fake_blocks)
    monkeypatch.setattr(bd, "random_model", lambda module, args, dtype=None: SimpleNamespace(args=args))
    monkeypatch.setattr(bd, "agreeing_pair", lambda target, draft: None)
    res = bd.run_e2e(contexts, tokens=tokens, repeats=repeats, size="tiny", say=lambda m: None, warmup=warmup)
    return calls, res


def test_run_e2e_files_every_row_context_and_config_s_blocks_in_round_order(monkeypatch):
    """Two contexts: each (row, config, context) keeps its own blocks, in
    round order (block ``r`` pairs with mlx-lm's block ``r``), the median of
    exactly those, and the acceptance of its own context; the warm-up asked
    for reaches every interleaved_blocks call."""
    contexts, repeats, warmup = [24, 40], 3, 5
    calls, res = _run_e2e(monkeypatch, contexts, 4, repeats, warmup)
    assert [(c["row"], c["context"]) for c in calls] == [
        ("speculative", 24), ("greedy", 24), ("speculative", 40), ("greedy", 40), ("sliding window", 16)]
    assert all(c["warmup"] == warmup for c in calls)
    for c in calls:
        for name, values in c["runs"].items():
            assert res["samples"][c["row"]][name][c["context"]] == values, (c["row"], name, c["context"])
            assert res[c["row"]][name][c["context"]] == statistics.median(values)
        for name, a in c["share"].items():
            assert res["acceptance"][name][c["context"]] == a
    assert set(res["samples"]["greedy"]["ours, in place"]) == set(contexts)
    assert set(res["acceptance"]["ours, in place"]) == set(contexts)
    # block by block against mlx-lm's block of the same round
    spec40 = calls[2]["runs"]
    assert bd.paired_ratios(res["samples"]["speculative"], "ours, in place")[40] == [
        a / b for a, b in zip(spec40["ours, in place"], spec40["mlx-lm caches"], strict=True)]


@pytest.mark.parametrize("tokens,repeats,warmup", [(100, 3, 8), (4, 3, 8), (16, 12, 2), (50, 5, 0)])
def test_the_sliding_window_blocks_stay_inside_the_window(monkeypatch, tokens, repeats, warmup):
    """Prefill (a quarter of the window), the prefill's token, the warm-up
    and every block together fit the window (64 at tiny shapes); the block
    is ``tokens`` where that fits, else the longest that does."""
    calls, _ = _run_e2e(monkeypatch, [24], tokens, repeats, warmup)
    sw, = (c for c in calls if c["row"] == "sliding window")
    window = sw["model"].args.sliding_window

    def used(block: int) -> int:
        return sw["context"] + warmup + 1 + block * sw["blocks"]

    assert window == 64 and sw["context"] == window // 4 and sw["blocks"] == repeats
    assert sw["warmup"] == warmup
    assert 1 <= sw["block"] <= tokens and used(sw["block"]) <= window
    assert sw["block"] == tokens or used(sw["block"] + 1) > window


def test_sync_waits_on_mlx_lm_s_generation_stream(monkeypatch):
    gen = importlib.import_module("mlx_lm.generate")
    seen: list[tuple] = []
    monkeypatch.setattr(bd.mx, "synchronize", lambda *a: seen.append(a))
    bd._sync()
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0] is gen.generation_stream


def test_the_generator_is_mlx_lm_s_with_three_draft_tokens_over_target_then_draft_caches(monkeypatch):
    gen = importlib.import_module("mlx_lm.generate")
    seen: list[tuple] = []
    monkeypatch.setattr(gen, "generate_step", lambda *a, **k: seen.append(("greedy", a, k)) or "g")
    monkeypatch.setattr(gen, "speculative_generate_step", lambda *a, **k: seen.append(("spec", a, k)) or "s")
    model, draft = SimpleNamespace(args=SimpleNamespace(vocab_size=512)), object()
    assert bd._generator(model, ["t0", "t1"], 20, 7, draft, ["d0"]) == "s"
    assert bd._generator(model, ["t0", "t1"], 20, 7) == "g"
    (kind, a, k), (kind2, a2, k2) = seen
    assert kind == "spec" and a[0].shape == (20,) and a[1] is model and a[2] is draft
    assert k == {"num_draft_tokens": 3, "max_tokens": 7, "prompt_cache": ["t0", "t1", "d0"]}
    assert kind2 == "greedy" and a2[0].shape == (20,) and a2[1] is model
    assert k2 == {"max_tokens": 7, "prompt_cache": ["t0", "t1"]}


def test_a_paired_cell_s_interval_is_that_of_all_its_block_ratios_low_then_high():
    """12 blocks: the interval is the 3rd and 10th of the 12 sorted
    block-by-block ratios (median_interval's, k = 3), every block in it (the
    first one too), the low end in ci_low; and the median lies inside."""
    base = [100.0] * 12
    ours = [80.0, 101.0, 104.0, 99.0, 107.0, 95.0, 103.0, 110.0, 98.0, 102.0, 120.0, 97.0]
    cell = bench.paired_table({"greedy": {"mlx-lm caches": {"16": base}, "ours, in place": {"16": ours}}})[
        "greedy"]["ours, in place"]["16"]
    ratios = sorted(o / b for o, b in zip(ours, base, strict=True))
    assert bench.median_interval([o / b for o, b in zip(ours, base, strict=True)]) == (ratios[2], ratios[9])
    assert (cell["ci_low"], cell["ci_high"]) == (ratios[2], ratios[9]) == (0.97, 1.07)
    assert cell["ci_low"] <= cell["median"] <= cell["ci_high"] and cell["runs"] == 12
    assert cell["faster_in"] == 7


def test_the_schema_holds_a_paired_cell_s_interval_to_numbers_or_null():
    from tests.test_reports import valid

    rows = {"heads": 2, "head_dim": 8, "contexts": [16], "rows": [{"context": 16}], "ratio_last_over_first": {}}
    cell = {"median": 1.0, "low": 0.9, "high": 1.1, "ci_low": 0.95, "ci_high": 1.05, "faster_in": 3, "runs": 6}
    suite = {"date": "2026-01-01", "machine": "m", "device": "cpu", "backend": "cpu", "inplace_mechanism": "x",
             "mlx": "0", "contexts": [16], "cache_rows": rows,
             "e2e": {"tokens": 4, "repeats": 6, "rows": {}, "samples": {},
                     "paired": {"greedy": {"ours, in place": {"16": cell}}}}}

    def with_cell(**kw):
        return {**suite, "e2e": {**suite["e2e"], "paired": {"greedy": {"ours, in place": {"16": {**cell, **kw}}}}}}

    valid("bench", suite)
    valid("bench", with_cell(ci_low=None, ci_high=None))
    for broken in (with_cell(ci_low="0.95"), with_cell(ci_high="1.05"), with_cell(ci_low=[0.95]),
                   with_cell(ci_high={"v": 1.05})):
        with pytest.raises(jsonschema.ValidationError):
            valid("bench", broken)


def test_generators_are_closed_last_opened_first(monkeypatch):
    """mlx-lm's generators each enter a stream context when they start; closed
    in the reverse of the order they were opened, each context unwinds to the
    default stream the one before it saved."""
    closed: list[str] = []

    class Gen:
        def __init__(self, name: str):
            self.name = name

        def __next__(self):
            return (0, None)

        def close(self):
            closed.append(self.name)

    monkeypatch.setattr(bd, "_generator", lambda model, caches, *a, **k: Gen(caches[0]))
    monkeypatch.setattr(bd, "_sync", lambda: None)
    makers = {n: (lambda m, n=n: [n]) for n in ("a", "b", "c")}
    bd.interleaved_blocks(None, makers, 8, block=2, blocks=2, warmup=1)
    assert closed == ["c", "b", "a"]
