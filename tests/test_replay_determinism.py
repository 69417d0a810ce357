"""A verdict is a function of the trace alone (issue 47, docs/fuzzing.md,
"Determinism of a verdict").

``kvspec verify`` once printed a catch of the flagship's isolation-only
W=16 variant that Hypothesis could not replay (FlakyFailure): the same ops
diverged in one run and agreed in the next. The cause was a race in the
write layer: a ring's undo log schedules its gather of the row a decode
overwrites (``mx.async_eval``) and the in-place write went through host
memory at once, so the gather read the old row, the new one or a torn mix
as MLX's stream thread and the Python thread fell. Here:

* the write layer's host write waits for the reads of cache memory queued
  before it (``kvspec.impl.write.queue_read``), and ``impl`` queues no read of a
  buffer any other way;
* every catalog bug's shrunk trace (``tests/traces/<bug>.json``, also with
  the in-place decision unobserved for the bugs the kill matrix runs that
  way) and the race's own trace (``tests/traces/determinism/``) give one
  verdict (op index, observable, the whole message) 20 times in this
  process and 10 times in each of 2 fresh (spawned) processes.
"""

from __future__ import annotations

import copy
import multiprocessing
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvspec.fuzz.bugs import by_name, catalog, runnable
from kvspec.fuzz.replay import replay
from kvspec.fuzz.trace import load

TRACES = Path(__file__).parent / "traces"
IN_PROCESS, FRESH_PROCESSES, IN_EACH_FRESH = 20, 2, 10

#: traces whose verdict depended on more than their ops, each with the bug
#: and the in-place observation it was seen under
RACES = [("determinism/steady_state_inplace_undo_race.json", "steady_state_inplace", False)]


def cases() -> list[tuple[str, str, bool]]:
    """(trace, bug, check_inplace): every runnable catalog bug's trace as
    shipped, again with the in-place decision unobserved where the kill
    matrix runs the bug so, and :data:`RACES`."""
    out = []
    for bug in catalog():
        if not runnable(bug) or not (TRACES / f"{bug.name}.json").exists():
            continue  # GPU-only; a bug with no trace yet fails tests/test_replay.py
        out.append((f"{bug.name}.json", bug.name, True))
        if any(not check for _label, _fixed, check in bug.variants):
            out.append((f"{bug.name}.json", bug.name, False))
    return out + RACES


def verdict(trace, bug: str, check_inplace: bool) -> tuple:
    """What a replay says: agreement, or the divergence's op index, the
    observable that differs and the whole message (both sides)."""
    r = replay(copy.deepcopy(trace), by_name(bug).factories, check_inplace=check_inplace)
    d = r.divergence
    return (r.ok, r.ops_run) if d is None else (r.ok, d.index, d.what, str(d))


def verdicts(times: int) -> dict[tuple[str, str, bool], list[tuple]]:
    """Every case replayed ``times`` times in this process: case -> the
    distinct verdicts, in the order first seen."""
    out: dict[tuple[str, str, bool], list[tuple]] = {}
    loaded = {name: load(TRACES / name) for name in {c[0] for c in cases()}}
    for _ in range(times):
        for case in cases():
            got = verdict(loaded[case[0]], case[1], case[2])
            seen = out.setdefault(case, [])
            if got not in seen:
                seen.append(got)
    return out


@pytest.fixture(scope="module")
def replays() -> tuple[dict, list[dict]]:
    """(this process's verdicts over :data:`IN_PROCESS` replays, each fresh
    process's over :data:`IN_EACH_FRESH`): the fresh processes are one spawn
    pool (MLX hangs in a forked child once the parent evaluated an array),
    started first so that they replay while this process does."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(FRESH_PROCESSES) as pool:
        fresh = pool.map_async(verdicts, [IN_EACH_FRESH] * FRESH_PROCESSES)
        here = verdicts(IN_PROCESS)
        return here, fresh.get(timeout=300)


def test_every_bug_trace_gives_one_verdict_in_one_process(replays):
    in_process, _ = replays
    assert len(in_process) == len(cases()) > 80
    two = {f"{t} --bug {b}{'' if c else ' --isolation-only'}": v for (t, b, c), v in in_process.items() if len(v) > 1}
    assert not two, f"traces with more than one verdict in {IN_PROCESS} replays: {two}"
    for (trace, bug, check), [got] in in_process.items():
        if check and (trace, bug, check) not in RACES:
            assert got[0] is False, f"{trace} no longer diverges on {bug}"


def test_fresh_processes_give_the_same_verdicts(replays):
    in_process, fresh = replays
    assert len(fresh) == FRESH_PROCESSES
    for got in fresh:
        differ = {case: (in_process[case], v) for case, v in got.items() if v != in_process[case]}
        assert not differ, f"a fresh process gave other verdicts (this process's, the fresh one's): {differ}"


# -- the cause: a host write racing a read queued before it ----------------------------
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_an_in_place_host_write_comes_after_a_read_queued_before_it(dtype):
    """A gather of row 2 is queued (``kvspec.impl.write.queue_read``) behind slow
    work, as a ring's undo log queues the row a decode overwrites; the
    in-place write of row 2 then must not land before the gather has read
    it. With the gather scheduled by ``mx.async_eval`` alone, or without the
    write's wait, it read the written row (ones) every time in float16 and
    float32 (bfloat16's write evaluates new views first, which waits)."""
    from kvspec.impl.write import queue_read, write_inplace

    dst = mx.zeros((1, 1, 4, 8), dtype=dtype)
    row = mx.ones((1, 1, 1, 8), dtype=dtype)
    mx.eval(dst, row)  # both evaluated: the write itself has nothing to wait for
    slow = mx.ones((256, 256))
    for _ in range(3):
        slow = slow @ slow / 256
    at = (slow[0, :1] * 0).astype(mx.int32) + 2  # the gather runs only once the slow work is done
    saved = mx.take(dst, at, axis=2)
    queue_read(saved)
    out = write_inplace(dst, row, (slice(None), slice(None), slice(2, 3)), "numpy")
    assert out is dst
    assert np.array(saved.astype(mx.float32)).ravel().tolist() == [0.0] * 8, "the queued read saw the later write"
    assert np.array(dst[:, :, 2].astype(mx.float32)).ravel().tolist() == [1.0] * 8


def test_the_implementation_queues_reads_of_its_buffers_only_through_the_write_layer():
    """A read scheduled with ``mx.async_eval`` directly is not waited for by
    a host write (the race above): in ``impl`` only the Int8 range flag is,
    a read of the appended rows, never of a buffer."""
    impl = Path(__file__).resolve().parents[1] / "impl"
    found = sorted(f"{p.name}: {line.strip()}" for p in impl.glob("*.py") if p.name != "write.py"
                   for line in p.read_text().splitlines()
                   if "async_eval(" in line and not line.strip().startswith(("#", "(``", "``")))
    assert found == ["dense.py: mx.async_eval(flag)"], found
